"""The run summary fits the terminal (every cell whole on 80 columns, more columns when wider); metrics
reach Weights & Biases when asked."""

from __future__ import annotations

import io
import json
import time

import pytest
from rich.console import Console

from polar_fast.report.progress import SUMMARY_COLUMNS, summary_table

STEP = {"learner/step": 12, "reward/mean": 0.625, "learner/n_rollouts": 16, "proxy/sampled_tokens": 1_234_567,
        "merge/tokens_forwarded": 12_345_678, "learner/loss": -0.0123, "learner/grad_norm": 1.234,
        "step_time_s": 1234.5, "merge/per_call_over_merged": 5.43, "learner/clip_frac": 0.01,
        "reward/std": 0.5, "reward/zero_variance_groups": 3, "staleness/max": 1}


def _render(width: int) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(summary_table([STEP, STEP], width=width))
    return console.export_text()


@pytest.mark.parametrize("width", [80, 100, 240])
def test_summary_fits_and_never_cuts_a_cell(width):
    text = _render(width)
    assert max(len(line) for line in text.splitlines()) <= width
    assert "…" not in text
    for cell in ("1234567", "12345678", "-0.0123", "1234.5"):
        assert cell in text


def test_a_wide_terminal_shows_every_column_and_a_narrow_one_a_prefix():
    wide, narrow = _render(240), _render(80)
    assert "staleness" in wide and "merged" in wide
    assert "staleness" not in narrow
    shown = [header.split("\n")[-1] for header, _, _ in SUMMARY_COLUMNS if header.split("\n")[-1] in narrow]
    assert shown == [header.split("\n")[-1] for header, _, _ in SUMMARY_COLUMNS[: len(shown)]]


def _eval(step: int, pass1: float | None) -> dict:
    return {"step": step, "split": "heldout", "tasks": 14, "samples": 1, "pass_at": {"1": pass1},
            "mean_reward": pass1, "causes": {}}


def test_summary_puts_the_starting_and_the_last_heldout_pass1_side_by_side():
    from types import SimpleNamespace

    from polar_fast.report.progress import Progress, before_after

    assert before_after([_eval(0, 0.25), _eval(2, 0.5)]) == (
        "heldout pass@1: 25.0% at the start (the policy RL began from) -> 50.0% after step 2 "
        "(+25.0 points; 14 heldout tasks x 1)")
    assert before_after([_eval(2, 0.5)]) == ""  # no eval of the starting policy: nothing to compare
    assert before_after([_eval(0, 0.5)]) == ""
    # with each task's pass@1, the change gets a paired interval and an honest label
    tasks = [f"t{i}" for i in range(14)]
    start = {**_eval(0, 0.25), "per_task": {t: float(i < 3) for i, t in enumerate(tasks)}}
    noisy = {**_eval(2, 0.5), "per_task": {t: float(1 <= i < 5) for i, t in enumerate(tasks)}}
    assert before_after([start, noisy]).endswith(": within noise)")
    gain = {**_eval(2, 0.9), "per_task": {t: 1.0 for t in tasks}}
    line = before_after([start, gain])
    assert "95% paired interval over 14 tasks x 1 [+" in line and line.endswith("sign-flip p 0.00: a gain)")
    # 3 of 4 tasks better, none worse: the bootstrap alone says [+25, +100], but a policy that
    # changed nothing moves 3 of 3 changed tasks one way a quarter of the time
    four = ["a", "b", "c", "d"]
    small_start = {**_eval(0, 0.25), "tasks": 4, "per_task": {t: float(t == "d") for t in four}}
    small_after = {**_eval(2, 1.0), "tasks": 4, "per_task": {t: 1.0 for t in four}}
    assert before_after([small_start, small_after]).endswith("[+25.0, +100.0], sign-flip p 0.25: within noise)")
    steps = [{"learner/step": 1, "reward/mean": 0.0}, {"learner/step": 2, "reward/mean": 0.5},
             {"learner/step": 3, "reward/mean": 1.0}]
    summary = SimpleNamespace(steps=steps, outcomes={}, groups_trained=0, groups_withheld=0, calls=0,
                              sampled_tokens=0, stopped_early=False, evals=[_eval(0, 0.25), _eval(2, 0.5)], causes={},
                              leftovers_removed=0, checkpoint="ckpt", warm_start={})
    out = io.StringIO()
    Progress(steps=2, enabled=False).print_summary(summary, console=Console(file=out, width=200))
    assert "25.0% at the start" in out.getvalue() and "-> 50.0% after step 2" in out.getvalue()
    assert "train reward per step: ▁▅█  0.00 0.50 1.00" in out.getvalue()


