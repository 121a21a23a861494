"""The warm start's sft in a process of its own (learner/sft_process.py): the same fine-tune as
in-process (report and weights), its progress events reach the caller, its errors come back in
the caller's dialect, and a child that dies without a report is named, not waited on forever."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal

import pytest
from test_sft import token_rows, update_gap, write_rows

from polar_fast.config import parse_config
from polar_fast.grpo import Learner
from polar_fast.learner.sft import SftError, run_sft
from polar_fast.learner.sft_process import run_sft_in_process
from polar_fast.model import load_model


def tiny_cfg(tmp_path, tiny_model):
    return parse_config({"model": {"path": str(tiny_model)}, "run": {"output_dir": str(tmp_path / "run")},
                         "sft": {"epochs": 2, "lr": 1e-3, "rows_per_step": 1}})


@pytest.mark.timeout(300)
def test_the_child_fine_tunes_as_the_caller_would_and_its_events_come_back(tmp_path, tiny_model):
    write_rows(tmp_path / "data", token_rows())
    cfg = tiny_cfg(tmp_path, tiny_model)
    events = []
    child = asyncio.run(run_sft_in_process(cfg, tmp_path / "data", Learner.from_config, out_dir=tmp_path / "child",
                                           emit=lambda kind, data: events.append(data["message"])))
    here = run_sft(cfg, tmp_path / "data", Learner.from_config, out_dir=tmp_path / "here")

    shape = lambda r: (r.rows, r.steps, r.tokens, r.trained_tokens)  # noqa: E731
    assert shape(child) == shape(here) and (child.rows, child.steps) == (2, 4)
    assert child.nll_after == pytest.approx(here.nll_after, rel=1e-4) and child.nll_after < child.nll_before
    assert sum("sft epoch" in m for m in events) == 4  # one per step, emitted in the child
    # Bitwise equality is not promised: the child may split matmuls over another thread count, and
    # AdamW turns a rounding difference in a near-zero gradient into a step of up to lr. What must
    # hold is that both made the same update: their gap is small beside the update itself.
    start = load_model(str(tiny_model)).state_dict()
    a, b = load_model(str(tmp_path / "child")).state_dict(), load_model(str(tmp_path / "here")).state_dict()
    gap, update = update_gap(start, a, b)
    assert update > 0 and gap < 0.05 * update, (gap, update)
    assert not multiprocessing.active_children()


@pytest.mark.anyio
async def test_bad_data_is_the_same_sft_error_as_in_process(tmp_path, tiny_model):
    # async, as the warm start calls it: blockbuster (conftest) fails any blocking call the
    # spawn makes on the event loop
    cfg = tiny_cfg(tmp_path, tiny_model)
    with pytest.raises(SftError) as here:
        await asyncio.to_thread(run_sft, cfg, tmp_path / "missing", Learner.from_config, out_dir=tmp_path / "m")
    with pytest.raises(SftError) as child:
        await run_sft_in_process(cfg, tmp_path / "missing", Learner.from_config, out_dir=tmp_path / "m")
    assert str(child.value) == str(here.value) and "no SFT token rows" in str(child.value)


@pytest.mark.timeout(300)
def test_a_child_killed_mid_fine_tune_is_an_sft_error_naming_the_signal(tmp_path, tiny_model):
    write_rows(tmp_path / "data", token_rows() * 20)
    cfg = parse_config({"model": {"path": str(tiny_model)}, "sft": {"epochs": 50, "rows_per_step": 1}})

    def kill_at_first_step(kind, data):
        if "sft epoch" in data["message"]:
            [child] = multiprocessing.active_children()
            os.kill(child.pid, signal.SIGKILL)

    with pytest.raises(SftError, match="exit code -9"):
        asyncio.run(run_sft_in_process(cfg, tmp_path / "data", Learner.from_config, out_dir=tmp_path / "m",
                                       emit=kill_at_first_step))
    assert not multiprocessing.active_children()
