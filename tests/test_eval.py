"""`eval`: the unbiased pass@k estimator, and a real harness run scored exactly.

The end-to-end test runs mini-swe-agent (the real CLI) in local sandboxes against the real proxy;
the model's choices are scripted per task by a PlaybookEngine: task A gets one known-good and two
known-bad samples, task B two good samples and one whose engine is down. So pass@k is known
exactly, including pass@3 of task B (n = 2 < k = 3) and the infra failure kept out of the score.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from polar_fast.config import parse_config
from polar_fast.engines.scripted import ENGINE_DOWN, PlaybookEngine
from polar_fast.evaluate import EvalError, format_report, heldout_tasks, pass_at_k, run_eval, score_harness
from polar_fast.model import load_tokenizer
from polar_fast.records import Outcome, RolloutRecord
from polar_fast.rollouts.families import family_tasks
from polar_fast.warm_start import SUBMIT as SUBMIT_COMMAND
from polar_fast.warm_start import bash_call

SUBMIT = bash_call(SUBMIT_COMMAND)


def good(task) -> list[str]:
    return [bash_call(f"cat > /tmp/fix.patch <<'POLAR_EOF'\n{task.patch}POLAR_EOF\ngit apply /tmp/fix.patch"), SUBMIT]


BAD = [bash_call("ls"), SUBMIT]


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (3, 1, 1, 1 / 3), (3, 1, 2, 2 / 3), (3, 1, 3, 1.0), (3, 0, 2, 0.0), (5, 2, 2, 1 - 3 / 10),
    (10, 10, 5, 1.0), (2, 2, 3, None), (0, 0, 1, None),
])
def test_pass_at_k_is_the_unbiased_estimator(n, c, k, expected):
    got = pass_at_k(n, c, k)
    assert got == expected if expected is None else got == pytest.approx(expected)


def test_infra_failures_are_not_scored_and_short_tasks_are_left_out():
    def r(task, outcome, reward, i):
        return RolloutRecord(rollout_id=f"{task}-{i}", group_id=task, task_id=task, harness="h",
                             outcome=outcome, reward=reward, causes={"no_tool_call": 1})
    rollouts = [r("a", Outcome.OK, 1.0, 0), r("a", Outcome.AGENT_ERROR, 0.0, 1),
                r("b", Outcome.INFRA_ERROR, None, 0), r("b", Outcome.OK, 0.0, 1)]
    s = score_harness("h", rollouts, [1, 2])
    assert s.pass_at == {"1": pytest.approx(0.25), "2": 1.0} and s.short == {"1": 0, "2": 1}
    assert s.outcomes["infra_error"] == 1 and s.causes["no_tool_call"] == 4
    assert [t.infra_failures for t in s.per_task] == [0, 1]


@pytest.mark.anyio
@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_eval_through_a_real_harness_reports_exact_pass_at_k(tmp_path):
    task_a, task_b = await anyio.to_thread.run_sync(lambda: family_tasks("heldout", families=["constant"])[:2])
    raw = {
        "run": {"output_dir": str(tmp_path / "run")},
        "engine": {"kind": "scripted"},
        "sampling": {"max_tokens": 4096},
        "sandbox": {"kind": "local"},
        # the engine-down rollout ends at the harness timeout (its client retries the 503s until
        # then), which bounds the test; a scripted rollout takes ~15 s, so 60 s leaves 4x room
        "harness": {"name": "mini-swe-agent", "max_steps": 4, "timeout_s": 60},
        "tasks": {"source": "families", "families": ["constant"]},
        "pools": {"boot_workers": 2, "agent_workers": 2, "eval_workers": 2, "prewarm": 0, "infra_retries": 0},
    }
    cfg = parse_config(raw)
    tokenizer = await anyio.to_thread.run_sync(load_tokenizer)
    plays = {task_a.problem_statement: [good(task_a), BAD, BAD],
             task_b.problem_statement: [good(task_b), good(task_b), [ENGINE_DOWN]]}
    report = await run_eval(cfg, samples=3, ks=[1, 2, 3], limit=2,
                            engine_for=lambda c: PlaybookEngine(plays, tokenizer))
    [h] = report.harnesses
    by_task = {t.task_id: t for t in h.per_task}
    a, b = by_task[task_a.instance_id], by_task[task_b.instance_id]
    assert (a.scored, a.passed, a.infra_failures) == (3, 1, 0)
    assert (b.scored, b.passed, b.infra_failures) == (2, 2, 1)
    assert a.pass_at == {"1": pytest.approx(1 / 3), "2": pytest.approx(2 / 3), "3": 1.0}
    assert b.pass_at == {"1": 1.0, "2": 1.0, "3": None}
    assert h.pass_at == {"1": pytest.approx(2 / 3), "2": pytest.approx(5 / 6), "3": 1.0}
    assert h.short == {"1": 0, "2": 0, "3": 1} and h.outcomes["infra_error"] == 1
    assert report.provenance["git_commit"] and report.provenance["harnesses"]["mini-swe-agent"]["pip"]
    assert len(report.provenance["model_sha256"]) == 64 and len(report.provenance["tokenizer_sha256"]) == 64
    text = format_report(report)
    assert "66.7" in text and "83.3" in text and "1 tasks with fewer than 3 scored samples" in text
    assert "temperature 1.0" in text


@pytest.mark.anyio
async def test_bad_arguments_are_refused_before_anything_runs(tmp_path):
    cfg = parse_config({"run": {"output_dir": str(tmp_path / "run")}})
    with pytest.raises(EvalError, match="unknown harness 'nope'"):
        await run_eval(cfg, harnesses=["nope"])
    with pytest.raises(EvalError, match="k must be"):
        await run_eval(cfg, ks=[0])
    with pytest.raises(EvalError, match="samples must be"):
        await run_eval(cfg, samples=0)


def test_eval_cli_reports_a_missing_checkpoint_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "polar_fast", "eval", "--set", f"run.output_dir={tmp_path}",
                           "--set", "tasks.source=families", "--checkpoint", str(tmp_path / "nope.pt")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "nope.pt does not exist" in done.stderr


def test_a_learner_checkpoint_converts_to_a_model_dir_with_the_trained_weights(tmp_path):
    """`eval --checkpoint runs/x/checkpoints`: the learner saves its PackedLM wrapper (keys under
    `lm.`); the converted HF dir must hold exactly the learner's weights."""
    import torch
    from test_packed_forward import tiny_llama

    from polar_fast.config import LearnerConfig
    from polar_fast.evaluate import checkpoint_model_dir
    from polar_fast.grpo import Learner
    from polar_fast.model import load_model, load_tokenizer

    base = tmp_path / "base"
    tiny_llama().save_pretrained(base)
    load_tokenizer().save_pretrained(base)
    learner = Learner(LearnerConfig(check_packed=False), load_model(str(base)))
    with torch.no_grad():
        next(learner.policy.parameters()).add_(1.0)  # as a step would: weights the base does not have
    learner.save(str(tmp_path / "checkpoints"))
    out = checkpoint_model_dir(str(tmp_path / "checkpoints"), str(base))
    converted = load_model(str(out)).state_dict()
    for name, value in learner.policy.lm.state_dict().items():
        assert torch.equal(converted[name], value), name


