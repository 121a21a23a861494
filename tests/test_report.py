"""The run summary fits the terminal: every cell whole on 80 columns, more columns when wider."""

from __future__ import annotations

import io

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
    summary = SimpleNamespace(steps=[], outcomes={}, groups_trained=0, groups_withheld=0, calls=0, sampled_tokens=0,
                              stopped_early=False, evals=[_eval(0, 0.25), _eval(2, 0.5)], causes={},
                              leftovers_removed=0, checkpoint="ckpt", warm_start={})
    out = io.StringIO()
    Progress(steps=2, enabled=False).print_summary(summary, console=Console(file=out, width=200))
    assert "25.0% at the start" in out.getvalue() and "-> 50.0% after step 2" in out.getvalue()
