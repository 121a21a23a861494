"""`docker` sandbox: one container per sandbox, through aiodocker against a real Docker Engine.

Choices:
- The container runs `sleep infinity` under docker-init (reaps zombies); every command is a
  `docker exec` as the unprivileged `sandbox.user` (1000:1000 by default), which holds no
  capabilities. Never privileged, no-new-privileges, all capabilities dropped but CHOWN, used
  once: at boot one root exec hands the repo, home and tmp directories to that user (a task
  image's repo belongs to root). cpu / memory / pids limits from the config.
- `sandbox.read_only_root` (default on): the image's file system is read-only; the repo
  (`workdir`, holding the image's copy of it) and /tmp (with HOME under it) are the box's
  writable file systems, removed with it.
- `sandbox.disk_mb` bounds each of them, so a box cannot fill the host's disk; a write past it
  gets ENOSPC in the box. `check()` picks how, once, from `docker info`: where the storage
  driver offers size limits (overlay2 on xfs with project quotas) they are volumes with the
  local driver's `size` option (and the image layer's `size` storage option when the root is
  writable); everywhere else (overlay2 on ext4, as on CI) they are size-limited tmpfs mounts,
  which count against `memory_mb` and never touch the host's disk, so 2 x disk_mb may take at
  most half of memory_mb, and the root must be read-only (nothing else could bound it).
  `disk_mb = 0` keeps plain anonymous volumes on the host's disk, unbounded.
- Files go in and out through an exec (`tar -x` from stdin, `cat`), never Docker's archive API,
  which would write beneath a tmpfs instead of into it. A tmpfs starts empty, so at boot the
  image's copy of the repo is streamed into it from a created, never started, twin container.
- Network `none` by default: the proxy's Unix socket is bind-mounted at PROXY_SOCKET and the
  loopback forwarder (forwarder.py, mounted read-only) listens on 127.0.0.1:PORT inside, so a
  harness sees the same `http://127.0.0.1:PORT` as on the host and has no other egress. `host`
  networking is the explicit alternative (then the forwarder is not needed).
- Every container carries the label `polar_fast.run=<run id>`; `remove_leftovers` deletes by it.
- An exec's timeout kills its process tree by sweeping /proc inside the container for the exec's
  marker variable (inherited across fork and setsid). A process that clears its own environment
  escapes the sweep, but not the container's removal at the end of the rollout.
- Daemon errors and a container that is no longer running raise SandboxError (infra error).
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import tarfile
import time
import uuid
from pathlib import Path
from typing import AsyncIterable

import aiodocker
import anyio

from polar_fast.config import SandboxConfig
from polar_fast.rollouts.sandboxes import (
    EXEC_MARKER,
    RUN_LABEL,
    ExecResult,
    HostCheck,
    SandboxError,
    SandboxSpec,
    kill_marked_script,
    open_sandbox,
)
from polar_fast.rollouts.sandboxes.images import ensure_base_image

NAME_LABEL = "polar_fast.name"
PROXY_SOCKET = "/run/polar/proxy.sock"
FORWARDER = "/opt/polar/forwarder.py"
FORWARDER_SOURCE = Path(__file__).with_name("forwarder.py")
MAX_OUTPUT_BYTES = 8 << 20  # per stream; the tail is kept
HOME = "/tmp/polar-home"
ROOT = "0:0"  # only the boot step's mkdir + chown runs as root
# CHOWN: that boot step gives the repo and home to the box user. Nothing else: the box user's
# processes hold no capabilities anyway (a non-root exec drops them), and root never runs
# anything the box controls.
_CAPS = ["CHOWN"]
COPY_CHUNK_BYTES = 1 << 20
TMP = "/tmp"
# how sandbox.disk_mb is enforced (DockerSandboxFactory.check): volumes with an XFS project quota,
# size-limited tmpfs mounts, or (disk_mb = 0) plain volumes on the host's disk
QUOTA, TMPFS, UNBOUNDED = "quota", "tmpfs", "unbounded"


def forwarder_argv(port: int) -> list[str]:
    """How the forwarder is started inside the box (its CLI is owned by forwarder.py)."""
    return ["python3", FORWARDER, "--port", str(port), "--socket", PROXY_SOCKET]


class DockerSandbox:
    def __init__(self, factory: DockerSandboxFactory, container, spec: SandboxSpec, workdir: str) -> None:
        self._factory = factory
        self.container = container
        self.id: str = container.id
        self.spec = spec
        self.workdir = workdir
        self.home = HOME
        self.proxy_url = f"http://127.0.0.1:{spec.proxy_port}" if spec.proxy_port else ""
        self._removed = False

    def path(self, target: str) -> str:
        return target

    def _abs(self, path: str) -> str:
        return path if path.startswith("/") else f"{self.workdir}/{path}"

    async def exec(
        self,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout_s: float | None = None,
        stdin: bytes | AsyncIterable[bytes] | None = None,
        detach: bool = False,
        user: str = "",
    ) -> ExecResult:
        """`stdin` is streamed to the command (bytes, or chunks as they come), then closed."""
        marker = uuid.uuid4().hex
        full_env = {"HOME": self.home, "LANG": "C.UTF-8", **self.spec.env, **(env or {}), EXEC_MARKER: marker}
        started = time.monotonic()
        try:
            ex = await self.container.exec(
                argv,
                user=user or self._factory.cfg.user,
                environment=full_env,
                workdir=self._abs(cwd) if cwd else self.workdir,
                stdin=stdin is not None,
                stdout=not detach,
                stderr=not detach,
            )
            if detach:
                await ex.start(detach=True)
                return ExecResult(exit_code=0, stdout="", stderr="", duration_s=0.0)
        except aiodocker.DockerError as e:
            raise SandboxError(f"container {self.id[:12]}: exec failed: {e.message}") from None
        out, err = bytearray(), bytearray()
        cut = [False]  # set when a stream passed MAX_OUTPUT_BYTES
        timed_out = finished = False
        stream = ex.start(detach=False)
        try:
            with anyio.move_on_after(timeout_s) as scope:
                async with anyio.create_task_group() as tg:
                    if stdin is not None:
                        await stream._init()  # connect once, before the writer and the reader share it
                        tg.start_soon(_feed, stream, stdin)
                    await _read_stream(stream, out, err, cut)
                finished = True
            timed_out = scope.cancelled_caught
        finally:
            if not finished:  # timeout or cancellation: kill the exec's whole process tree
                with anyio.CancelScope(shield=True), anyio.move_on_after(30):
                    await self._kill_marked(marker)
            with anyio.CancelScope(shield=True):
                await stream.close()
        exit_code = await self._exit_code(ex, timed_out)
        return ExecResult(
            exit_code=exit_code,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            timed_out=timed_out,
            duration_s=time.monotonic() - started,
            truncated=cut[0],
        )

    async def _exit_code(self, ex, timed_out: bool) -> int:
        try:
            info = await ex.inspect()
            for _ in range(50):  # the stream can end a moment before the exec is reaped
                if not info["Running"]:
                    break
                await anyio.sleep(0.05)
                info = await ex.inspect()
        except aiodocker.DockerError as e:
            raise SandboxError(f"container {self.id[:12]}: exec inspect failed: {e.message}") from None
        code = info.get("ExitCode")
        if timed_out:
            return code if code is not None else 137
        if code is None or not await self._alive_after(code):
            raise SandboxError(f"container {self.id[:12]} stopped while a command ran")
        return code

    async def _alive_after(self, code: int) -> bool:
        """A container being killed ends its execs with 137 a moment before it shows as stopped:
        give it that moment, or the kill would pass for the agent's own failure (reward 0)."""
        if code != 137:
            return await self.alive()
        for _ in range(20):
            if not await self.alive():
                return False
            await anyio.sleep(0.1)
        return True

    async def _kill_marked(self, marker: str) -> None:
        with contextlib.suppress(aiodocker.DockerError):
            # as the box user: it may read its own processes' environments and kill them
            ex = await self.container.exec(["sh", "-c", kill_marked_script(marker)], user=self._factory.cfg.user,
                                           stdout=True, stderr=True)
            stream = ex.start(detach=False)
            try:
                await _read_stream(stream, bytearray(), bytearray(), [False])
            finally:
                await stream.close()

    async def write_files(self, files: dict[str, str | bytes], *, mode: int = 0o644) -> None:
        """Written by the box user through `tar -x` in the box, one archive per writable root
        (workdir, /tmp); a path elsewhere lands on the image's root, writable only when
        read_only_root is off."""
        by_root: dict[str, dict[str, bytes]] = {}
        for path, content in files.items():
            full = self._abs(path)
            root = next((r for r in (self.workdir, TMP) if full.startswith(r + "/")), "/")
            by_root.setdefault(root, {})[full] = content.encode() if isinstance(content, str) else content
        uid, _, gid = self._factory.cfg.user.partition(":")
        for root, group in by_root.items():
            await self.untar(root, _owned_tar(root, group, mode, int(uid), int(gid or uid)))

    async def untar(self, root: str, tar: bytes | AsyncIterable[bytes], *, user: str = "") -> None:
        """Extract a tar archive (bytes, or chunks as they come) into `root` inside the box."""
        done = await self.exec(["tar", "-x", "-f", "-", "-C", root], stdin=tar, cwd="/", user=user)
        if done.exit_code != 0:
            raise SandboxError(f"container {self.id[:12]}: copying files into {root} failed: {done.stderr.strip()[-500:]}")

    async def read_file(self, path: str) -> bytes:
        """Read through base64 in the box (exec output is text), so up to ~6 MiB."""
        script = 'test -f "$1" || exit 44; exec base64 -w 0 -- "$1"'
        done = await self.exec(["sh", "-c", script, "read", self._abs(path)], cwd="/")
        if done.exit_code == 44:
            raise FileNotFoundError(f"{path}: not a file in container {self.id[:12]}")
        if done.exit_code != 0 or done.truncated:
            why = "too large to read this way" if done.truncated else done.stderr.strip()[-500:]
            raise SandboxError(f"container {self.id[:12]}: reading {path} failed: {why}")
        return base64.b64decode(done.stdout)

    async def alive(self) -> bool:
        try:
            info = await self.container.show()
        except aiodocker.DockerError:
            return False
        return bool(info["State"]["Running"])

    async def remove(self) -> None:
        if self._removed:
            return
        self._removed = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(60):
            await _delete(self.container)
            if self._factory.disk == QUOTA:  # `docker rm -v` leaves volumes made through Mounts
                await self._factory.remove_volumes()


