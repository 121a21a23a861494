"""bench/gpu_check.py, the prepared device check, runs its CPU smoke path here: the learner bench,
FlexAttention skipped (no CPU backward), bf16 against fp32 from behaviour logprobs the learner
must reproduce (fp32 importance ratio 1)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpu_check_cpu_smoke_run(capsys):
    import gpu_check

    assert gpu_check.main(["--device", "cpu", "--quick"]) == 0
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert last.startswith("RESULT ")
    result = dict(kv.split("=", 1) for kv in last.split()[1:])
    assert {"tree_vs_percall", "paths_vs_percall", "bf16_vs_fp32_grad_rel", "bf16_vs_fp32_ratio_diff"} <= set(result)
    assert result["flex_vs_sdpa"] == "skipped_cpu" and result["ok"] == "1"
    # the fp32 step reproduces the behaviour logprobs it was given: ratio 1 to 6 places
    fp32_ratio = re.search(r"ratio mean [0-9.]+ vs ([0-9.]+) \(fp32", out).group(1)
    assert float(fp32_ratio) == pytest.approx(1.0, abs=1e-6)
    assert float(result["bf16_vs_fp32_ratio_diff"]) < gpu_check.BF16_TOL
