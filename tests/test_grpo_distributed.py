"""torchrun with 2 CPU processes (gloo) + FSDP2: one step matches the single-process step.

The test launches this same file as the torchrun worker (see `__main__` at the bottom)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _step(world_learner_factory):
    from test_packed_forward import branchy_calls

    from polar_fast.records import Outcome, RolloutRecord
    from polar_fast.testing import groups_of

    calls = branchy_calls(np.random.default_rng(11), 211)
    rollouts = [RolloutRecord(rollout_id=r, group_id="g", task_id="t", harness="h", outcome=Outcome.OK,
                              reward=v) for r, v in (("a", 1.0), ("b", 0.0))]
    lrn = world_learner_factory()
    metrics = lrn.step(groups_of(calls, rollouts))
    weights = {name: t.clone() for name, t in lrn.weight_stream()}  # collective under FSDP2
    return lrn, metrics, weights


def _factory():
    from test_packed_forward import tiny_llama

    from polar_fast.config import LearnerConfig
    from polar_fast.grpo import Learner

    # max_tokens 40 -> several micro-batches, an odd count, so one rank runs a filler pass
    return lambda: Learner(LearnerConfig(lr=1e-3), tiny_llama(), layout="tree", max_tokens=40,
                           merge_impl="reference")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_gloo_ranks_match_single_process(tmp_path):
    out = tmp_path / "rank0.pt"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:0", str(Path(__file__)), str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    dist_result = torch.load(out)

    lrn, metrics, weights = _step(_factory())
    assert metrics.n_micro_batches % 2 == 1
    assert dist_result["loss"] == pytest.approx(metrics.loss, abs=1e-6)
    assert dist_result["grad_norm"] == pytest.approx(metrics.grad_norm, rel=1e-4)
    assert set(dist_result["weights"]) == set(weights)
    for name, t in weights.items():
        torch.testing.assert_close(dist_result["weights"][name], t, atol=1e-6, rtol=0)
    # the disk sync's file, written by rank 0 as the ranks gathered one tensor at a time, is the
    # single process's (same names, shapes and values)
    from safetensors.torch import load_file

    from polar_fast.learner.weight_sync import save_safetensors

    save_safetensors(lrn.weight_stream(), tmp_path / "single.safetensors")
    streamed, single = load_file(out.with_suffix(".safetensors")), load_file(tmp_path / "single.safetensors")
    assert set(streamed) == set(single) == set(weights)
    for name, t in single.items():
        torch.testing.assert_close(streamed[name], t, atol=1e-6, rtol=0)


def _torchrun(tmp_path, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:0", str(Path(__file__)), *args]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_rank_receives_its_shard_of_weights_only_rank_0_loaded(tmp_path):
    """from_config under 2 gloo ranks: rank 1 never loads the model (load_model is made to fail
    there); its meta-built shard, the frozen reference (kl_coef > 0) and the rotary buffers no
    checkpoint holds all equal the saved model's."""
    from test_distributed_train import tiny_model_dir

    from polar_fast.model import load_model

    model_dir = tiny_model_dir(tmp_path / "model")  # tied embeddings, as SmolLM2
    _torchrun(tmp_path, "--from-config", str(model_dir), str(tmp_path / "rank"))
    want = load_model(str(model_dir))
    persistent = set(want.state_dict())
    weights = {n: t for n, t in want.state_dict().items() if n != "lm_head.weight"}
    buffers = {n: b for n, b in want.named_buffers() if n not in persistent}
    assert buffers  # rotary frequencies: what to_empty would have left as garbage
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, t in buffers.items():
            torch.testing.assert_close(got["buffers"][name], t, atol=0, rtol=0, msg=f"rank {rank} {name}")
        for name, t in want.state_dict().items():
            torch.testing.assert_close(got["ref"][name], t, atol=0, rtol=0, msg=f"rank {rank} ref {name}")
    streamed = torch.load(tmp_path / "rank0.pt")["weights"]
    assert set(streamed) == set(weights)
    for name, t in weights.items():
        torch.testing.assert_close(streamed[name], t, atol=0, rtol=0, msg=name)


def _from_config_worker(model_dir: str, out_prefix: str) -> None:
    import torch.distributed as dist

    import polar_fast.model
    from polar_fast.config import parse_config
    from polar_fast.grpo import Learner

    rank = dist.get_rank()
    if rank:
        def refuse(*args, **kwargs):
            raise AssertionError("a rank > 0 loaded the whole model")

        polar_fast.model.load_model = refuse
    cfg = parse_config({"model": {"path": model_dir}, "learner": {"lr": 1e-3, "kl_coef": 0.1}})
    lrn = Learner.from_config(cfg)
    assert lrn.world == 2
    persistent = set(lrn.policy.lm.state_dict())
    result = {"buffers": {n: b.clone() for n, b in lrn.policy.lm.named_buffers() if n not in persistent},
              "ref": {n: t.clone() for n, t in lrn.ref.lm.state_dict().items()},
              "weights": {n: t.clone() for n, t in lrn.weight_stream()}}  # gathered: every rank reads it
    torch.save(result, f"{out_prefix}{rank}.pt")


if __name__ == "__main__":
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if sys.argv[1] == "--from-config":
        _from_config_worker(sys.argv[2], sys.argv[3])
        from polar_fast.learner.distributed import shutdown

        shutdown()
        raise SystemExit(0)
    lrn, metrics, weights = _step(_factory())
    assert lrn.world == 2
    if dist.get_rank() == 0:
        torch.save({"loss": metrics.loss, "grad_norm": metrics.grad_norm, "weights": weights}, sys.argv[1])
    from polar_fast.learner.weight_sync import save_safetensors

    stream = lrn.weight_stream()  # what DiskSync does under torchrun: rank 0 writes, every rank gathers
    if dist.get_rank() == 0:
        save_safetensors(stream, Path(sys.argv[1]).with_suffix(".safetensors"))
    else:
        for _ in stream:
            pass
    from polar_fast.learner.distributed import shutdown

    shutdown()