class DockerSandboxFactory:
    kind = "docker"

    def __init__(self, cfg: SandboxConfig | None = None, *, run_id: str, docker: aiodocker.Docker | None = None) -> None:
        self.cfg = cfg or SandboxConfig(kind="docker")
        self.run_id = run_id
        self._docker = docker
        self._own_client = docker is None
        self._base_image: str | None = None
        self._host: HostCheck | None = None
        self.disk = ""  # QUOTA, TMPFS or UNBOUNDED, once check() ran

    @property
    def docker(self) -> aiodocker.Docker:
        if self._docker is None:  # created lazily: aiodocker binds to the running loop
            # an explicit url: otherwise the constructor stats sockets and reads ~/.docker on the loop
            self._docker = aiodocker.Docker(url=os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock")
        return self._docker

    async def check(self) -> HostCheck:
        """How `disk_mb` is enforced on this Docker Engine (see the module docstring), decided
        once from `docker info`; SandboxError when it cannot be."""
        if self._host is None:
            try:
                info = await self.docker.system.info()
            except aiodocker.DockerError as e:
                raise SandboxError(f"docker info failed: {e.message}") from None
            driver = info.get("Driver", "?")
            backing = dict(info.get("DriverStatus") or []).get("Backing Filesystem", "?")
            self.disk, bound = await self._disk_mode(driver, backing)
            root = info.get("DockerRootDir", "")
            local = not os.environ.get("DOCKER_HOST", "unix://").startswith(("tcp://", "ssh://"))
            self._host = HostCheck(data_root=root if local else "", disk_bound=bound)
        return self._host

    async def _disk_mode(self, driver: str, backing: str) -> tuple[str, str]:
        cfg, where = self.cfg, f"{driver} on {backing}"
        if cfg.disk_mb <= 0:
            return UNBOUNDED, f"not bounded (sandbox.disk_mb = 0): boxes write to Docker volumes on the host's disk ({where})"
        if driver == "overlay2" and backing == "xfs" and await self._volume_quota_works():
            return QUOTA, f"{cfg.disk_mb} MiB per file system by XFS project quota ({where})"
        if not cfg.read_only_root:
            raise SandboxError(
                f"sandbox.read_only_root = false leaves the image's file system writable, and {where} cannot bound "
                "it (overlay2 size limits need xfs with project quotas): set read_only_root = true, or "
                "sandbox.disk_mb = 0 to let boxes write to the host's disk unbounded")
        if 2 * cfg.disk_mb > cfg.memory_mb // 2:
            raise SandboxError(
                f"sandbox.disk_mb = {cfg.disk_mb}: {where} has no size limits, so a box's repo and /tmp are tmpfs "
                f"mounts of disk_mb each, which count against sandbox.memory_mb = {cfg.memory_mb}; the two may take "
                "at most half of it. Lower disk_mb or raise memory_mb")
        return TMPFS, (f"{cfg.disk_mb} MiB per file system as tmpfs ({where} has no size limits), counted in "
                       f"sandbox.memory_mb = {cfg.memory_mb}")

    async def _volume_quota_works(self) -> bool:
        """The local volume driver takes `size` only on xfs mounted with pquota: try one."""
        try:
            volume = await self.docker.volumes.create({"Name": f"polar-quota-probe-{uuid.uuid4().hex[:12]}",
                                                       "Driver": "local", "DriverOpts": {"size": "1m"},
                                                       "Labels": {RUN_LABEL: self.run_id}})
        except aiodocker.DockerError:
            return False
        with contextlib.suppress(aiodocker.DockerError):
            await volume.delete()
        return True

    async def image_for(self, spec: SandboxSpec) -> str:
        if spec.image or self.cfg.image:
            return spec.image or self.cfg.image
        if self._base_image is None:
            self._base_image = await anyio.to_thread.run_sync(ensure_base_image)
        return self._base_image

    def _writable_mounts(self) -> dict:
        """HostConfig entries for the repo and /tmp, per disk mode (check())."""
        cfg, size = self.cfg, f"{self.cfg.disk_mb}m"
        if self.disk == TMPFS:
            return {"Tmpfs": {cfg.workdir: f"size={size},exec,mode=755", TMP: f"size={size},exec,mode=1777"}}
        if self.disk == QUOTA:
            options = {"Labels": {RUN_LABEL: self.run_id},
                       "DriverConfig": {"Name": "local", "Options": {"size": size}}}
            mounts = [{"Type": "volume", "Target": target, "VolumeOptions": options} for target in (cfg.workdir, TMP)]
            return {"Mounts": mounts} | ({} if cfg.read_only_root else {"StorageOpt": {"size": size}})
        return {}

    def _container_config(self, spec: SandboxSpec, image: str) -> dict:
        read_only = self.cfg.read_only_root
        binds = [f"{m.source}:{m.target}:{'ro' if m.read_only else 'rw'}" for m in spec.mounts]
        network = self.cfg.network
        if spec.proxy_port and network == "none":
            if not spec.proxy_socket:
                raise SandboxError("network 'none' needs the proxy's Unix socket (spec.proxy_socket)")
            binds += [f"{spec.proxy_socket}:{PROXY_SOCKET}:rw", f"{FORWARDER_SOURCE}:{FORWARDER}:ro"]
        return {
            "Image": image,
            "Entrypoint": ["sleep"],
            "Cmd": ["infinity"],
            "Labels": {RUN_LABEL: self.run_id, NAME_LABEL: spec.name},
            "WorkingDir": "/",
            # plain anonymous volumes (disk_mb = 0): the repo's starts as the image's copy of it; both go with the box
            "Volumes": {self.cfg.workdir: {}, TMP: {}} if read_only and self.disk == UNBOUNDED else {},
            "HostConfig": {
                "ReadonlyRootfs": read_only,
                "NetworkMode": network,
                "NanoCpus": int(self.cfg.cpus * 1e9),
                "Memory": self.cfg.memory_mb << 20,
                "MemorySwap": self.cfg.memory_mb << 20,  # no swap beyond the memory limit
                "PidsLimit": self.cfg.pids_limit,
                "Privileged": False,
                "CapDrop": ["ALL"],
                "CapAdd": _CAPS,
                "SecurityOpt": ["no-new-privileges"],
                "Init": True,
                "Binds": binds,
                **self._writable_mounts(),
            },
        }

    async def create(self, spec: SandboxSpec) -> DockerSandbox:
        await self.check()
        image = await self.image_for(spec)
        config = self._container_config(spec, image)
        try:
            container = await self.docker.containers.create(config)
        except aiodocker.DockerError as e:
            if e.status == 404 and "image" in str(e.message).lower():
                from polar_fast.rollouts.task_images import missing_image_message

                raise SandboxError(missing_image_message(image, [spec.name or "?"])) from None
            raise SandboxError(f"cannot create a container from {image}: {e.message}") from None
        ok = False
        try:
            box = DockerSandbox(self, container, spec, self.cfg.workdir)
            await container.start()
            if self.disk == TMPFS:
                await self._copy_from_image(box, image, self.cfg.workdir)
            await self._prepare(box, spec)
            ok = True
            return box
        except aiodocker.DockerError as e:
            raise SandboxError(f"container {container.id[:12]} did not start: {e.message}") from None
        finally:
            if not ok:  # failed or cancelled after create: never leave the container behind
                with anyio.CancelScope(shield=True), anyio.move_on_after(60):
                    await _delete(container)

    async def _copy_from_image(self, box: DockerSandbox, image: str, path: str) -> None:
        """A tmpfs starts empty: stream the image's copy of `path` into it, read from a twin
        container that is created (so Docker can read its files) but never started."""
        twin = await self.docker.containers.create({
            "Image": image, "Entrypoint": ["true"], "Cmd": [], "NetworkDisabled": True,
            "Labels": {RUN_LABEL: self.run_id, NAME_LABEL: f"{box.spec.name}-image-copy"}})
        try:
            async with self.docker._query(f"containers/{twin.id}/archive", params={"path": f"{path}/."}) as resp:
                await box.untar(path, resp.content.iter_chunked(COPY_CHUNK_BYTES), user=ROOT)
        except aiodocker.DockerError as e:
            if e.status != 404:  # 404: the image has no such directory, the tmpfs stays empty
                raise
        finally:
            with anyio.CancelScope(shield=True):
                await _delete(twin)

    async def _prepare(self, box: DockerSandbox, spec: SandboxSpec) -> None:
        owner = self.cfg.user
        script = 'mkdir -p "$1" "$2" && chmod 1777 /tmp && chown "$3" "$2" && chown -R "$3" "$1"'
        done = await box.exec(["sh", "-c", script, "prepare", box.workdir, box.home, owner], cwd="/", user=ROOT)
        if done.exit_code != 0:
            raise SandboxError(f"container {box.id[:12]}: preparing {box.workdir} for {owner} failed: {done.stderr.strip()}")
        if spec.proxy_port and self.cfg.network == "none":
            await box.exec(forwarder_argv(spec.proxy_port), cwd="/", detach=True)
            probe = (
                "import socket,sys,time\n"
                "for _ in range(200):\n"
                "    try: socket.create_connection(('127.0.0.1', int(sys.argv[1])), 1).close(); sys.exit(0)\n"
                "    except OSError: time.sleep(0.05)\n"
                "sys.exit(1)\n"
            )
            up = await box.exec(["python3", "-c", probe, str(spec.proxy_port)], cwd="/", timeout_s=30)
            if up.exit_code != 0:
                raise SandboxError(f"container {box.id[:12]}: proxy forwarder did not listen: {up.stderr[-500:]}")

    def open(self, spec: SandboxSpec):
        return open_sandbox(self, spec)

    async def list_run(self, run_id: str | None = None) -> list:
        filters = '{"label": ["%s=%s"]}' % (RUN_LABEL, run_id or self.run_id)
        return await self.docker.containers.list(all=True, filters=filters)

    async def remove_leftovers(self, run_id: str | None = None) -> int:
        """Containers of the run, then its volumes (size-limited ones outlive `docker rm -v`)."""
        with anyio.CancelScope(shield=True):
            containers = await self.list_run(run_id)
            for container in containers:
                await _delete(container)
            await self.remove_volumes(run_id)
            return len(containers)

    async def remove_volumes(self, run_id: str | None = None) -> None:
        """The run's labelled volumes that no container uses any more."""
        label = f"{RUN_LABEL}={run_id or self.run_id}"
        with contextlib.suppress(aiodocker.DockerError):
            listed = await self.docker.volumes.list(filters={"label": [label], "dangling": ["true"]})
            for volume in listed.get("Volumes") or []:
                with contextlib.suppress(aiodocker.DockerError):
                    await self.docker.volumes.get(volume["Name"]).delete()

    async def aclose(self) -> None:
        if self._docker is not None and self._own_client:
            await self._docker.close()
            self._docker = None


def _owned_tar(root: str, files: dict[str, bytes], mode: int, uid: int, gid: int) -> bytes:
    """A tar of `files` (absolute paths under root) relative to root, every file and parent
    directory below root owned by uid:gid, so the box user can write where a harness expects."""
    buf, now = io.BytesIO(), int(time.time())
    dirs: set[str] = set()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for full, data in files.items():
            rel = full[len(root):].lstrip("/") if root != "/" else full.lstrip("/")
            parts = rel.split("/")[:-1]
            for i in range(1, len(parts) + 1):
                d = "/".join(parts[:i])
                if d not in dirs:
                    dirs.add(d)
                    info = tarfile.TarInfo(d)
                    info.type, info.mode, info.mtime, info.uid, info.gid = tarfile.DIRTYPE, 0o755, now, uid, gid
                    tar.addfile(info)
            info = tarfile.TarInfo(rel)
            info.size, info.mode, info.mtime, info.uid, info.gid = len(data), mode, now, uid, gid
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


async def _read_stream(stream, out: bytearray, err: bytearray, cut: list[bool]) -> None:
    while (msg := await stream.read_out()) is not None:
        into = out if msg.stream == 1 else err
        into += msg.data
        if len(into) > MAX_OUTPUT_BYTES:
            del into[: len(into) - MAX_OUTPUT_BYTES]
            cut[0] = True


async def _feed(stream, data: bytes | AsyncIterable[bytes]) -> None:
    """Write an exec's stdin, then end it while its output keeps flowing: aiodocker's
    Stream.close() ends both directions, so the half-close goes to its transport. A command
    that exits without reading everything just ends the feed (its connection may be gone)."""
    with contextlib.suppress(OSError, RuntimeError, AttributeError):
        if isinstance(data, bytes):
            if data:
                await stream.write_in(data)
        else:
            async for chunk in data:
                await stream.write_in(chunk)
        stream._resp.connection.transport.write_eof()


async def _delete(container) -> None:
    with contextlib.suppress(aiodocker.DockerError):  # 404: already gone; 409: removal in progress
        await container.delete(force=True, v=True)
