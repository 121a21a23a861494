"""Self-contained harness bundles: one directory per harness, cached by a content key.

A bundle is built once under `bundle_root` (default ~/.cache/polar_fast/harnesses) and then used
read-only: mounted into a Docker container built from a Debian minbase image (python3 + git), or
used in place by a local sandbox. Choices:

- Directory name `<harness>-<key>`, key = sha256 of everything that decides the contents (pinned
  package versions, Node version, CPU, Python minor). A finished bundle holds `.polar-bundle.json`;
  its presence makes a second install a no-op. Building happens in a temp sibling under a file
  lock, is checked by running the CLI's `--version`, then renamed into place atomically.
- Node comes from the npm package `node-linux-<arch>` (the official nodejs.org build, pinned):
  Claude Code and Qwen Code need Node >= 22, newer than many hosts' Node, and nodejs.org itself may
  be unreachable. It needs only glibc, libstdc++ and libgcc_s, which minbase has (apt links them);
  `_check_libs` fails the install if a future build needs more.
- Entry points are tiny `#!/bin/sh` wrappers in `bin/` that locate the bundle from `$0`, so the
  same bundle works at any mount point.
- Python packages go in with `pip install --target` for the container's interpreter (Debian
  bookworm: python3.11), byte-compiled at install time because the mount is read-only.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from polar_fast.errors import PolarError

NODE_VERSION = "22.23.5"  # npm package node-linux-<arch>@NODE_VERSION
PYTHON_VERSION = "3.11"  # Debian bookworm's /usr/bin/python3, the container image's interpreter
LAYOUT = 1  # bump when the bundle layout changes, so old caches are not reused
MANIFEST = ".polar-bundle.json"
INSTALL_TIMEOUT_S = 900.0
CHECK_TIMEOUT_S = 120.0
# Libraries every Debian minbase has (glibc, and libstdc++/libgcc_s because apt links them).
_MINBASE_LIBS = ("linux-vdso", "ld-linux", "libc.so", "libm.so", "libdl.so", "libpthread.so",
                 "librt.so", "libstdc++.so", "libgcc_s.so")
_NODE_ARCH = {"x86_64": "x64", "aarch64": "arm64"}


class BundleError(PolarError):
    """A harness bundle could not be built; the message says which step failed and why."""


def default_bundle_root() -> Path:
    return Path.home() / ".cache" / "polar_fast" / "harnesses"


def bundle_root(bundle_dir: str) -> Path:
    """Where harness bundles live for `harness.bundle_dir` ("" = the default cache)."""
    return Path(bundle_dir) if bundle_dir else default_bundle_root()


def build_bundle(bundle_root: Path, name: str, spec: dict, build: Callable[[Path], None],
                 check_argv: list[str]) -> Path:
    """Return `bundle_root/<name>-<key>`, building it with `build(tmp_dir)` if not cached.

    `check_argv` (relative to the bundle dir for its first element) must exit 0 on the new bundle.
    """
    key = hashlib.sha256(json.dumps({"layout": LAYOUT, **spec}, sort_keys=True).encode()).hexdigest()[:16]
    final = Path(bundle_root).expanduser().absolute() / f"{name}-{key}"
    if (final / MANIFEST).exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two installers of one harness wait, then reuse
        if (final / MANIFEST).exists():
            return final
        tmp = final.parent / f".{final.name}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)  # a half-built leftover without manifest
        tmp.mkdir()
        try:
            build(tmp)
            run_check([str(tmp / check_argv[0]), *check_argv[1:]], what=f"{name} bundle")
            (tmp / MANIFEST).write_text(json.dumps({"name": name, "key": key, **spec}, indent=1))
            tmp.rename(final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def run(argv: list[str], *, what: str, env: dict[str, str] | None = None,
        timeout_s: float = INSTALL_TIMEOUT_S, check: bool = True) -> str:
    """Run an install step; on failure raise BundleError with the step's output tail."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    except FileNotFoundError:
        raise BundleError(f"{what}: {argv[0]!r} not found; install it first") from None
    except subprocess.TimeoutExpired:
        raise BundleError(f"{what}: {' '.join(argv[:3])} ... ran past {timeout_s:.0f} s") from None
    if check and done.returncode != 0:
        tail = (done.stdout + done.stderr)[-2000:]
        raise BundleError(f"{what}: {' '.join(argv[:4])} ... exited {done.returncode}:\n{tail}")
    return done.stdout


def run_check(argv: list[str], *, what: str) -> str:
    """Run a bundle's CLI (e.g. `--version`) with a throwaway HOME and a plain PATH."""
    with tempfile.TemporaryDirectory(prefix="polar-bundle-check-") as home:
        env = {"HOME": home, "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
               "PI_OFFLINE": "1", "DISABLE_AUTOUPDATER": "1", "NO_UPDATE_NOTIFIER": "1"}
        return run(argv, what=f"{what} check", env=env, timeout_s=CHECK_TIMEOUT_S)


def write_script(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)


def npm_install(prefix: Path, packages: dict[str, str], *, what: str) -> None:
    """`npm install --prefix` of exactly these pinned packages (optional native deps included)."""
    if shutil.which("npm") is None:
        raise BundleError(f"{what}: npm is not installed (apt-get install npm, or a Node.js release)")
    specs = [f"{pkg}@{version}" for pkg, version in packages.items()]
    env = {**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false",
           "npm_config_audit": "false"}
    run(["npm", "install", "--prefix", str(prefix), "--no-save", "--omit=dev", "--loglevel=error",
         *specs], what=what, env=env)


