"""The training run under torchrun: 2 gloo ranks, rank 0 running pools, proxy and engine.

`torchrun --nproc_per_node 2 -m polar_fast --config run.toml` trains one step on a group the
real mini-swe-agent produced in a local sandbox with scripted model choices (as test_train.py).
The policy is a tiny random Llama with SmolLM2's real tokenizer and chat template, so the two
learner steps take seconds on CPU; test_train.py trains the real SmolLM2.
Then a single-process Learner built from the same config takes the step on the same captured
calls and rewards: loss, grad norm and the checkpointed weights must match, which they only do
if rank 1 really took its share of the micro-batches (FSDP2 averages gradients over ranks)
and joined the sync, the checkpoint and the stop.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_train import GROUP_REPLIES, toml_text

from polar_fast.config import load_config
from polar_fast.learner.distributed import Message, _decoder, _encoder
from polar_fast.records import CallRecord, Outcome, RolloutRecord, read_log
from polar_fast.train import check_run

ROOT = Path(__file__).resolve().parents[1]


def test_messages_round_trip_through_msgpack():
    """A step's groups reach the followers whole: task, records, calls, diff and test results."""
    from polar_fast.rollouts.groups import FinishedRollout, GroupRecord
    from polar_fast.rollouts.reward import EvalResult
    from polar_fast.rollouts.tasks import load_builtin

    call = CallRecord(session_id="s", rollout_id="r", group_id="g", call_index=0, prompt_ids=[1, 2],
                      completion_ids=[3], completion_logprobs=[-0.25], policy_version=2,
                      finish_reason="stop", dialect="chat")
    rollout = RolloutRecord(rollout_id="r", group_id="g", task_id="t", harness="pi", outcome=Outcome.OK, reward=1.0)
    scored = EvalResult(reward=1.0, tests={"t.py::test_x": "passed"}, failed=[])
    group = GroupRecord(group_id="g", task=load_builtin()[0],
                        rollouts=[FinishedRollout(record=rollout, calls=[call], diff="+x", eval=scored)])
    message = Message(kind="step", groups=[group])
    assert _decoder.decode(_encoder.encode(message)) == message


def test_under_torchrun_a_device_index_is_refused(monkeypatch):
    from polar_fast.errors import ConfigError
    from polar_fast.learner.distributed import init

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="use 'cuda'"):
        init(load_config(None, ["learner.device=cuda:1"]))


