"""Both sandbox backends against the same behaviour: exec, files, timeouts that kill the whole
process tree, removal on exit and cancellation. Docker cases run against the real Engine."""

from __future__ import annotations

import os
import uuid

import anyio
import pytest

import polar_fast.rollouts.sandboxes.docker  # noqa: F401  (imported before the loop: import reads files)
from polar_fast.config import SandboxConfig
from polar_fast.rollouts.sandboxes import SandboxError, SandboxSpec, make_sandbox_factory, sandbox_class

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["local", "docker"])
def kind(request):
    if request.param == "docker":
        request.getfixturevalue("base_image")
    return request.param


@pytest.fixture
async def factory(kind):
    f = make_sandbox_factory(SandboxConfig(kind=kind, cpus=1.0, memory_mb=512, pids_limit=128, disk_mb=128),
                             run_id=f"t-{uuid.uuid4().hex[:8]}")
    yield f
    await f.remove_leftovers()
    await f.aclose()


async def _processes_matching(box, kind: str, needle: str) -> list[str]:
    """Live (non-zombie) processes whose command line contains needle, in the box's view."""
    if kind == "docker":
        done = await box.exec(["ps", "-eo", "stat=,args="])
        lines = done.stdout.splitlines()
    else:
        def scan() -> list[str]:
            found = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        state = f.read().rsplit(")", 1)[1].split()[0]
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        args = f.read().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                found.append(f"{state} {args}")
            return found

        lines = await anyio.to_thread.run_sync(scan)
    return [line for line in lines if needle in line and not line.lstrip().startswith("Z")]


async def test_exec_output_exit_code_env_and_cwd(factory):
    async with factory.open(SandboxSpec(name="exec", env={"FROM_SPEC": "s"})) as box:
        done = await box.exec(["sh", "-c", 'echo "$FROM_SPEC$FROM_CALL"; pwd; echo oops >&2; exit 3'],
                              env={"FROM_CALL": "c"})
        assert done.exit_code == 3 and not done.timed_out
        assert done.stdout.splitlines() == ["sc", box.workdir]
        assert done.stderr == "oops\n"
        piped = await box.exec(["cat"], stdin=b"through stdin")
        assert piped.stdout == "through stdin"
        missing = await box.exec(["no-such-program-xyz"])
        assert missing.exit_code != 0


async def test_files_round_trip(factory):
    async with factory.open(SandboxSpec()) as box:
        await box.write_files({"pkg/a.txt": "text", f"{box.home}/.config/x.json": b"\x00\x01"})
        assert await box.read_file("pkg/a.txt") == b"text"
        assert await box.read_file(f"{box.home}/.config/x.json") == b"\x00\x01"
        listed = await box.exec(["cat", "pkg/a.txt"])
        assert listed.stdout == "text"
        with pytest.raises(FileNotFoundError):
            await box.read_file("nope.txt")


async def test_timeout_kills_the_whole_process_tree(factory, kind):
    tag = str(700000 + uuid.uuid4().int % 100000)  # a sleep length no other process uses
    async with factory.open(SandboxSpec()) as box:
        script = f"(setsid sleep {tag} &); sleep {tag} & sh -c 'sleep {tag}'"
        done = await box.exec(["sh", "-c", script], timeout_s=1.0)
        assert done.timed_out and done.exit_code != 0
        assert await _processes_matching(box, kind, f"sleep {tag}") == []
        after = await box.exec(["echo", "still usable"])
        assert after.stdout == "still usable\n"


async def test_cancellation_removes_the_sandbox_and_its_processes(factory, kind):
    tag = str(800000 + uuid.uuid4().int % 100000)
    seen = {}
    with anyio.move_on_after(2.0):
        async with factory.open(SandboxSpec()) as box:
            seen["box"] = box
            await box.exec(["sh", "-c", f"sleep {tag} & sleep {tag}"])
    box = seen["box"]
    assert not await box.alive()
    if kind == "local":
        assert await _processes_matching(box, kind, f"sleep {tag}") == []
    assert await factory.remove_leftovers() == 0


