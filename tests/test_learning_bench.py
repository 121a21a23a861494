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
    lo, hi = lb.bootstrap(values)
    assert lo <= sum(values) / len(values) <= hi and lo < hi
    before = [0.0, 0.25, 0.0, 0.5, 0.25, 0.0, 0.25, 0.5]
    lo, hi = lb.paired_bootstrap(before, [b + 0.25 for b in before])
    assert lo == pytest.approx(0.25) and hi == pytest.approx(0.25)  # every task gains the same: no spread
    lo, hi = lb.paired_bootstrap(before, [b + d for b, d in zip(before, [0.5, 0, 0.25, 0, 0.5, 0.25, 0, 0.25])])
    assert 0 < lo < hi


def test_the_result_line_names_every_stage_split_and_matrix_cell(capsys):
    harnesses = ["mini-swe-agent", "pi"]
    tasks = [f"t{i}" for i in range(6)]

    def results(h: str, shift: int) -> dict:
        return {f"{policy}:{split}": _report(h, {t: min(4, i % 3 + shift + k) for i, t in enumerate(tasks)})
                for k, policy in enumerate(("base", "warm", "rl")) for split in ("heldout", "transfer")}

    done = {h: {"results": results(h, s), "rl": {"steps": [{"reward/mean": 0.25}, {"reward/mean": 0.5}]}}
            for s, h in enumerate(harnesses)}
    cells = {(t, o): _report(o, {x: 2 for x in tasks}) for t in harnesses for o in harnesses}
    stages = lb.Stages(Path("."), 0, time.monotonic())
    lb.print_summary(harnesses, done, cells, ["heldout", "transfer"], stages)
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if line.startswith("RESULT ")]
    got = dict(kv.split("=") for kv in line.split()[1:])
    for h in ("mini_swe_agent", "pi"):
        for k in ("base", "warm", "rl", "rl_delta_lo", "rl_delta_hi", "transfer_base", "transfer_warm", "transfer_rl"):
            assert f"{h}_{k}" in got, (h, k)
    assert {k for k in got if k.startswith("matrix_")} == {
        "matrix_mini_swe_agent_on_mini_swe_agent", "matrix_mini_swe_agent_on_pi", "matrix_pi_on_mini_swe_agent", "matrix_pi_on_pi"}
    assert float(got["matrix_pi_on_mini_swe_agent"]) == 0.5
    # warm -> rl: one more pass per task (capped at 4 of 4): the paired interval lies above 0
    assert float(got["mini_swe_agent_rl_delta_lo"]) > 0
    assert re.search(r"warm -> rl on heldout: \+\d+\.\d points", out)
