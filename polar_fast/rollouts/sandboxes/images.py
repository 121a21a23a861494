"""The built-in base image: Debian bookworm (minbase) with python3, git and procps.

No registry is reachable, so the image is built here: `debootstrap` into a temp dir, tar it, and
`docker import` the tar. The tag is a content hash of the recipe below, so a second run finds the
image and does nothing; changing the recipe changes the tag and triggers one rebuild. The mirror
comes from the host's apt sources (it does not change the image's content, so it is not hashed).
Bookworm's python3 is 3.11, like the project's own venv; tests in built-in tasks use stdlib
unittest, so the image needs no pytest. Run `python -m polar_fast.rollouts.sandboxes.images` to prebuild.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from polar_fast.errors import PolarError

RECIPE = {
    "version": 1,
    "suite": "bookworm",
    "variant": "minbase",
    "include": ["python3", "git", "ca-certificates", "procps"],
    # strip docs and apt lists: the image only runs repos and tests
    "strip": ["usr/share/doc", "usr/share/man", "usr/share/info", "var/lib/apt/lists", "var/cache/apt"],
}
REPOSITORY = "polar_fast/base"
DEFAULT_MIRROR = "http://deb.debian.org/debian"


class ImageBuildError(PolarError):
    """The base image could not be built; the message carries the failing step's output tail."""


def base_image_tag() -> str:
    digest = hashlib.sha256(json.dumps(RECIPE, sort_keys=True).encode()).hexdigest()[:16]
    return f"{REPOSITORY}:{digest}"


def host_mirror() -> str:
    """The Debian mirror the host's apt uses (deb822 or one-line sources), else deb.debian.org."""
    paths = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]
    for path in paths:
        try:
            text = path.read_text()
        except OSError:
            continue
        for match in re.finditer(r"^(?:URIs:\s*|deb\s+(?:\[[^]]*\]\s+)?)(\S+)", text, re.M):
            uri = match.group(1)
            if "security" not in uri and uri.rstrip("/").endswith("/debian"):
                return uri
    return DEFAULT_MIRROR


def image_exists(tag: str) -> bool:
    done = subprocess.run(["docker", "image", "inspect", tag], capture_output=True)
    return done.returncode == 0


def ensure_base_image(*, mirror: str | None = None) -> str:
    """Return the base image tag, building it first when Docker does not have it yet (blocking)."""
    tag = base_image_tag()
    if image_exists(tag):
        return tag
    if shutil.which("debootstrap") is None:
        raise ImageBuildError("building the base image needs `debootstrap` (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(prefix="polar-base-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        _run(
            [
                "debootstrap",
                f"--variant={RECIPE['variant']}",
                f"--include={','.join(RECIPE['include'])}",
                RECIPE["suite"],
                str(rootfs),
                mirror or host_mirror(),
            ],
            "debootstrap",
        )
        for rel in RECIPE["strip"]:
            shutil.rmtree(rootfs / rel, ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        try:
            _run(["docker", "import", "--change", "CMD [\"/bin/sh\"]", "-", tag], "docker import", stdin=tar.stdout)
        finally:
            tar.stdout.close()
            tar.wait()
    return tag


def _run(argv: list[str], step: str, *, stdin=None) -> None:
    done = subprocess.run(argv, stdin=stdin, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout)[-2000:]
        raise ImageBuildError(f"{step} failed (exit {done.returncode}):\n{tail}")


if __name__ == "__main__":
    print(ensure_base_image(mirror=sys.argv[1] if len(sys.argv) > 1 else None))
