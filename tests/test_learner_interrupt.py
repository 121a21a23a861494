"""Ctrl-C during a learner step (learner/step_control.py, train.py).

- A step asked to stop, in its forward or in its backward, leaves by StepInterrupted before its
  update: the weights, the step counter and the optimizer are as before.
- A training run (the two-layer model with SmolLM2's vocabulary, a declared tiny agent,
  `python -m polar_fast`) that gets SIGINT during a long second step exits 0 within 10 s, with
  the first step's checkpoint, the second step's groups marked interrupted, and a progress
  line printed while the step ran. The step's length is made by a sleep in each logprob chunk
  (a real long step is minutes of CPU); the stop is found between chunks like any other.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
from test_distributed_train import tiny_model_dir
from test_grpo import learner, params, rollouts
from test_harness_config import _toml, tiny_agent
from test_packed_forward import branchy_calls
from test_train import TASK, fix_command, toml_text, wait_for

from polar_fast.learner.step_control import StepControl, StepInterrupted
from polar_fast.teachers.mini_swe_agent import bash_call
from polar_fast.testing import groups_of


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_stopped_step_leaves_before_its_update(phase):
    lrn = learner()
    before = params(lrn)
    groups = groups_of(branchy_calls(np.random.default_rng(3), 211), rollouts({"a": 1.0, "b": 0.0}))
    control = StepControl()
    original = control.at

    def stop_in_phase(now: str, index: int, count: int) -> None:
        if now == f"{phase} layer" and index == 1:  # the stop arrives as this layer is due, from another thread
            threading.Thread(target=control.stop.set).start()
            control.stop.wait()
        original(now, index, count)

    control.at = stop_in_phase
    with pytest.raises(StepInterrupted, match=f"stopped at micro-batch 1 of .*, {phase} layer 2 of 2"):
        lrn.step(groups, control=control)
    assert lrn.step_count == 0 and lrn.version == 0 and lrn.policy.control is None
    torch.testing.assert_close(params(lrn), before, atol=0, rtol=0)
    assert all(p.grad is None for p in lrn.policy.parameters())
    assert lrn.step(groups).step == 1  # the learner trains on afterwards
    assert not torch.equal(params(lrn), before)


# A sleep in each logprob chunk once the first checkpoint is written, and a marker file when the
# first such chunk runs: the second step is long, the first is not.
LAUNCHER = r'''
import os, sys, time
from pathlib import Path
from polar_fast.learner import packed_forward

run, original = Path(sys.argv[1]), packed_forward.PackedLM._chunk_logprobs

def slow_chunk(self, head, h, t):
    if (run / "checkpoints" / "step_1.pt").exists() and self.lm.training:
        (run / "slow-step").touch()
        time.sleep(0.3)
    return original(self, head, h, t)

packed_forward.PackedLM._chunk_logprobs = slow_chunk
from polar_fast import train
train.PROGRESS_EVERY_S = 1.0  # 30 s in a real run
from polar_fast.cli import main
sys.exit(main(["--config", sys.argv[2]]))
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_during_a_long_learner_step_exits_0_within_10_s_with_the_last_checkpoint(tmp_path):
    out = tmp_path / "run"
    (tmp_path / "tiny.toml").write_text(_toml(tiny_agent()))
    replies = [bash_call(fix_command(TASK.patch)), "Done.", bash_call("ls"), "I could not fix it."]
    raw = {
        "model": {"path": str(tiny_model_dir(tmp_path / "model")), "max_context_tokens": 4096},
        "merge": {"max_tokens": 4096},
        "run": {"output_dir": str(out), "steps": 2, "groups_per_step": 1, "max_staleness": 4, "tensorboard": False,
                "zero_variance_skips": 0, "groups_in_flight": 1},
        "engine": {"kind": "scripted", "scripted_replies": replies * 3},
        "sampling": {"max_tokens": 1024},
        "sandbox": {"kind": "local"},
        "harness": {"name": "tiny", "file": str(tmp_path / "tiny.toml"), "max_steps": 4, "timeout_s": 120},
        "tasks": {"source": "builtin", "limit": 1},
        "pools": {"group_size": 2, "boot_workers": 1, "agent_workers": 1, "eval_workers": 1, "prewarm": 0},
        "learner": {"lr": 1e-3, "logprob_chunk_tokens": 8, "max_mismatch_kl": 0.0},
    }
    (tmp_path / "run.toml").write_text(toml_text(raw))
    command = [sys.executable, "-c", LAUNCHER, str(out), str(tmp_path / "run.toml")]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "COLUMNS": "200"}) as proc:
        wait_for(lambda: (out / "slow-step").exists(), 240, proc)
        time.sleep(1.0)  # well inside the step
        proc.send_signal(signal.SIGINT)
        asked = time.monotonic()
        output, _ = proc.communicate(timeout=60)
        took_s = time.monotonic() - asked
    assert proc.returncode == 0, output[-3000:]
    assert took_s < 10, f"{took_s:.1f} s from SIGINT to exit\n{output[-3000:]}"
    assert "stopped during learner step 2: its 1 groups were not trained" in output, output[-3000:]
    assert re.search(r"learner step 2: micro-batch 1 of 1 \(0 of [\d,]+ tokens done\), logprob chunk \d+ of \d+", output)
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*.pt")) == ["step_1.pt"]
    decisions = [json.loads(line) for line in (out / "groups.jsonl").read_text().splitlines()]
    assert [(d["step"], d["status"]) for d in decisions] == [(1, "trained"), (2, "interrupted")]
    print(f"SIGINT to exit: {took_s:.1f} s")
