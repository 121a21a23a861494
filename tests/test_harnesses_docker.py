"""The harness bundles mounted read-only into a `--network none` container built from the Debian
minbase base image: each CLI reaches the fake model only through the mounted Unix socket and the
loopback forwarder (polar_fast/rollouts/sandboxes/forwarder.py), through the pools' docker sandbox."""

from __future__ import annotations

import secrets
import shutil
import tempfile
from pathlib import Path

import aiodocker
import pytest
from harness_servers import FakeModel, serve

from polar_fast.config import SandboxConfig
from polar_fast.rollouts.harnesses import ModelLimits, get_harness
from polar_fast.rollouts.sandboxes import Mount, SandboxSpec
from polar_fast.rollouts.sandboxes.docker import DockerSandboxFactory

MODEL = "polar-test-model"
LIMITS = ModelLimits(context_tokens=32768, max_output_tokens=1024)
BUNDLE_MOUNT = "/opt/polar/harness"
PORT_IN_BOX = 18080  # loopback port inside the container; any free one works


@pytest.fixture
def socket_dir():
    # Unix socket paths are limited to ~108 bytes; pytest's tmp_path can be longer.
    path = tempfile.mkdtemp(prefix="polar-sock-")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", ["codex", "mini-swe-agent", "claude-code", "qwen-code", "pi"])
async def test_harness_in_network_none_container(name, bundles, socket_dir, docker_required):
    token = secrets.token_hex(8)
    fake = FakeModel(answer=f"ANSWER-{secrets.token_hex(4)}")
    # An explicit URL: aiodocker's socket search stats files, which blockbuster forbids on the loop.
    docker = aiodocker.Docker(url="unix:///var/run/docker.sock")
    factory = DockerSandboxFactory(SandboxConfig(kind="docker", network="none"), run_id=f"test-harness-{token}",
                                   docker=docker)
    mount = Mount(source=str(bundles[name]), target=f"{BUNDLE_MOUNT}/{name}", read_only=True)
    try:
        async with serve(fake, unix_path=str(socket_dir / "proxy.sock")) as sock:
            spec = SandboxSpec(name=f"harness-{name}", mounts=[mount], proxy_port=PORT_IN_BOX, proxy_socket=sock)
            async with factory.open(spec) as box:
                cmd = get_harness(name).command(
                    prompt="Say the answer.", proxy_url=f"{box.proxy_url}/s/{token}", api_key=token,
                    model=MODEL, home=box.home, bundle=box.path(mount.target), max_steps=5,
                    limits=LIMITS)
                await box.write_files({f"{box.home}/{rel}": text for rel, text in cmd.files.items()})
                result = await box.exec(cmd.argv, env=cmd.env, cwd=box.workdir, timeout_s=120)
    finally:
        await factory.aclose()
        await docker.close()
    output = result.stdout + result.stderr
    calls = fake.model_requests()
    assert calls, f"{name} sent no model request; output:\n{output[-3000:]}"
    assert all(c.path.startswith(f"/s/{token}/v1/") and c.body["model"] == MODEL for c in calls)
    assert result.exit_code == 0 and not result.timed_out, f"{name}: exit {result.exit_code}\n{output[-3000:]}"
    assert fake.answer in result.stdout, output[-3000:]
