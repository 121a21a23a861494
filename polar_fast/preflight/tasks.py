"""Task items: the source loads, held out means held out, every image is here.

Images: with `sandbox.kind = "docker"`, each task's image (the row's, tasks.image's, or the name
its publisher derives: rollouts/task_images.py) must be in the local Docker Engine, or the run
stops at start. Missing ones are listed with their `docker pull` and a disk estimate: the mean
size of the images of the same registry namespace already present, else IMAGE_GIB, the published
figure for SWE-bench Verified's prebuilt images (about 240 GiB for 500 images once unpacked;
Docker Hub allows 100 pulls per 6 hours anonymous, 200 logged in).
"""

from __future__ import annotations

import subprocess

from polar_fast.config import Config
from polar_fast.errors import PolarError
from polar_fast.preflight import Item, failed, not_applicable, passed
from polar_fast.rollouts.tasks import Task

IMAGE_GIB = 0.48  # per image: 240 GiB / 500 SWE-bench Verified images, unpacked (shared layers counted once)
SHOWN_PULLS = 20  # pull commands printed; the count says how many more
AREA = "tasks"


def check_tasks(cfg: Config) -> tuple[list[Item], list[Task]]:
    """The items, and the training tasks (empty when they do not load)."""
    from polar_fast.evaluate import heldout_tasks, training_tasks

    tc = cfg.tasks
    try:
        train = training_tasks(cfg)
    except PolarError as e:
        return [failed(AREA, "source", str(e), "fix tasks.source (docs/config.md [tasks]); "
                       "`python -m polar_fast tasks validate SOURCE` checks a task set")], []
    where = f"{tc.source!r}" + (f" split {tc.split!r}" if tc.source not in ("builtin",) else "")
    items = [passed(AREA, "source", f"{len(train)} training tasks from {where}")]
    ec = cfg.eval
    periodic = ec.every_steps or ec.at_start
    held: list[Task] = []
    try:
        held = heldout_tasks(cfg, ec.split, ec.limit)
        source = ec.source or tc.source
        items.append(passed(AREA, "held-out", f"{len(held)} tasks of {source!r} split {ec.split!r} share no "
                                              f"instance_id or repo + base_commit with the {len(train)} training tasks"))
    except PolarError as e:
        if periodic or ec.source:
            items.append(failed(AREA, "held-out", str(e), "set eval.source to held-out tasks (docs/config.md [eval])"))
        else:
            items.append(not_applicable(AREA, "held-out", f"no periodic eval (eval.every_steps = 0, at_start = false), "
                                                          f"and `eval` would refuse these tasks: {e}"))
    items.append(check_images(cfg, train + held))
    return items, train


def check_images(cfg: Config, tasks: list[Task]) -> Item:
    if cfg.sandbox.kind != "docker":
        return not_applicable(AREA, "images", f"sandbox.kind = {cfg.sandbox.kind!r}: tasks run without images")
    images = list(dict.fromkeys(t.image or cfg.sandbox.image for t in tasks if t.image or cfg.sandbox.image))
    if not images:
        return not_applicable(AREA, "images", "no task names an image: the built-in base image is built locally")
    try:
        local = local_images()
    except OSError as e:
        return failed(AREA, "images", f"cannot list the local Docker images: {e}",
                      "install Docker Engine and start it (scripts/docker_up.sh), then rerun")
    missing = [i for i in images if _normal(i) not in local]
    if not missing:
        return passed(AREA, "images", f"all {len(images)} task images are in the local Docker Engine")
    gib = sum(_estimate_gib(i, local) for i in missing)
    pulls = [f"docker pull {i}" for i in missing[:SHOWN_PULLS]]
    if len(missing) > SHOWN_PULLS:
        pulls.append(f"... and {len(missing) - SHOWN_PULLS} more (every task's image name: docs/gpu.md)")
    return failed(AREA, "images", f"{len(missing)} of {len(images)} task images are missing, about {gib:,.0f} GiB "
                  "of disk unpacked", "pull them (or `docker load` saved copies) before the run; the run stops at "
                  "start on a missing image", details=pulls)


def local_images() -> dict[str, int]:
    """Every image of the local Docker Engine, as `repo:tag` -> bytes (blocking)."""
    try:
        done = subprocess.run(["docker", "image", "ls", "--no-trunc", "--format", "{{.Repository}}:{{.Tag}}\t{{.Size}}"],
                              capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise OSError("no `docker` command on PATH") from None
    except subprocess.TimeoutExpired:
        raise OSError("`docker image ls` did not answer within 60 s") from None
    if done.returncode != 0:
        raise OSError(done.stderr.strip()[-300:] or f"`docker image ls` exited {done.returncode}")
    out = {}
    for line in done.stdout.splitlines():
        name, _, size = line.partition("\t")
        out[_normal(name)] = _bytes(size)
    return out


def _normal(image: str) -> str:
    name = image.removeprefix("docker.io/").removeprefix("library/")
    return name if ":" in name.rsplit("/", 1)[-1] else name + ":latest"


def _bytes(size: str) -> int:
    units = {"B": 1, "kB": 1e3, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}
    for unit in sorted(units, key=len, reverse=True):
        if size.endswith(unit):
            try:
                return int(float(size[: -len(unit)]) * units[unit])
            except ValueError:
                return 0
    return 0


def _estimate_gib(image: str, local: dict[str, int]) -> float:
    namespace = image.split("/")[0] if "/" in image else ""
    sizes = [size for name, size in local.items() if namespace and name.startswith(namespace + "/") and size]
    return (sum(sizes) / len(sizes) / 2**30) if sizes else IMAGE_GIB