def node_arch() -> str:
    machine = platform.machine()
    if machine not in _NODE_ARCH:
        raise BundleError(f"no Node.js bundle for CPU {machine!r}; supported: {', '.join(_NODE_ARCH)}")
    return _NODE_ARCH[machine]


def node_runtime(bundle_root: Path) -> Path:
    """The cached official Node binary (its own bundle, shared by the npm harnesses' builds)."""
    package = f"node-linux-{node_arch()}"

    def build(tmp: Path) -> None:
        npm_install(tmp, {package: NODE_VERSION}, what="node runtime")
        real = tmp / "node_modules" / package / "bin" / "node"
        (tmp / "bin").mkdir()
        shutil.copy2(real, tmp / "bin" / "node")
        shutil.rmtree(tmp / "node_modules")
        _check_libs(tmp / "bin" / "node")

    root = build_bundle(bundle_root, "_node", {"node": NODE_VERSION, "arch": package}, build, ["bin/node", "--version"])
    return root / "bin" / "node"


def _check_libs(binary: Path) -> None:
    out = run(["ldd", str(binary)], what=f"ldd {binary.name}")
    names = [os.path.basename(line.split()[0]) for line in out.splitlines() if line.strip()]
    extra = [n for n in names if not n.startswith(_MINBASE_LIBS)]
    if extra:
        raise BundleError(f"{binary} needs libraries a Debian minbase image lacks: {', '.join(extra)}")


def link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)  # same filesystem: no second copy of a 100 MB binary
    except OSError:
        shutil.copy2(src, dst)


def install_npm_harness(bundle_root: Path, name: str, packages: dict[str, str], bin_name: str,
                        *, with_node: bool = True, check_args: list[str] | None = None) -> Path:
    """Bundle = node_modules of `packages` (+ `bin/node`) and a `bin/<bin_name>` wrapper that runs
    `node_modules/.bin/<bin_name>` (with the bundled node unless the CLI is a native binary)."""
    node = node_runtime(bundle_root) if with_node else None

    def build(tmp: Path) -> None:
        npm_install(tmp, packages, what=f"{name} npm install")
        entry = f'"$d/../node_modules/.bin/{bin_name}"'
        if node is not None:
            link_or_copy(node, tmp / "bin" / "node")
            entry = f'"$d/node" {entry}'
        write_script(tmp / "bin" / bin_name,
                     f'#!/bin/sh\nd=$(cd "$(dirname "$0")" && pwd)\nexec {entry} "$@"\n')

    spec = {"packages": packages, "node": NODE_VERSION if with_node else None, "arch": platform.machine()}
    return build_bundle(bundle_root, name, spec, build, [f"bin/{bin_name}", *(check_args or ["--version"])])


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def install_binary_harness(bundle_root: Path, name: str, binary: Path, sha256: str, bin_name: str,
                           *, check_args: list[str] | None = None) -> Path:
    """Bundle = a prebuilt executable from the host, copied to `bin/<bin_name>` (a copy: the
    bundle is mounted into boxes that cannot see the host path) once its sha256 is `sha256`.
    The hash is part of the bundle key, so a new build of the CLI is a new bundle."""
    if not binary.is_file():
        raise BundleError(f"{name}: install.binary {binary} is not a file on this host")
    found = file_sha256(binary)
    if found != sha256:
        raise BundleError(f"{name}: install.binary {binary} has sha256 {found}, not the pinned {sha256}: "
                          "pin the new hash (install.sha256) if this build is the one to use")

    def build(tmp: Path) -> None:
        target = tmp / "bin" / bin_name
        target.parent.mkdir(parents=True)
        shutil.copy2(binary, target)
        target.chmod(0o755)
        if file_sha256(target) != sha256:  # changed between the check and the copy
            raise BundleError(f"{name}: {binary} changed while it was copied")

    spec = {"binary_sha256": sha256, "bin": bin_name, "arch": platform.machine()}
    return build_bundle(bundle_root, name, spec, build, [f"bin/{bin_name}", *(check_args or ["--version"])])


def python_for_bundles() -> str:
    """An interpreter of the container's Python minor version on this host, to install with."""
    found = shutil.which(f"python{PYTHON_VERSION}")
    if found is None:
        raise BundleError(f"python{PYTHON_VERSION} is needed on this host to build Python harness "
                          "bundles (the container image runs Debian bookworm's python3.11)")
    return found


def pip_install_target(target: Path, requirements: list[str], *, what: str) -> None:
    """Install `requirements` (+ deps) into `target` for python{PYTHON_VERSION}, byte-compiled."""
    python = python_for_bundles()
    if shutil.which("uv"):
        argv = ["uv", "pip", "install", "-q", "-p", python, "--target", str(target), *requirements]
    else:
        argv = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                "--target", str(target), *requirements]
    run(argv, what=what)
    # The bundle is mounted read-only; without .pyc files every run would recompile litellm.
    # A few shipped files (py2 examples, templates) never compile; that is not an error.
    run([python, "-m", "compileall", "-q", "-j", "0", str(target)], what=f"{what} compileall", check=False)


def python_module_wrapper(module: str, prog: str) -> str:
    """`bin/<prog>`: runs `module` with the bundle's `site/` first on sys.path (put there by the
    wrapper, not PYTHONPATH, so the agent's own shell commands see the task's Python untouched)."""
    return f"""#!/bin/sh
d=$(cd "$(dirname "$0")/.." && pwd)
exec python{PYTHON_VERSION} -I -B -c '
import runpy, sys
sys.path.insert(0, sys.argv.pop(1))
sys.argv[0] = "{prog}"
runpy.run_module("{module}", run_name="__main__", alter_sys=True)
' "$d/site" "$@"
"""
