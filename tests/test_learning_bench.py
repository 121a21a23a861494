"""bench/learning_bench.py's bookkeeping, without its hours of sampling: stages computed once and
read back (a stopped bench resumes), the budget stops before a stage that would not fit, the
bootstrap intervals hold the mean, and the RESULT line carries every key the issue names."""

from __future__ import annotations

import importlib.util
import re
import sys
import time
from pathlib import Path

import anyio
import pytest

from polar_fast.report.intervals import bootstrap, paired_bootstrap

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("learning_bench", ROOT / "bench" / "learning_bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["learning_bench"] = module
    spec.loader.exec_module(module)
    return module


lb = _bench()


def _report(harness: str, passed: dict[str, int], scored: int = 4) -> dict:
    return {"harnesses": [{"harness": harness, "per_task": [{"task_id": t, "passed": p, "scored": scored}
                                                            for t, p in passed.items()]}]}


@pytest.mark.anyio
async def test_a_stage_is_computed_once_and_a_stopped_bench_resumes_from_disk(tmp_path):
    calls = []

    async def compute():
        calls.append(1)
        return {"pass": 0.5}

    stages = lb.Stages(tmp_path, 0, time.monotonic())
    assert await stages.get("pi/warm_heldout", 1, compute) == {"pass": 0.5}
    again = lb.Stages(tmp_path, 0, time.monotonic())  # a new process: the stage comes from its JSON file
    assert (await again.get("pi/warm_heldout", 1, compute))["pass"] == 0.5
    assert len(calls) == 1 and "duration_s" in (await again.get("pi/warm_heldout", 1, compute))


@pytest.mark.anyio
async def test_the_budget_stops_before_a_stage_that_would_not_fit(tmp_path):
    async def compute():
        raise AssertionError("a stage past the budget must not start")

    stages = lb.Stages(tmp_path, budget_s=60, started=time.monotonic() - 30)
    with pytest.raises(SystemExit, match="rerun with the same --out"):
        await stages.get("pi/rl", 45, compute)


def test_bootstrap_intervals_hold_the_mean_and_a_paired_gain_lies_above_zero():
    values = [0.0, 0.25, 0.5, 0.5, 1.0, 0.75, 0.0, 0.25]
    lo, hi = bootstrap(values)
    assert lo <= sum(values) / len(values) <= hi and lo < hi
    before = [0.0, 0.25, 0.0, 0.5, 0.25, 0.0, 0.25, 0.5]
    lo, hi = paired_bootstrap(before, [b + 0.25 for b in before])
    assert lo == pytest.approx(0.25) and hi == pytest.approx(0.25)  # every task gains the same: no spread
    lo, hi = paired_bootstrap(before, [b + d for b, d in zip(before, [0.5, 0, 0.25, 0, 0.5, 0.25, 0, 0.25])])
    assert 0 < lo < hi


def test_the_result_line_names_every_stage_and_the_two_paired_intervals(capsys):
    harnesses = ["mini-swe-agent", "pi"]
    tasks = [f"family__constant-{1_000_100 + i}" for i in range(6)]

    def results(h: str) -> dict:
        # warm passes i % 3 of 4 samples per task, control one more, rl two more (capped at 4)
        extra = {"warm": 0, "control": 1, "rl": 2}
        return {f"{policy}:{split}": _report(h, {t: min(4, i % 3 + extra[policy]) for i, t in enumerate(tasks)})
                for policy in extra for split in (lb.HELDOUT, lb.TRANSFER)}

    steps = [{"reward/mean": r, "learner/entropy": 0.5, "learner/kl": 0.01, "reward/groups": 2,
              "reward/zero_variance_groups": 1} for r in (0.1, 0.2, 0.3, 0.5, 0.6, 0.7)]
    done = {h: {"results": results(h), "rl": [{"steps": steps}],
                "controls": {"control": {"optimizer_steps": 6, "rows_per_step": 4, "forwarded_tokens": 100,
                                         "rl_optimizer_steps": 6, "rl_forwarded_tokens": 110, "lr": 1e-4}}}
            for h in harnesses}
    cells = {(t, o): _report(o, {x: 2 for x in tasks}) for t in harnesses for o in harnesses}
    stages = lb.Stages(Path("."), 0, time.monotonic())
    result = lb.print_summary(harnesses, done, cells, stages, samples=4)
    out = capsys.readouterr().out
    for h in ("mini_swe_agent", "pi"):
        for k in ("warm", "rl", "control", "rl_delta_lo", "rl_delta_hi", "rl_minus_control_lo", "rl_minus_control_hi",
                  "train_reward_first", "train_reward_last", "transfer_warm", "transfer_rl", "transfer_control"):
            assert f"{h}_{k}" in result, (h, k)
    assert result["matrix_pi_on_mini_swe_agent"] == 0.5
    # rl passes more of every task (capped at 4 of 4) than warm and than control: both intervals lie above 0
    assert result["mini_swe_agent_rl_delta_lo"] > 0 and result["mini_swe_agent_rl_minus_control_lo"] > 0
    assert result["mini_swe_agent_train_reward_first"] == pytest.approx(0.2)
    assert result["mini_swe_agent_train_reward_last"] == pytest.approx(0.6)
    assert re.search(r"control -> rl on heldout_large: \+\d+\.\d points", out)
    assert "KL to the warm start per step" in out and "share of finished groups with an advantage" in out
    assert "control: 6 sft steps of 4 rows (100 tokens forwarded) vs rl: 6 steps (110 tokens); lr 0.0001" in out
    assert "mini_swe_agent_control_rl_lr" not in result  # only with --control-lr rl or both


def test_tune_reports_pass_at_1_pass_at_k_and_the_advantage_share_per_family(capsys):
    args = type("Args", (), {"tune_samples": 4, "group_size": 4})()
    per_task = [{"task_id": "family__constant-700000", "passed": 2, "scored": 4},
                {"task_id": "family__constant-700001", "passed": 4, "scored": 4},
                {"task_id": "family__returns-700000", "passed": 0, "scored": 4}]
    report = {"harnesses": [{"harness": "mini-swe-agent", "per_task": per_task}]}
    result = lb.print_tune(["mini-swe-agent"], {"mini-swe-agent": {"tune": {"guided": report}}}, args)
    assert result["mini_swe_agent_constant_guided_pass1"] == pytest.approx(0.75)
    assert result["mini_swe_agent_constant_guided_pass4"] == pytest.approx(1.0)
    assert result["mini_swe_agent_returns_guided_pass1"] == 0.0
    assert result["mini_swe_agent_all_guided_pass1"] == pytest.approx(0.5)
    out = capsys.readouterr().out
    # advantage@4 of a task at p = 0.5 is 1 - 2/16; at p = 1 or 0 it is 0
    assert "| constant | 2 | 75.0% | 100.0% | 44% | 50% |" in out


def test_two_rl_seeds_and_two_controls_are_each_compared_and_the_seeds_pooled_per_task(capsys):
    tasks = [f"family__constant-{1_000_100 + i}" for i in range(4)]
    passed = {"warm": [0, 1, 2, 2], "rl": [2, 1, 4, 2], "rl_seed1": [0, 3, 2, 4], "control": [0, 0, 2, 2],
              "control_rl_lr": [1, 1, 2, 2]}
    results = {f"{p}:{split}": _report("mini-swe-agent", dict(zip(tasks, n)))
               for p, n in passed.items() for split in (lb.HELDOUT, lb.TRANSFER)}
    steps = [{"reward/mean": r} for r in (0.1, 0.2, 0.3, 0.4)]
    done = {"mini-swe-agent": {"results": results, "rl": [{"steps": steps}, {"steps": steps[::-1]}]}}
    result = lb.print_summary(["mini-swe-agent"], done, {}, lb.Stages(Path("."), 0, time.monotonic()), samples=4)
    out = capsys.readouterr().out
    # each seed passes 9 of 16; pooled, per task the mean of the seeds' rates: 1, 2, 3, 3 of 4
    assert result["mini_swe_agent_rl"] == result["mini_swe_agent_rl_seed1"] == pytest.approx(9 / 16)
    assert result["mini_swe_agent_rl_pooled"] == pytest.approx(9 / 16)
    for name in ("rl", "rl_seed1", "rl_pooled"):
        for before, suffix in (("warm", "delta"), ("control", "minus_control"), ("control_rl_lr", "minus_control_rl_lr")):
            assert f"{before} -> {name} on heldout_large" in out
            assert f"mini_swe_agent_{name}_{suffix}_lo" in result and f"mini_swe_agent_{name}_{suffix}_hi" in result
    assert result["mini_swe_agent_control_rl_lr"] == pytest.approx(6 / 16)
    # the pooled row sits beside the seeds' rows in the table
    assert "| rl_pooled | 56.2%" in out
    assert result["mini_swe_agent_rl_seed1_train_reward_first"] == pytest.approx(0.3)
    assert result["mini_swe_agent_train_reward_first"] == pytest.approx(0.2)
    assert "GRPO train reward per step (rl_seed1): 0.40, 0.30, 0.20, 0.10" in out