async def test_remove_leftovers_finds_sandboxes_by_run_id(factory):
    await factory.create(SandboxSpec(name="left-1"))
    await factory.create(SandboxSpec(name="left-2"))
    assert await factory.remove_leftovers() == 2
    assert await factory.remove_leftovers() == 0


async def test_unknown_kind_is_a_clear_error():
    with pytest.raises(SandboxError, match="known: docker, local"):
        sandbox_class("podman")


@pytest.mark.docker
async def test_docker_limits_labels_and_no_network(base_image):
    from polar_fast.rollouts.sandboxes import RUN_LABEL

    run_id = f"t-{uuid.uuid4().hex[:8]}"
    f = make_sandbox_factory(SandboxConfig(kind="docker", cpus=0.5, memory_mb=256, pids_limit=64, disk_mb=64), run_id=run_id)
    try:
        async with f.open(SandboxSpec(name="limits")) as box:
            info = await box.container.show()
            host = info["HostConfig"]
            assert host["Privileged"] is False and host["NetworkMode"] == "none"
            assert host["NanoCpus"] == 500_000_000 and host["Memory"] == 256 << 20 and host["PidsLimit"] == 64
            assert info["Config"]["Labels"][RUN_LABEL] == run_id
            links = await box.exec(["sh", "-c", "ls /sys/class/net"])
            assert links.stdout.split() == ["lo"]
            fork_bomb = await box.exec(["sh", "-c", "for i in $(seq 200); do sleep 30 & done; wait"], timeout_s=5)
            assert "fork" in fork_bomb.stderr.lower() or "resource" in fork_bomb.stderr.lower()
        assert await f.list_run() == []
    finally:
        await f.remove_leftovers()
        await f.aclose()


@pytest.mark.docker
async def test_docker_dead_container_is_a_sandbox_error(base_image):
    f = make_sandbox_factory(SandboxConfig(kind="docker"), run_id=f"t-{uuid.uuid4().hex[:8]}")
    try:
        async with f.open(SandboxSpec()) as box:
            await box.container.kill()
            with pytest.raises(SandboxError):
                await box.exec(["true"])
    finally:
        await f.remove_leftovers()
        await f.aclose()