def test_metrics_go_to_weights_and_biases_offline(tmp_path, monkeypatch):
    """run.wandb = "offline": the same flat metrics as metrics.jsonl, in a local W&B run under the
    output dir (no login, no network); skipped where the optional extra is not installed."""
    pytest.importorskip("wandb")
    from polar_fast.report.metrics import MetricsWriter

    for var in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_MODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    writer = MetricsWriter(tmp_path, tensorboard=False, wandb="offline", wandb_project="polar-test",
                           config={"run": {"steps": 2}})
    writer.write_sync(1, {"reward": {"mean": 0.25}, "learner": {"loss": 1.5}})
    writer.write_sync(2, {"reward": {"mean": 0.75}, "learner": {"loss": 0.5}})
    writer.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1] == {"step": 2, "reward/mean": 0.75, "learner/loss": 0.5}
    [log] = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    records = wandb_records(log)
    for _ in range(100):  # wandb-core may still be writing the file when finish() returns
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.1)
        records = wandb_records(log)
    history = [r.history for r in records if r.WhichOneof("record_type") == "history"]
    rows = [{name: json.loads(i.value_json) for i in h.item if not (name := i.key or "/".join(i.nested_key)).startswith("_")}
            for h in history]
    assert rows == [{"reward/mean": 0.25, "learner/loss": 1.5}, {"reward/mean": 0.75, "learner/loss": 0.5}]
    assert [h.step.num for h in history] == [1, 2]
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert {i.key: json.loads(i.value_json) for i in run.config.update}["run"] == {"steps": 2}


def wandb_records(path):
    """The protobuf records of an offline W&B run file: a ':W&B' header, then LevelDB-log records
    (crc 4, length 2, type 1: full, or first / middle / last pieces) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, piece, out = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        piece += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(piece)
            out.append(record)
            piece = b""
    return out


def test_wandb_without_the_extra_is_one_clear_error(tmp_path, monkeypatch):
    import builtins

    from polar_fast.errors import ConfigError
    from polar_fast.report.metrics import MetricsWriter

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ConfigError, match=r"run.wandb = 'online' needs the optional wandb package: uv pip install"):
        MetricsWriter(tmp_path, tensorboard=False, wandb="online")


def test_the_sign_flip_p_value_counts_every_sign_pattern_as_extreme_as_the_change():
    import itertools
    import random

    from polar_fast.report.intervals import EXACT_UP_TO, paired_verdict, sign_flip_p

    assert sign_flip_p([1, 1, 1, 0]) == 0.25  # of 8 patterns of 3 changed tasks, +++ and ---
    assert sign_flip_p([1.0] * 6) == 2 / 64
    assert sign_flip_p([0.5, -0.25]) == 1.0  # every pattern is at least 0.25 from 0
    assert sign_flip_p([0, 0]) == sign_flip_p([]) == 1.0
    rng = random.Random(3)
    for _ in range(20):  # against every pattern written out
        d = [rng.choice([-1, -0.5, -0.25, 0.25, 0.5, 1]) for _ in range(rng.randint(1, 9))]
        patterns = list(itertools.product([-1, 1], repeat=len(d)))
        extreme = sum(abs(sum(s * x for s, x in zip(signs, d))) >= abs(sum(d)) - 1e-9 for signs in patterns)
        assert sign_flip_p(d) == pytest.approx(extreme / len(patterns))
    # past the exact size, random patterns: all better is far below 0.05, a balanced change is not
    assert sign_flip_p([1.0] * (EXACT_UP_TO + 4)) < 0.001
    assert sign_flip_p([1.0, -1.0] * 12) > 0.9
    assert paired_verdict([0.0] * 20, [1.0] * 20)[3] == "a gain"
    assert paired_verdict([1.0] * 20, [0.0] * 20)[3] == "a loss"
    assert paired_verdict([0.0, 0.0, 1.0], [1.0, 1.0, 1.0])[3] == "within noise"
