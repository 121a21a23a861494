"""Weight sync: in-process copy into the embedded engine, reload from disk, and the vLLM
dev-mode weight-transfer call sequence against a local aiohttp fake of its endpoints."""

from __future__ import annotations

import json

import anyio
import pytest
import torch
from aiohttp import web

from polar_fast.learner.weight_sync import DiskSync, EngineSync, VllmTransferSync, WeightSyncError


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
    def __init__(self, log: list) -> None:
        self.log = log

    def init_info(self) -> dict:
        return {"master_address": "127.0.0.1", "master_port": 29555, "rank_offset": 1, "world_size": 2}

    async def connect(self) -> None:
        self.log.append(("connect",))

    async def send(self, named_tensors) -> None:
        self.log.append(("send", [n for n, _ in named_tensors]))


async def fake_vllm(log: list, fail: str = ""):
    async def handle(request: web.Request) -> web.Response:
        body = await request.text()
        log.append((request.path_qs, json.loads(body) if body else None))
        if request.path == fail:
            return web.json_response({"error": "boom"}, status=500)
        return web.json_response({"message": "ok"})

    app = web.Application()
    app.router.add_post("/{name}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.anyio
async def test_vllm_transfer_call_sequence():
    log: list = []
    runner, url = await fake_vllm(log)
    engine = RecordingEngine()
    sync = VllmTransferSync(url, FakeSender(log), engine=engine)
    weights = [("model.embed.weight", torch.zeros(4, 2, dtype=torch.bfloat16)), ("lm_head.bias", torch.zeros(4))]
    try:
        await sync.push(weights, version=1)
        await sync.push(weights, version=2)
    finally:
        await sync.aclose()
        await runner.cleanup()
    paths = [entry[0] for entry in log]
    # init once (concurrently with the sender's connect), then per sync the update lifecycle
    assert sorted(paths[:2]) == sorted(["/init_weight_transfer_engine", "connect"])
    one_sync = ["/pause?mode=keep&clear_cache=false", "/start_weight_update", "/update_weights", "send",
                "/finish_weight_update", "/reset_prefix_cache?reset_running_requests=true", "/resume"]
    rest = paths[2:]
    assert len(rest) == 2 * len(one_sync)
    for chunk in (rest[:7], rest[7:]):
        assert chunk[:2] == one_sync[:2] and sorted(chunk[2:4]) == sorted(one_sync[2:4]) and chunk[4:] == one_sync[4:]
    bodies = {entry[0]: entry[1] for entry in log if entry[0].startswith("/")}
    assert bodies["/finish_weight_update"] == {"weight_version": "2"}
    assert bodies["/init_weight_transfer_engine"] == {"init_info": FakeSender(log).init_info()}
    update = bodies["/update_weights"]
    assert update == {"update_info": {"names": ["model.embed.weight", "lm_head.bias"],
                                      "dtype_names": ["bfloat16", "float32"], "shapes": [[4, 2], [4]],
                                      "packed": False}}
    assert engine.policy_version == 2


@pytest.mark.anyio
async def test_vllm_transfer_failure_resumes_and_raises():
    log: list = []
    runner, url = await fake_vllm(log, fail="/finish_weight_update")
    engine = RecordingEngine()
    sync = VllmTransferSync(url, FakeSender(log), engine=engine)
    try:
        with pytest.raises(WeightSyncError, match="finish_weight_update answered 500"):
            await sync.push([("w", torch.zeros(1))], version=5)
    finally:
        await sync.aclose()
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
