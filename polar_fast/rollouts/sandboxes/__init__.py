"""Sandboxes: where a harness and a task's tests run. One small async interface, two backends.

    factory = make_sandbox_factory(cfg.sandbox, run_id="run-1")
    async with factory.open(SandboxSpec(name="rollout-7")) as box:
        result = await box.exec(["git", "status"], cwd=box.workdir, timeout_s=30)

`docker` (docker.py) runs one container per sandbox through aiodocker; `local` (local.py) runs
subprocesses in a temp dir for machines without Docker. Both give the same guarantees:
- `exec` with a timeout kills the whole process tree it started (its process group, plus every
  process that still carries the exec's marker variable, so a child that called setsid dies too);
- the proxy answers inside the box at `box.proxy_url` (http://127.0.0.1:PORT);
- a sandbox is removed when its `open()` block ends for any reason, including cancellation;
  `create()` / `remove()` exist for owners that hand a box between tasks (the pools), and
  `remove_leftovers(run_id)` finds what a crashed process left behind.
Failures of the sandbox itself (container died, daemon error) raise `SandboxError`, which the
pools class as an infra error; a command that fails is just a non-zero `exit_code`, and one that
fills its box's disk (`sandbox.disk_mb`, docker only) gets ENOSPC like any full file system.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, AsyncIterator, Protocol

import msgspec

from polar_fast.errors import PolarError

if TYPE_CHECKING:
    from polar_fast.config import SandboxConfig

EXEC_MARKER = "POLAR_EXEC_ID"  # env var set on every exec; the timeout kill sweeps by it
RUN_LABEL = "polar_fast.run"  # container label naming the run (docker), temp-dir prefix (local)


class SandboxError(PolarError):
    """The sandbox itself failed (did not start, died, daemon error): an infra error."""


class Mount(msgspec.Struct, frozen=True, kw_only=True):
    """A host path made visible in the box. Docker bind-mounts it; local uses the host path."""

    source: str  # host path
    target: str  # path inside a docker box
    read_only: bool = True


class SandboxSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What one sandbox needs. Fields a backend cannot honour are ignored (e.g. image in local)."""

    name: str = ""  # e.g. the rollout id; recorded as a label
    image: str = ""  # docker image; "" = the config's image, else the built-in base image
    mounts: list[Mount] = []
    env: dict[str, str] = {}  # added to every exec
    proxy_port: int = 0  # the proxy's loopback port on the host; 0 = no proxy
    proxy_socket: str = ""  # the proxy's Unix socket on the host (docker, network none)


class ExecResult(msgspec.Struct, frozen=True, kw_only=True):
    exit_code: int  # -9 style negative values are signals (local); 137 is SIGKILL (docker)
    stdout: str
    stderr: str
    timed_out: bool = False
    duration_s: float = 0.0
    truncated: bool = False  # stdout or stderr passed the backend's output cap; only its tail is kept


class HostCheck(msgspec.Struct, frozen=True, kw_only=True):
    """What a factory found at start about where its boxes live (`SandboxFactory.check`)."""

    data_root: str  # the host directory whose file system a box's files land on ("" = not on this host)
    disk_bound: str  # how sandbox.disk_mb is enforced, in words, for the run's log


class Sandbox(Protocol):
    workdir: str  # the task repo inside the box (absolute, as commands in the box see it)
    home: str  # a private HOME for the harness, empty at start
    proxy_url: str  # http://127.0.0.1:PORT or "" when the spec named no proxy

    def path(self, target: str) -> str:
        """Where a `Mount.target` is visible to commands in this box."""
        ...

    async def exec(
        self,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult: ...

    async def write_files(self, files: dict[str, str | bytes], *, mode: int = 0o644) -> None:
        """Write files; relative paths are under `workdir`. Parent directories are created."""
        ...

    async def read_file(self, path: str) -> bytes: ...

    async def alive(self) -> bool: ...

    async def remove(self) -> None:
        """Idempotent; safe to call while cancelled (it shields itself)."""
        ...


class SandboxFactory(Protocol):
    kind: str
    run_id: str

    async def check(self) -> HostCheck:
        """Checked at start: how the config's disk bound is enforced here; SandboxError when it
        cannot be (the message says what to change)."""
        ...

    async def create(self, spec: SandboxSpec) -> Sandbox: ...

    async def remove_leftovers(self, run_id: str | None = None) -> int:
        """Remove every sandbox labelled with `run_id` (default: this factory's); return the count."""
        ...

    def open(self, spec: SandboxSpec) -> contextlib.AbstractAsyncContextManager[Sandbox]: ...


@contextlib.asynccontextmanager
async def open_sandbox(factory: SandboxFactory, spec: SandboxSpec) -> AsyncIterator[Sandbox]:
    """create() then always remove(): teardown runs if and only if creation finished."""
    box = await factory.create(spec)
    try:
        yield box
    finally:
        await box.remove()


def kill_marked_script(marker: str, var: str = EXEC_MARKER) -> str:
    """A POSIX sh snippet that SIGKILLs every process whose environment carries var=marker.

    Process groups miss children that called setsid; the environment is inherited through both,
    so sweeping /proc for the exec's marker finds the rest. Repeats while it still finds some,
    since a dying parent's last fork can land between reads."""
    return (
        f'm="{var}={marker}"; for _ in 1 2 3 4 5; do found=; '
        "for d in /proc/[0-9]*; do p=${d#/proc/}; [ \"$p\" = \"$$\" ] && continue; "
        'if tr "\\000" "\\n" < "$d/environ" 2>/dev/null | grep -qxF "$m"; then '
        'kill -9 "$p" 2>/dev/null && found=1; fi; done; [ -z "$found" ] && break; done; true'
    )


SANDBOXES: dict[str, str] = {
    "local": "polar_fast.rollouts.sandboxes.local:LocalSandboxFactory",
    "docker": "polar_fast.rollouts.sandboxes.docker:DockerSandboxFactory",
}


def sandbox_class(kind: str) -> type:
    """The factory class for `kind` (imported lazily: local needs no aiodocker)."""
    try:
        target = SANDBOXES[kind]
    except KeyError:
        raise SandboxError(f"unknown sandbox kind {kind!r}; known: {', '.join(sorted(SANDBOXES))}") from None
    import importlib

    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def make_sandbox_factory(cfg: SandboxConfig, *, run_id: str) -> SandboxFactory:
    return sandbox_class(cfg.kind)(cfg, run_id=run_id)