# ------------------------------------------------------------------------ held out means held out

TASK_DATA = Path(__file__).parent / "data" / "tasks"


def test_a_jsonl_source_with_periodic_eval_and_no_eval_source_is_refused_at_start(tmp_path):
    """A single file has no held-out split: the periodic eval would score the training rows."""
    from polar_fast.train import train

    source = str(TASK_DATA / "swebench_verified.jsonl")
    cfg = parse_config({"run": {"output_dir": str(tmp_path / "run")}, "tasks": {"source": source},
                        "eval": {"every_steps": 1}})
    with pytest.raises(EvalError, match=r"is a single set of tasks with no held-out split: an eval of split "
                                        r"'heldout' would run on the training tasks\. Set eval\.source"):
        anyio.run(train, cfg)
    assert not (tmp_path / "run").exists()  # refused before the run dir, the model or a sandbox


def _hub_dir(path: Path, splits: dict[str, list[dict]]) -> str:
    path.mkdir()
    for split, rows in splits.items():
        (path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_datasets_dir_whose_heldout_rows_overlap_training_is_refused(tmp_path):
    rows = [json.loads(line) for line in (TASK_DATA / "swebench_verified.jsonl").read_text().splitlines()]
    same_state = {**rows[1], "instance_id": "renamed__copy-1"}  # another id, the same repo at the same commit
    source = _hub_dir(tmp_path / "ds", {"train": rows[:2], "heldout": [rows[0], same_state, rows[2]]})
    cfg = parse_config({"tasks": {"source": source}, "eval": {"at_start": True}})
    with pytest.raises(EvalError) as refused:
        heldout_tasks(cfg, "heldout", 0)
    message = str(refused.value)
    assert "2 of the 3 tasks of split 'heldout'" in message and "training split 'train'" in message
    assert f"instance_id {rows[0]['instance_id']}" in message
    assert f"renamed__copy-1 (repo {rows[1]['repo']} at base_commit {rows[1]['base_commit'][:12]})" in message
    with pytest.raises(EvalError, match="held-out tasks overlap the training tasks"):  # `eval` refuses too
        anyio.run(functools.partial(run_eval, cfg, harnesses=["mini-swe-agent"]))


def test_held_out_tasks_that_share_nothing_pass(tmp_path):
    rows = [json.loads(line) for line in (TASK_DATA / "swebench_verified.jsonl").read_text().splitlines()]
    source = _hub_dir(tmp_path / "ds", {"train": rows[:2], "heldout": rows[2:]})
    cfg = parse_config({"tasks": {"source": source}})
    assert [t.instance_id for t in heldout_tasks(cfg, "heldout", 0)] == [rows[2]["instance_id"]]
    # a single training file with its held-out tasks in eval.source
    (tmp_path / "heldout.jsonl").write_text(json.dumps(rows[2]) + "\n")
    cfg = parse_config({"tasks": {"source": str(TASK_DATA / "calc.jsonl")},
                        "eval": {"source": str(tmp_path / "heldout.jsonl")}})
    assert [t.instance_id for t in heldout_tasks(cfg, "heldout", 0)] == [rows[2]["instance_id"]]
    families = parse_config({"tasks": {"source": "families", "families": ["constant"]}})
    assert len(heldout_tasks(families, "heldout", 0)) == 4
    # the training split, asked for by name, is evaluated as asked
    assert len(heldout_tasks(parse_config({"tasks": {"source": str(TASK_DATA / "calc.jsonl")}}), "train", 0)) == 3