@pytest.mark.docker
async def test_docker_network_none_reaches_the_proxy_through_its_unix_socket(base_image, tmp_path):
    from aiohttp import web

    seen = []

    async def hello(request):
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"path": request.path})

    app = web.Application()
    app.router.add_get("/{tail:.*}", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    sock = str(tmp_path / "proxy.sock")
    import socket

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await anyio.to_thread.run_sync(listener.bind, sock)  # bind stats the path: off the loop
    await anyio.to_thread.run_sync(os.chmod, sock, 0o666)  # as the proxy does: boxes connect unprivileged
    await web.SockSite(runner, listener).start()
    f = make_sandbox_factory(SandboxConfig(kind="docker"), run_id=f"t-{uuid.uuid4().hex[:8]}")
    try:
        async with f.open(SandboxSpec(proxy_port=18123, proxy_socket=sock)) as box:
            assert box.proxy_url == "http://127.0.0.1:18123"
            fetch = ("import urllib.request,sys; r=urllib.request.Request(sys.argv[1], headers={'Authorization': 'Bearer tok'});"
                     "print(urllib.request.urlopen(r, timeout=10).read().decode())")
            done = await box.exec(["python3", "-c", fetch, box.proxy_url + "/s/tok/v1/models"], timeout_s=30)
            assert done.exit_code == 0, done.stderr
            assert '"/s/tok/v1/models"' in done.stdout and seen == ["Bearer tok"]
            outside = await box.exec(["python3", "-c", "import socket; socket.create_connection(('1.1.1.1', 80), 2)"])
            assert outside.exit_code != 0  # no other egress
    finally:
        await f.remove_leftovers()
        await f.aclose()
        await runner.cleanup()


async def test_output_past_the_cap_keeps_its_tail_and_says_so(factory):
    async with factory.open(SandboxSpec()) as box:
        done = await box.exec(["sh", "-c", "head -c 9000000 /dev/zero | tr '\\0' x; echo END"])
        assert done.truncated and len(done.stdout) == 8 << 20 and done.stdout.endswith("xEND\n")
        assert not (await box.exec(["echo", "short"])).truncated


@pytest.mark.docker
async def test_a_box_that_writes_past_disk_mb_gets_enospc_and_the_host_disk_stays_out_of_it(base_image):
    """The path this host's dockerd takes (on CI, overlay2 on ext4: size-limited tmpfs): the repo
    and /tmp each refuse a write past disk_mb with ENOSPC, the image's repo is there, and the box
    puts nothing on the host's disk (its writable layer stays empty)."""
    from polar_fast.rollouts.sandboxes.docker import TMPFS
    from polar_fast.rollouts.tasks import load_builtin, prepare_repo, repo_diff

    f = make_sandbox_factory(SandboxConfig(kind="docker", memory_mb=512, disk_mb=16), run_id=f"t-{uuid.uuid4().hex[:8]}")
    try:
        host = await f.check()
        print(f"sandbox disk: {host.disk_bound}; data root {host.data_root}")
        async with f.open(SandboxSpec(name="disk")) as box:
            for where in (box.workdir, "/tmp"):
                dd = await box.exec(["sh", "-c", f"dd if=/dev/zero of={where}/filler bs=1M count=32; echo rc=$?"])
                assert "No space left on device" in dd.stderr and "rc=1" in dd.stdout, dd
                used = await box.exec(["sh", "-c", f"du -sm {where}/filler | cut -f1"])
                assert int(used.stdout) <= 16
            info = await box.container.show(size=True)
            assert info.get("SizeRw", 0) < 1 << 20  # nothing in its writable layer on the host's disk
            if f.disk == TMPFS:
                mounts = (await box.exec(["sh", "-c", "grep -E ' (/testbed|/tmp) ' /proc/mounts"])).stdout
                lines = mounts.splitlines()
                assert len(lines) == 2 and all(line.startswith("tmpfs ") and "size=16384k" in line for line in lines)
            # files still land, as the box user
            await box.exec(["rm", f"{box.workdir}/filler", "/tmp/filler"])
            await box.write_files({"a.txt": "x", f"{box.home}/cfg": "y"})
            owner = await box.exec(["stat", "-c", "%u", "a.txt", f"{box.home}/cfg"])
            assert owner.stdout.split() == ["1000", "1000"]
            # a repo whose disk is full still hands over its diff: reading it writes nothing
            task = (await anyio.to_thread.run_sync(load_builtin))[0]
            await box.exec(["rm", "a.txt"])
            await prepare_repo(box, task)
            await box.exec(["sh", "-c", "echo fixed >> NOTES.txt; dd if=/dev/zero of=.git/filler bs=1M count=32"])
            assert (await box.exec(["sh", "-c", "echo x > y.txt"])).exit_code != 0  # full
            assert "+fixed" in await repo_diff(box, task.base_commit)
    finally:
        await f.remove_leftovers()
        await f.aclose()


@pytest.mark.docker
async def test_a_disk_bound_this_host_cannot_enforce_is_refused_at_start(base_image):
    from polar_fast.rollouts.sandboxes.docker import DockerSandboxFactory

    probe = DockerSandboxFactory(SandboxConfig(kind="docker"), run_id=f"t-{uuid.uuid4().hex[:8]}")
    try:
        if "tmpfs" not in (await probe.check()).disk_bound:
            pytest.skip("this Docker Engine offers size limits (overlay2 on xfs with pquota)")
    finally:
        await probe.aclose()
    for cfg, words in ((SandboxConfig(kind="docker", read_only_root=False), "read_only_root = false"),
                       (SandboxConfig(kind="docker", memory_mb=1024, disk_mb=512), "at most half of it")):
        f = DockerSandboxFactory(cfg, run_id=f"t-{uuid.uuid4().hex[:8]}")
        try:
            with pytest.raises(SandboxError, match=words):
                await f.check()
        finally:
            await f.aclose()
    unbounded = DockerSandboxFactory(SandboxConfig(kind="docker", read_only_root=False, disk_mb=0), run_id="t-0")
    try:
        assert "not bounded" in (await unbounded.check()).disk_bound
    finally:
        await unbounded.aclose()
