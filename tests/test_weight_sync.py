"""Weight sync: in-process copy into the embedded engine, reload from disk, and the vLLM
dev-mode weight-transfer call sequence against a local aiohttp fake of its endpoints (NCCL
needs a GPU), its bodies checked against vLLM 0.32's own dataclasses and its world-size route
against the real CPU server."""

from __future__ import annotations

import json
import os
import subprocess

import anyio
import pytest
import torch
from aiohttp import web
from vllm_server import vllm_python

from polar_fast.engines.vllm import VllmEngine
from polar_fast.learner.weight_sync import DiskSync, EngineSync, NcclSender, VllmTransferSync, WeightSyncError


class RecordingEngine:
    """Stands in for an engine's update_weights (the only method the syncs call)."""

    def __init__(self) -> None:
        self.policy_version = 0
        self.updates: list = []

    async def update_weights(self, named_tensors, *, version: int) -> None:
        self.updates.append(None if named_tensors is None else dict(named_tensors))
        self.policy_version = version


@pytest.mark.anyio
async def test_engine_sync_copies_into_embedded_engine(tmp_path):
    def setup():  # imports and model files: off the event loop
        from transformers import LlamaConfig, LlamaForCausalLM

        from polar_fast.config import EngineConfig, ModelConfig
        from polar_fast.engines.embedded import EmbeddedEngine
        from polar_fast.model import load_tokenizer

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, eos_token_id=2)
        LlamaForCausalLM(cfg).save_pretrained(tmp_path / "m")
        load_tokenizer().save_pretrained(tmp_path / "m")
        return EmbeddedEngine(ModelConfig(path=str(tmp_path / "m")), EngineConfig())

    engine = await anyio.to_thread.run_sync(setup)
    new = {k: torch.full_like(v, 0.5) for k, v in engine.model.state_dict().items()}
    await EngineSync(engine).push(new.items(), version=3)
    assert engine.policy_version == 3
    for k, v in engine.model.state_dict().items():
        assert torch.equal(v, new[k]), k


@pytest.mark.anyio
async def test_disk_sync_writes_then_reloads(tmp_path):
    engine = RecordingEngine()
    tied = torch.arange(6.0).reshape(2, 3)
    norm = torch.ones(3)
    pairs = [("embed.weight", tied), ("lm_head.weight", tied), ("norm.weight", norm)]
    await DiskSync(engine, tmp_path / "served").push(pairs, version=2)
    assert engine.updates == [None] and engine.policy_version == 2

    def read():
        from safetensors.torch import load_file

        return load_file(tmp_path / "served" / "model.safetensors")

    saved = await anyio.to_thread.run_sync(read)
    assert set(saved) == {"embed.weight", "norm.weight"}  # the tied head once, as HF checkpoints have it
    assert torch.equal(saved["embed.weight"], tied)
    await DiskSync(engine, tmp_path / "served", dtype="bfloat16").push(pairs, version=3)
    saved = await anyio.to_thread.run_sync(read)
    assert saved["embed.weight"].dtype == torch.bfloat16  # the engine's serving dtype


class FakeSender:
    """Stands in for NcclSender, the one part a CPU cannot run: its NCCL group needs GPUs on both
    sides (vLLM's CPU build has no transfer backend). Records what it was handed."""

    def __init__(self, log: list) -> None:
        self.log = log

    def init_info(self, engine_world_size: int) -> dict:
        return {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1,
                "world_size": 1 + engine_world_size, "packed": False}

    async def connect(self) -> None:
        self.log.append(("connect",))

    async def send(self, named_tensors) -> None:
        self.log.append(("send", [(n, t.dtype) for n, t in named_tensors]))


