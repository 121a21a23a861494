"""Docker image names of published tasks, derived as their publishers derive them, and the check
that they are present before anything runs.

- SWE-bench (harness `ImageSpec.name`, remote images): `swebench/sweb.eval.x86_64.<instance_id>:latest`
  with `__` written `_1776_` (Docker Hub forbids double underscores), all lower case.
- SWE-Gym (its README; SkyRL's and OpenHands' `get_instance_docker_image`):
  `xingyaoww/sweb.eval.x86_64.<instance_id>:latest` with `__` written `_s_`, lower case.
- SkyRL-v0 rows say which with `data_source` ("swe-gym" / "swe-bench"); SkyRL's default is SWE-Gym.
  Flat rows carry no source: a repo of SWE-bench's table gets SWE-bench's name, any other repo
  with a known test spec SWE-Gym's. A repo no publisher lists gets no derived image (the config's
  image or the built-in base image, as for the built-in tasks).

Overrides, strongest first: `tasks.image`, a template such as `sweb.eval.x86_64.{instance_id}:latest`
(SWE-bench's name for images built locally with its harness; fields `instance_id`, `repo`,
`version`, `owner`, `name`), then the row's own `image` (or `image_name` / `docker_image`).
"""

from __future__ import annotations

import subprocess

from polar_fast.errors import PolarError
from polar_fast.rollouts.test_specs import SWEBENCH_REPOS, repo_spec

SWEBENCH_NAMESPACE = "swebench"
SWEGYM_NAMESPACE = "xingyaoww"
TEMPLATE_FIELDS = ("instance_id", "repo", "version", "owner", "name")


class ImageMissingError(PolarError):
    """A task's image is not in the local Docker Engine; the message says how to provide it."""


def swebench_image(instance_id: str, *, namespace: str = SWEBENCH_NAMESPACE) -> str:
    return f"{namespace}/sweb.eval.x86_64.{instance_id}:latest".replace("__", "_1776_").lower()


def swegym_image(instance_id: str, *, namespace: str = SWEGYM_NAMESPACE) -> str:
    return f"{namespace}/sweb.eval.x86_64.{instance_id.replace('__', '_s_')}:latest".lower()


def derive_image(instance_id: str, repo: str, *, data_source: str = "") -> str:
    """The publisher's image name for this task, or "" when no publisher lists the repo."""
    source = data_source.lower().replace("_", "-")
    if "swe-gym" in source:
        return swegym_image(instance_id)
    if "swe-bench" in source:
        return swebench_image(instance_id)
    if repo.lower() in SWEBENCH_REPOS:
        return swebench_image(instance_id)
    if repo_spec(repo) is not None or source:
        return swegym_image(instance_id)
    return ""


def image_from_template(template: str, *, instance_id: str, repo: str, version: str = "") -> str:
    owner, _, name = repo.partition("/")
    fields = {"instance_id": instance_id, "repo": repo, "version": version, "owner": owner, "name": name}
    try:
        return template.format(**fields).lower()
    except (KeyError, IndexError, ValueError) as e:
        raise ValueError(f"tasks.image template {template!r}: {e!r}; fields: {', '.join(TEMPLATE_FIELDS)}") from None


def missing_image_message(image: str, task_ids: list[str]) -> str:
    shown = ", ".join(task_ids[:3]) + (f" and {len(task_ids) - 3} more" if len(task_ids) > 3 else "")
    return (
        f"Docker image {image!r} (task {shown}) is not in the local Docker Engine. Provide it with "
        f"`docker pull {image}` where a registry is reachable, `docker load -i FILE.tar` from a saved copy, "
        "or build it with SWE-bench's harness (`python -m swebench.harness.prepare_images --instance_ids ID`; "
        "for SWE-Gym repos, SWE-Gym's fork of it) and point at it with tasks.image "
        "(e.g. \"sweb.eval.x86_64.{instance_id}:latest\") or the row's `image` field"
    )


def missing_images(images: list[str]) -> list[str]:
    """The images `docker image inspect` does not find (blocking: call from a thread)."""
    missing = []
    for image in dict.fromkeys(images):
        try:
            done = subprocess.run(["docker", "image", "inspect", "--format", "{{.Id}}", image], capture_output=True)
        except FileNotFoundError:
            raise ImageMissingError(f"tasks run in Docker images ({image!r}, ...) but no `docker` CLI is installed") from None
        if done.returncode != 0:
            missing.append(image)
    return missing


def check_images(tasks: list) -> None:
    """Raise ImageMissingError naming the first absent image of these tasks (those that name one)."""
    by_image: dict[str, list[str]] = {}
    for task in tasks:
        if task.image:
            by_image.setdefault(task.image, []).append(task.instance_id)
    if not by_image:
        return
    missing = missing_images(list(by_image))
    if missing:
        more = f" ({len(missing) - 1} more images are missing too)" if len(missing) > 1 else ""
        raise ImageMissingError(missing_image_message(missing[0], by_image[missing[0]]) + more)