def tiny_model_dir(path: Path) -> Path:
    """Two decoder layers (FSDP2 shards each), SmolLM2's vocabulary, tokenizer and template."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from polar_fast.model import load_tokenizer

    tokenizer = load_tokenizer()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def step_order(calls: list[CallRecord], rollouts: list[RolloutRecord]) -> list[CallRecord]:
    """The calls as the run handed them to the learner: rollout order, then call order."""
    order = {r.rollout_id: i for i, r in enumerate(rollouts)}
    return sorted(calls, key=lambda c: (order[c.rollout_id], c.call_index))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_rank_run_matches_a_single_process_step(tmp_path):
    out = tmp_path / "run"
    raw = {
        # max_context_tokens: a micro-batch (merge.max_tokens) holds a full-context sequence (train.check_run)
        "model": {"path": str(tiny_model_dir(tmp_path / "model")), "max_context_tokens": 2048},
        "run": {"output_dir": str(out), "steps": 1, "groups_per_step": 1, "max_staleness": 4, "tensorboard": False,
                "zero_variance_skips": 0},
        "engine": {"kind": "scripted", "scripted_replies": GROUP_REPLIES},
        "sampling": {"max_tokens": 4096},
        "sandbox": {"kind": "local"},
        "harness": {"name": "mini-swe-agent", "max_steps": 4, "timeout_s": 120},
        "tasks": {"source": "builtin", "limit": 1},
        "pools": {"group_size": 2, "boot_workers": 1, "agent_workers": 1, "eval_workers": 1, "prewarm": 0},
        # one micro-batch per leaf path (~1400 and ~1200 tokens): each rank trains on one
        "merge": {"layout": "paths", "max_tokens": 2048},
        "learner": {"lr": 1e-3},
    }
    config = tmp_path / "run.toml"
    config.write_text(toml_text(raw))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "0",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", "127.0.0.1:0",
           "-m", "polar_fast", "--config", str(config), "--quiet"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    [step] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert step["step"] == 1
    metrics = step
    log = read_log(out / "records.log")
    rollouts = [r for r in log.rollouts if r.outcome is not Outcome.ABANDONED]  # the next group, cut off by the end
    assert sorted(r.reward for r in rollouts) == [0.0, 1.0]
    calls = step_order(list(log.calls), rollouts)

    from polar_fast.grpo import Learner
    from polar_fast.testing import groups_of

    torch.manual_seed(0)
    single = Learner.from_config(load_config(config))
    before = {k: v.clone() for k, v in single.policy.state_dict().items()}
    expected = single.step(groups_of(calls, rollouts))
    assert expected.n_micro_batches == 2
    assert metrics["learner/n_micro_batches"] == expected.n_micro_batches
    assert metrics["learner/n_terms"] == expected.n_terms > 0
    assert metrics["learner/loss"] == pytest.approx(expected.loss, rel=1e-4, abs=1e-7)
    assert metrics["learner/grad_norm"] == pytest.approx(expected.grad_norm, rel=1e-3)

    saved = torch.load(out / "checkpoints" / "step_1.pt", map_location="cpu", weights_only=False)
    assert saved["step"] == 1 and saved["version"] == 1
    weights = single.policy.state_dict()
    assert set(saved["model"]) == set(weights)
    for name, tensor in weights.items():
        torch.testing.assert_close(saved["model"][name], tensor, atol=1e-5, rtol=0, msg=name)
    assert any(not torch.equal(before[k], weights[k]) for k in weights)  # the step did train


def test_the_8gpu_example_is_consistent_with_its_launch_command():
    import re

    from polar_fast.engines.vllm_launch import launch_spec

    path = ROOT / "examples" / "8gpu.toml"
    cfg = load_config(path)
    assert cfg.engine.kind == "vllm" and cfg.engine.url == ""
    assert cfg.engine.data_parallel_size == len(cfg.engine.launch_gpus) == 4
    assert cfg.sandbox.kind == "docker" and cfg.sandbox.network == "none"
    assert cfg.harness.name == "claude-code" and cfg.tasks.source.endswith(".jsonl")
    assert (cfg.learner.device, cfg.learner.dtype, cfg.learner.attention) == ("cuda", "bfloat16", "flex_attention")
    assert cfg.learner.gradient_checkpointing
    assert cfg.merge.max_tokens >= cfg.model.max_context_tokens
    check_run(cfg)  # what a run checks at start

    launch = re.search(r"CUDA_VISIBLE_DEVICES=([\d,]+) torchrun --standalone --nproc_per_node (\d+)",
                       path.read_text())
    assert launch, "the launch command is missing from the comment"
    learner_gpus = [int(g) for g in launch.group(1).split(",")]
    assert int(launch.group(2)) == len(learner_gpus)
    assert not set(learner_gpus) & set(cfg.engine.launch_gpus)  # vLLM and learner share no GPU
    spec = launch_spec(cfg, Path("/runs/8gpu/weights"), 8000, base_env={"CUDA_VISIBLE_DEVICES": launch.group(1)})
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert spec.argv[spec.argv.index("--data-parallel-size") + 1] == "4"


def test_the_qwen35_example_is_the_papers_setup_and_validates():
    import re

    from polar_fast.engines.vllm_launch import launch_spec

    path = ROOT / "examples" / "qwen35_4b_8gpu.toml"
    cfg = load_config(path)  # unknown keys or bad values fail here
    assert cfg.model.path.endswith("Qwen3.5-4B") and cfg.model.tool_parser == "qwen3_coder" and cfg.model.reasoning
    assert cfg.engine.kind == "vllm" and cfg.engine.data_parallel_size == len(cfg.engine.launch_gpus) == 4
    assert cfg.merge.layout == "tree" and cfg.merge.max_tokens >= cfg.model.max_context_tokens
    check_run(cfg)  # what a run checks at start
    assert cfg.sampling.max_tokens < cfg.model.max_context_tokens
    assert cfg.learner.check_packed and cfg.learner.kl_coef > 0 and (cfg.pools.group_size, cfg.run.groups_per_step) == (16, 9)
    launch = re.search(r"CUDA_VISIBLE_DEVICES=([\d,]+) torchrun --standalone --nproc_per_node (\d+)", path.read_text())
    assert launch, "the launch command is missing from the comment"
    learner_gpus = [int(g) for g in launch.group(1).split(",")]
    assert int(launch.group(2)) == len(learner_gpus) and not set(learner_gpus) & set(cfg.engine.launch_gpus)
    spec = launch_spec(cfg, Path("/runs/qwen35/weights"), 8000, base_env={"CUDA_VISIBLE_DEVICES": launch.group(1)})
    assert spec.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    assert spec.argv[spec.argv.index("--max-model-len") + 1] == str(cfg.model.max_context_tokens)
