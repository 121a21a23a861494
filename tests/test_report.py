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
