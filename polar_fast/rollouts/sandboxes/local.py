"""`local` sandbox: subprocesses in a temp dir, for machines without Docker.

No isolation: commands run as this user with the host's tools (python3, git on PATH); the temp
dir only keeps rollouts apart. Every exec starts a new session (its own process group) and carries
two marker variables (one per exec, one per box); a timeout SIGKILLs the group and then sweeps
/proc for processes still carrying the exec's marker, and `remove()` sweeps the box's marker, so
nothing a rollout started outlives it. Mount targets map to their host sources (`path()`), and the
proxy is the host's own loopback port, so `proxy_url` matches the docker backend's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path

import anyio
import anyio.abc

from polar_fast.rollouts.sandboxes import EXEC_MARKER, ExecResult, HostCheck, SandboxError, SandboxSpec, open_sandbox

BOX_MARKER = "POLAR_BOX_ID"
MAX_OUTPUT_BYTES = 8 << 20  # per stream; beyond this the head is dropped and the tail kept
_PREFIX = "polar-"


class LocalSandbox:
    def __init__(self, root: Path, spec: SandboxSpec) -> None:
        self.root = root
        self.spec = spec
        self.box_id = uuid.uuid4().hex
        self.workdir = str(root / "testbed")
        self.home = str(root / "home")
        self.proxy_url = f"http://127.0.0.1:{spec.proxy_port}" if spec.proxy_port else ""
        self._mounts = {m.target: m.source for m in spec.mounts}
        self._removed = False

    def _check(self) -> None:
        if self._removed:
            raise SandboxError(f"sandbox {self.root} was removed")

    def path(self, target: str) -> str:
        if target in self._mounts:
            return self._mounts[target]
        return self._abs(target)

    def _abs(self, path: str) -> str:
        return path if os.path.isabs(path) else os.path.join(self.workdir, path)

    async def exec(
        self,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        stdin: bytes | None = None,
    ) -> ExecResult:
        self._check()
        marker = uuid.uuid4().hex
        full_env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": self.home,
            "LANG": "C.UTF-8",
            **self.spec.env,
            **(env or {}),
            EXEC_MARKER: marker,
            BOX_MARKER: self.box_id,
        }
        started = time.monotonic()
        try:
            proc = await anyio.open_process(
                argv,
                stdin=-1 if stdin is not None else -3,  # subprocess.PIPE / DEVNULL
                cwd=self._abs(cwd) if cwd else self.workdir,
                env=full_env,
                start_new_session=True,
            )
        except OSError as e:
            # a missing program is the command's failure, as a shell would report it
            return ExecResult(exit_code=127, stdout="", stderr=f"{argv[0]}: {e.strerror}", duration_s=0.0)
        out, err = bytearray(), bytearray()
        cut = [False]  # set when a stream passed MAX_OUTPUT_BYTES
        timed_out = False
        try:
            with anyio.move_on_after(timeout_s) as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_drain, proc.stdout, out, cut)
                    tg.start_soon(_drain, proc.stderr, err, cut)
                    if stdin is not None:
                        tg.start_soon(_feed, proc.stdin, stdin)
                await proc.wait()
            timed_out = scope.cancelled_caught
        finally:
            if proc.returncode is None:  # timeout or cancellation: kill the whole tree
                with anyio.CancelScope(shield=True):
                    await _kill_tree(proc.pid, marker)
                    await proc.wait()
        return ExecResult(
            exit_code=proc.returncode if proc.returncode is not None else -9,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            timed_out=timed_out,
            duration_s=time.monotonic() - started,
            truncated=cut[0],
        )

    async def write_files(self, files: dict[str, str | bytes], *, mode: int = 0o644) -> None:
        self._check()
        items = {self._abs(p): c.encode() if isinstance(c, str) else c for p, c in files.items()}
        await anyio.to_thread.run_sync(_write_files, items, mode)

    async def read_file(self, path: str) -> bytes:
        self._check()
        try:
            return await anyio.Path(self._abs(path)).read_bytes()
        except OSError as e:
            raise FileNotFoundError(f"{path}: {e.strerror}") from None

    async def alive(self) -> bool:
        return not self._removed and await anyio.Path(self.root).is_dir()

    async def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(sweep_marked, BOX_MARKER, self.box_id)
            await anyio.to_thread.run_sync(lambda: shutil.rmtree(self.root, ignore_errors=True))


class LocalSandboxFactory:
    kind = "local"

    def __init__(self, cfg=None, *, run_id: str, base_dir: str | None = None) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.base_dir = Path(base_dir or tempfile.gettempdir())

    async def check(self) -> HostCheck:
        return HostCheck(data_root=str(self.base_dir),
                         disk_bound=f"not bounded: a local box writes to {self.base_dir} as this user (docs/config.md)")

    async def create(self, spec: SandboxSpec) -> LocalSandbox:
        def make() -> Path:
            root = Path(tempfile.mkdtemp(prefix=f"{_PREFIX}{self.run_id}--", dir=self.base_dir))
            (root / "testbed").mkdir()
            (root / "home").mkdir()
            return root

        try:
            root = await anyio.to_thread.run_sync(make)
        except OSError as e:
            raise SandboxError(f"cannot create a local sandbox in {self.base_dir}: {e}") from None
        return LocalSandbox(root, spec)

    def open(self, spec: SandboxSpec):
        return open_sandbox(self, spec)

    async def remove_leftovers(self, run_id: str | None = None) -> int:
        prefix = f"{_PREFIX}{run_id or self.run_id}--"

        def sweep() -> int:
            roots = [p for p in self.base_dir.iterdir() if p.name.startswith(prefix) and p.is_dir()]
            for root in roots:
                shutil.rmtree(root, ignore_errors=True)
            return len(roots)

        with anyio.CancelScope(shield=True):
            return await anyio.to_thread.run_sync(sweep)

    async def aclose(self) -> None:
        pass


async def _drain(stream: anyio.abc.ByteReceiveStream, into: bytearray, cut: list[bool]) -> None:
    async for chunk in stream:
        into += chunk
        if len(into) > MAX_OUTPUT_BYTES:
            del into[: len(into) - MAX_OUTPUT_BYTES]
            cut[0] = True


async def _feed(stream: anyio.abc.ByteSendStream, data: bytes) -> None:
    with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
        await stream.send(data)
    await stream.aclose()


async def _kill_tree(pid: int, marker: str) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)  # the exec's own session: pgid == pid
    await anyio.to_thread.run_sync(sweep_marked, EXEC_MARKER, marker)


def sweep_marked(var: str, value: str) -> int:
    """SIGKILL every process of ours whose environment holds var=value; return how many."""
    needle = f"{var}={value}".encode()
    killed = 0
    for _ in range(5):  # a parent killed mid-fork may leave a child we read too early
        found = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
            except OSError:
                continue
            if needle in environ:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(entry.name), signal.SIGKILL)
                    found += 1
        killed += found
        if not found:
            break
    return killed


def _write_files(items: dict[str, bytes], mode: int) -> None:
    for path, data in items.items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        os.chmod(path, mode)