async def fake_vllm(log: list, fail: str = "", world_size: int = 2):
    async def handle(request: web.Request) -> web.Response:
        body = await request.text()
        log.append((request.path_qs, json.loads(body) if body else None))
        if request.path == fail:
            return web.json_response({"error": "boom"}, status=500)
        if request.path == "/get_world_size":
            return web.json_response({"world_size": world_size})
        return web.json_response({"message": "ok"})

    app = web.Application()
    app.router.add_post("/{name}", handle)
    app.router.add_get("/{name}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


TIED = torch.ones(4, 2)
TRANSFER_WEIGHTS = [("model.embed.weight", TIED), ("lm_head.weight", TIED), ("lm_head.bias", torch.zeros(4))]


async def _transfer_bodies(weights, pause_mode: str = "keep", **kwargs) -> tuple[list, VllmEngine]:
    log: list = []
    runner, url = await fake_vllm(log)
    engine = VllmEngine(url, model="m", pause_mode=pause_mode)
    sync = VllmTransferSync(engine, FakeSender(log), **kwargs)
    try:
        await sync.push(weights, version=1)
        await sync.push(weights, version=2)
    finally:
        await engine.aclose()
        await runner.cleanup()
    return log, engine


@pytest.mark.anyio
@pytest.mark.parametrize("pause_mode", ["keep", "wait"])
async def test_vllm_transfer_call_sequence(pause_mode):
    log, engine = await _transfer_bodies(TRANSFER_WEIGHTS, pause_mode, dtype="bfloat16")
    paths = [entry[0] for entry in log]
    # the engine's world size, then init once (concurrently with the sender's rendezvous), then
    # per sync the update lifecycle inside the engine's pause block
    assert paths[0] == "/get_world_size"
    assert sorted(paths[1:3]) == sorted(["/init_weight_transfer_engine", "connect"])
    one_sync = [f"/pause?mode={pause_mode}&clear_cache=false", "/start_weight_update", "/update_weights", "send",
                "/finish_weight_update", "/reset_prefix_cache?reset_running_requests=true", "/update_weight_version",
                "/resume"]
    rest = paths[3:]
    assert len(rest) == 2 * len(one_sync)
    for chunk in (rest[:8], rest[8:]):
        assert chunk[:2] == one_sync[:2] and sorted(chunk[2:4]) == sorted(one_sync[2:4]) and chunk[4:] == one_sync[4:]
    bodies = {entry[0]: entry[1] for entry in log if entry[0].startswith("/")}
    assert bodies["/update_weight_version"] == {"new_version": "2"}
    assert bodies["/init_weight_transfer_engine"] == {"init_info": FakeSender(log).init_info(2)}
    assert bodies["/start_weight_update"] is None and bodies["/finish_weight_update"] is None
    # the tied head once, everything in the serving dtype: metadata and tensors agree
    assert bodies["/update_weights"] == {"update_info": {"names": ["model.embed.weight", "lm_head.bias"],
                                                         "dtype_names": ["bfloat16", "bfloat16"],
                                                         "shapes": [[4, 2], [4]]}}
    sent = [entry[1] for entry in log if entry[0] == "send"]
    assert sent == [[("model.embed.weight", torch.bfloat16), ("lm_head.bias", torch.bfloat16)]] * 2
    assert engine.policy_version == 2


@pytest.mark.anyio
async def test_vllm_transfer_bodies_parse_as_vllm_032_reads_them():
    """The bodies the sync posts, read by vLLM's own init and update dataclasses (the CPU build
    cannot open the NCCL group itself: see learner/weight_sync.py)."""
    python = await anyio.to_thread.run_sync(vllm_python)
    if python is None:
        if os.environ.get("POLAR_REQUIRE_VLLM"):
            pytest.fail("POLAR_REQUIRE_VLLM is set but there is no CPU vLLM: bash scripts/install_vllm_cpu.sh")
        pytest.skip("no CPU vLLM (bash scripts/install_vllm_cpu.sh)")
    log, _ = await _transfer_bodies(TRANSFER_WEIGHTS)
    bodies = {entry[0]: entry[1] for entry in log if entry[0].startswith("/")}
    real_init = NcclSender(master_port=29555).init_info(2)
    payload = json.dumps({"init": [bodies["/init_weight_transfer_engine"]["init_info"], real_init],
                          "update": bodies["/update_weights"]["update_info"]})
    script = (
        "import json, sys\n"
        "from vllm.distributed.weight_transfer.nccl_engine import "
        "NCCLWeightTransferEngine as E, NCCLWeightTransferInitInfo, NCCLWeightTransferUpdateInfo\n"
        "p = json.load(sys.stdin)\n"
        "for i in p['init']: NCCLWeightTransferInitInfo(**i)\n"
        "NCCLWeightTransferUpdateInfo(**p['update'])\n"
        "assert E.init_info_cls is NCCLWeightTransferInitInfo and E.update_info_cls is NCCLWeightTransferUpdateInfo\n"
        "print('parsed')\n"
    )
    done = await anyio.to_thread.run_sync(lambda: subprocess.run(
        [python, "-c", script], input=payload, capture_output=True, text=True, timeout=300,
        env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"}))
    assert done.returncode == 0 and done.stdout.strip().endswith("parsed"), done.stderr[-2000:]


@pytest.mark.anyio
async def test_vllm_transfer_reads_the_real_servers_world_size(real_vllm):
    """The one transfer route a CPU server answers as a GPU one would: it sizes the NCCL group."""
    engine = VllmEngine(real_vllm.url, model="m")
    try:
        world = json.loads(await engine.control("read the engine's world size", "/get_world_size", method="GET"))
    finally:
        await engine.aclose()
    assert world == {"world_size": 1}  # one CPU worker: the learner would be rank 0 of 2
    assert NcclSender(master_port=29555).init_info(world["world_size"])["world_size"] == 2


@pytest.mark.anyio
async def test_vllm_transfer_failure_resumes_and_raises():
    log: list = []
    runner, url = await fake_vllm(log, fail="/finish_weight_update")
    engine = VllmEngine(url, model="m", max_retries=0)
    sync = VllmTransferSync(engine, FakeSender(log))
    try:
        with pytest.raises(WeightSyncError, match=r"finish the weight update \(/finish_weight_update\) failed: .*HTTP 500"):
            await sync.push([("w", torch.zeros(1))], version=5)
    finally:
        await engine.aclose()
        await runner.cleanup()
    assert log[-1][0] == "/resume"  # generation is never left paused
    assert engine.policy_version == 0  # a failed sync does not bump the version


def test_streamed_safetensors_read_back_as_safetensors_writes_them(tmp_path):
    from safetensors.torch import load_file, save_file

    from polar_fast.learner.weight_sync import save_safetensors

    g = torch.Generator().manual_seed(0)
    tied = torch.randn(5, 3, generator=g)
    pairs = [("embed.weight", tied), ("lm_head.weight", tied), ("odd.bias", torch.randn(7, generator=g)),
             ("mlp.weight", torch.randn(4, 6, generator=g).t()), ("scalar", torch.tensor(2.5))]  # a transposed view too
    for dtype in ("float32", "bfloat16", "float16"):
        save_safetensors(pairs, tmp_path / f"{dtype}.safetensors", dtype=dtype)
        want = {n: t.to(getattr(torch, dtype)).contiguous() for n, t in pairs if n != "lm_head.weight"}
        save_file(want, str(tmp_path / f"ref-{dtype}.safetensors"))
        got, ref = load_file(str(tmp_path / f"{dtype}.safetensors")), load_file(str(tmp_path / f"ref-{dtype}.safetensors"))
        assert got.keys() == ref.keys() == want.keys()
        for name in want:
            assert got[name].dtype == ref[name].dtype and torch.equal(got[name], ref[name]), (dtype, name)


def test_the_learners_weight_stream_announces_shapes_leaves_out_tied_weights_and_gathers_lazily(tmp_path):
    from safetensors.torch import load_file
    from test_packed_forward import tiny_llama

    from polar_fast.config import LearnerConfig
    from polar_fast.grpo import Learner
    from polar_fast.learner.weight_sync import WeightStream, save_safetensors

    model = tiny_llama()
    model.config.tie_word_embeddings = True
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2 and Qwen3.5-4B are
    lrn = Learner(LearnerConfig(lr=1e-3), model, layout="tree", max_tokens=64)
    stream = lrn.weight_stream()
    names = [n for n, _ in stream.specs]
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert dict(stream.specs) == {n: tuple(t.shape) for n, t in model.state_dict().items() if n != "lm_head.weight"}

    save_safetensors(stream, tmp_path / "model.safetensors")  # from the announced shapes, then the data
    got = load_file(str(tmp_path / "model.safetensors"))
    assert set(got) == set(names)
    for name, t in model.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(got[name], t), name

    # a tensor that does not match its announced shape fails loudly instead of writing a bad file
    bad = WeightStream([("w", (2, 2))], iter([torch.zeros(3)]))
    with pytest.raises(WeightSyncError, match="announced"):
        save_safetensors(bad, tmp_path / "bad.safetensors")
    assert not (tmp_path / "bad.safetensors").exists()


def test_transfer_sync_is_chosen_by_config_and_needs_vllm_and_a_gpu_learner(tmp_path):
    from types import SimpleNamespace

    from polar_fast.config import parse_config
    from polar_fast.learner.weight_sync import weight_sync_for
    from polar_fast.train import RunError, check_run

    with pytest.raises(RunError, match="engine.kind = 'embedded'"):
        check_run(parse_config({"engine": {"weight_sync": "transfer"}}))
    with pytest.raises(RunError, match="learner.device = 'cpu'"):
        check_run(parse_config({"engine": {"kind": "vllm", "weight_sync": "transfer"}}))
    cfg = parse_config({"engine": {"kind": "vllm", "weight_sync": "transfer", "dtype": "bfloat16", "pause_mode": "wait",
                                   "transfer_port": 29600}, "learner": {"device": "cuda"}})
    check_run(cfg)
    engine = SimpleNamespace(url="http://127.0.0.1:8000", policy_version=0)
    sync = weight_sync_for(cfg, engine, tmp_path)
    assert isinstance(sync, VllmTransferSync) and sync.dtype == "bfloat16"
    assert sync.engine is engine and sync.sender.init_info(4)["master_port"] == 29600
    disk = parse_config({"engine": {"kind": "vllm"}})
    assert isinstance(weight_sync_for(disk, engine, tmp_path), DiskSync)  # the default
