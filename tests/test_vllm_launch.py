"""Starting `vllm serve` for a run (engines/vllm_launch.py), without vLLM or a GPU.

The command line and environment are checked as data. The lifecycle runs against a fake `vllm`
executable put first on PATH: it records its argv and environment, starts a child process as
vLLM's data-parallel engines do, so the tests can see the whole process group go away, then
serves vLLM's routes (the HTTP double of tests/vllm_double.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio
import pytest
import torch
from vllm_double import TESTS, tiny_hf_dir

from polar_fast.config import parse_config
from polar_fast.engines import vllm_launch
from polar_fast.engines.vllm_launch import (
    VllmLaunchError,
    launch_spec,
    launched_vllm,
    prepare_model_dir,
)

FAKE_VLLM = r'''#!{python}
"""Fake `vllm serve`: FAKE_VLLM_MODE = ok | exit | hang | stubborn (ignores SIGTERM)."""
import json, os, signal, subprocess, sys, time

mode = os.environ.get("FAKE_VLLM_MODE", "ok")
args = sys.argv[1:]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a "DP engine"
with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
    json.dump({{"argv": args, "env": dict(os.environ), "pid": os.getpid(), "child": child.pid}}, f)
print("INFO starting fake vllm", flush=True)
if mode == "exit":
    print("ERROR torch.OutOfMemoryError: CUDA out of memory (fake)", flush=True)
    sys.exit(3)
if mode == "hang":
    time.sleep(600)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

sys.path.insert(0, {tests!r})
from vllm_double import main  # the routes: tests/vllm_double.py

main(args, handle_signals=mode != "stubborn")
'''


def vllm_config(tmp_path: Path, **engine) -> object:
    return parse_config({
        "run": {"output_dir": str(tmp_path / "run")},
        "model": {"name": "policy-7b", "path": str(tmp_path / "model"), "max_context_tokens": 32768},
        "engine": {"kind": "vllm", "data_parallel_size": 4, "launch_gpus": [0, 1, 2, 3], **engine},
    })


# --------------------------------------------------------------------- command line, environment


def test_command_line_and_environment(tmp_path):
    cfg = vllm_config(tmp_path, launch_args=["--gpu-memory-utilization", "0.85"])
    base = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "4,5,6,7", "RANK": "0", "LOCAL_RANK": "0",
            "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
            "TORCHELASTIC_RUN_ID": "x", "HF_HOME": "/cache/hf"}
    spec = launch_spec(cfg, tmp_path / "run" / "weights", 8123, executable="/opt/bin/vllm", base_env=base)

    assert spec.url == "http://127.0.0.1:8123"
    argv = spec.argv
    assert argv[:3] == ["/opt/bin/vllm", "serve", str(tmp_path / "run" / "weights")]

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    assert value("--served-model-name") == "policy-7b"
    assert value("--host") == "127.0.0.1" and value("--port") == "8123"
    assert value("--data-parallel-size") == "4" and value("--max-model-len") == "32768"
    assert value("--generation-config") == "vllm" and value("--dtype") == "float32"
    assert "--enable-scale-out" in argv  # mounts /inference/v1/generate
    assert json.loads(value("--weight-transfer-config")) == {"backend": "nccl"}
    assert "--tool-call-parser" not in argv  # the proxy renders and parses
    assert argv[-2:] == ["--gpu-memory-utilization", "0.85"]  # launch_args last, verbatim

    env = spec.env
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # absolute ids, not the learner's 4-7
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    assert not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"} & set(env)
    assert env["PATH"] == "/usr/bin" and env["HF_HOME"] == "/cache/hf"


def test_vllm_and_a_cuda_learner_never_share_a_gpu(tmp_path):
    cfg = parse_config({"model": {"path": str(tmp_path)}, "learner": {"device": "cuda"},
                        "engine": {"kind": "vllm", "launch_gpus": [2, 3], "data_parallel_size": 2}})
    with pytest.raises(VllmLaunchError, match=r"shares GPUs \[3\] with the learner"):
        launch_spec(cfg, tmp_path, 1, base_env={"CUDA_VISIBLE_DEVICES": "3,4"})
    launch_spec(cfg, tmp_path, 1, base_env={"CUDA_VISIBLE_DEVICES": "4,5"})  # disjoint: fine


def test_a_python_with_vllm_runs_the_api_server_module(tmp_path):
    python = tmp_path / "python"
    python.write_text("")
    cfg = vllm_config(tmp_path, launch_python=str(python))
    executable = vllm_launch.find_vllm(cfg.engine.launch_python)
    argv = launch_spec(cfg, tmp_path / "w", 1, executable=executable, base_env={}).argv
    assert argv[:5] == [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(tmp_path / "w")]
    with pytest.raises(VllmLaunchError, match="does not exist"):
        vllm_launch.find_vllm(str(tmp_path / "missing"))


def test_engine_rendering_adds_the_tool_parser(tmp_path):
    cfg = vllm_config(tmp_path, render="engine")
    argv = launch_spec(cfg, tmp_path, 1, base_env={}).argv
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes"
    assert "--enable-auto-tool-choice" in argv


@pytest.mark.parametrize("engine, message", [
    ({"launch_gpus": []}, "distinct GPU ids"),
    ({"launch_gpus": [0, 0, 1, 2]}, "distinct GPU ids"),
    ({"launch_gpus": [-1, 0, 1, 2]}, "distinct GPU ids"),
    ({"launch_gpus": [0, 1]}, "data_parallel_size = 4 needs 1 to 2 GPUs"),
    ({"data_parallel_size": 0}, "data_parallel_size = 0"),
])
def test_bad_gpu_settings_are_refused(tmp_path, engine, message):
    with pytest.raises(VllmLaunchError, match=message):
        launch_spec(vllm_config(tmp_path, **engine), tmp_path, 1, base_env={})


# ------------------------------------------------------------------------ the served directory


def test_served_dir_links_the_model_and_disk_sync_never_writes_into_it(tmp_path):
    from safetensors.torch import load_file

    from polar_fast.learner.weight_sync import save_safetensors

    source = tiny_hf_dir(tmp_path / "model")
    served = prepare_model_dir(source, tmp_path / "weights")
    assert sorted(p.name for p in served.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert (served / "model.safetensors").resolve() == (source / "model.safetensors").resolve()

    save_safetensors([("layer0.weight", torch.ones(2, 2))], served / "model.safetensors")  # as DiskSync does
    assert not (served / "model.safetensors").is_symlink()
    assert torch.equal(load_file(str(source / "model.safetensors"))["layer0.weight"], torch.zeros(2, 2))
    # a resumed run keeps the last synced weights
    prepare_model_dir(source, served)
    assert torch.equal(load_file(str(served / "model.safetensors"))["layer0.weight"], torch.ones(2, 2))


def test_sharded_weights_are_merged_into_one_file(tmp_path):
    from safetensors.torch import load_file

    served = prepare_model_dir(tiny_hf_dir(tmp_path / "model", shards=3), tmp_path / "weights")
    assert not any(p.name.endswith(".index.json") or p.name.startswith("model-") for p in served.iterdir())
    merged = load_file(str(served / "model.safetensors"))
    assert sorted(merged) == ["layer0.weight", "layer1.weight", "layer2.weight"]
    assert torch.equal(merged["layer2.weight"], torch.full((2, 2), 2.0))


def test_a_directory_without_config_or_safetensors_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(VllmLaunchError, match="no config.json"):
        prepare_model_dir(tmp_path / "empty", tmp_path / "w1")
    (tmp_path / "empty" / "config.json").write_text("{}")
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(VllmLaunchError, match="no \\*.safetensors"):
        prepare_model_dir(tmp_path / "empty", tmp_path / "w2")
    with pytest.raises(VllmLaunchError, match="not one"):
        prepare_model_dir(tmp_path / "missing", tmp_path / "w3")


# ----------------------------------------------------------------------------------- lifecycle


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A fake `vllm` first on PATH; returns the path its record is written to."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "vllm"
    script.write_text(FAKE_VLLM.format(python=sys.executable, tests=str(TESTS)))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    record = tmp_path / "fake_vllm.json"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    monkeypatch.setenv("RANK", "0")  # as under torchrun: must not reach vLLM
    tiny_hf_dir(tmp_path / "model")
    (tmp_path / "run").mkdir()
    return record


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie (no init may reap it in a container)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


async def gone(pid: int) -> bool:
    """Waits (a generous bound, not a speed check) for a signalled process to disappear."""
    with anyio.move_on_after(20):
        while await anyio.to_thread.run_sync(alive, pid):
            await anyio.sleep(0.05)
    return not await anyio.to_thread.run_sync(alive, pid)


async def read_record(record: Path) -> dict:
    return json.loads(await anyio.Path(record).read_text())


@pytest.mark.anyio
async def test_launch_serve_and_stop_the_whole_process_group(tmp_path, fake_vllm):
    from polar_fast.engines import Sampling, build_engine

    cfg = vllm_config(tmp_path)
    events = []
    async with launched_vllm(cfg, tmp_path / "run", emit=lambda kind, data: events.append(data)) as served:
        assert served.engine.url.startswith("http://127.0.0.1:") and cfg.engine.url == ""
        seen = await read_record(fake_vllm)
        engine = await anyio.to_thread.run_sync(build_engine, served.model, served.engine)
        try:
            gen = await engine.generate([1, 2, 3, 4], Sampling(max_tokens=3), session_id="s")
        finally:
            await engine.aclose()
        assert gen.token_ids == [4, 7, 8] and gen.logprobs == [-0.5] * 3
        assert await anyio.to_thread.run_sync(alive, seen["pid"])

    argv = seen["argv"]
    assert argv[0] == "serve" and argv[1] == str(tmp_path / "run" / "weights")
    assert argv[argv.index("--port") + 1] == served.engine.url.rsplit(":", 1)[1]
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and "RANK" not in seen["env"]
    assert any("vllm serve ready" in e["message"] for e in events)
    for pid in (seen["pid"], seen["child"]):  # leader and its "DP engine" are both gone
        assert await gone(pid)
    log = await anyio.Path(tmp_path / "run" / "vllm.log").read_text()
    assert "starting fake vllm" in log


@pytest.mark.anyio
async def test_an_existing_url_or_another_engine_starts_nothing(tmp_path, fake_vllm):
    for cfg in (vllm_config(tmp_path, url="http://127.0.0.1:9"),
                vllm_config(tmp_path, urls=["http://127.0.0.1:9", "http://127.0.0.1:10"]),
                parse_config({"engine": {"kind": "scripted"}})):
        async with launched_vllm(cfg, tmp_path / "run") as served:
            assert served is cfg
    assert not await anyio.Path(fake_vllm).exists()


@pytest.mark.anyio
async def test_vllm_exiting_early_reports_the_end_of_its_log(tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "exit")
    with pytest.raises(VllmLaunchError, match="exited with code 3") as err:
        async with launched_vllm(vllm_config(tmp_path), tmp_path / "run"):
            pytest.fail("the block must not run")
    assert "CUDA out of memory (fake)" in str(err.value) and "vllm.log" in str(err.value)
    seen = await read_record(fake_vllm)
    assert await gone(seen["child"])


@pytest.mark.anyio
async def test_no_health_within_the_timeout_fails_with_the_log_and_kills_it(tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "hang")
    with pytest.raises(VllmLaunchError, match=r"did not answer .*/health within 5 s") as err:
        async with launched_vllm(vllm_config(tmp_path, launch_timeout_s=5), tmp_path / "run"):
            pytest.fail("the block must not run")
    assert "starting fake vllm" in str(err.value)
    seen = await read_record(fake_vllm)
    for pid in (seen["pid"], seen["child"]):
        assert await gone(pid)


@pytest.mark.anyio
async def test_a_server_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "stubborn")
    monkeypatch.setattr(vllm_launch, "STOP_GRACE_S", 0.5)
    async with launched_vllm(vllm_config(tmp_path), tmp_path / "run"):
        seen = await read_record(fake_vllm)
    assert await gone(seen["pid"])


@pytest.mark.anyio
async def test_cancelling_while_it_starts_stops_it(tmp_path, fake_vllm, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_MODE", "hang")

    async def start() -> None:
        async with launched_vllm(vllm_config(tmp_path), tmp_path / "run"):
            pytest.fail("the block must not run")

    async with anyio.create_task_group() as tg:
        tg.start_soon(start)
        while not await anyio.Path(fake_vllm).exists():  # it runs and waits for /health
            await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    seen = await read_record(fake_vllm)
    for pid in (seen["pid"], seen["child"]):
        assert await gone(pid)


@pytest.mark.anyio
async def test_no_vllm_executable_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(VllmLaunchError, match="no `vllm` executable"):
        async with launched_vllm(vllm_config(tmp_path), tmp_path / "run"):
            pytest.fail("the block must not run")
