"""bench/gpu_check.py, the prepared device check, runs its CPU smoke path here: the learner bench,
FlexAttention skipped (no CPU backward), bf16 against fp32 from behaviour logprobs the learner
must reproduce (fp32 importance ratio 1), and the paper-size row with Qwen3.5-4B's layer types
at a small width (the torch Gated DeltaNet kernels, said so)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "support"))


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
    # the paper-size row: every figure, the fallback without flash-linear-attention said out loud
    assert result["paper_model"] == "qwen3.5-small" and result["paper_fla"] == "0"
    assert result["paper_attention"] == "sdpa"
    assert float(result["paper_tokens_per_s"]) > 0 and float(result["paper_tree_vs_paths"]) > 0
    assert 0 < float(result["paper_mismatch_kl"]) < 1e-3 and float(result["paper_mismatch_abs_max"]) < 0.1
    assert "flash-linear-attention not installed: the torch reference kernels run" in out
    assert re.search(r"mismatch, bf16 learner vs fp32 forward of the same batch: kl [0-9.e-]+", out)
    assert "tree: " in out and "micro-batches (largest" in out


def test_paper_size_holds_the_published_configuration():
    import paper_size

    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**paper_size.QWEN35_4B)
    assert cfg.layer_types.count("full_attention") == 8 and cfg.layer_types[3::4] == ["full_attention"] * 8
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings) == (2560, 9216, 248320, True)
    model = paper_size.build(paper_size.QWEN35_4B, "meta")
    total, non_embedding = paper_size.parameters(model)
    assert (total, non_embedding) == (4_205_751_296, 3_570_052_096)  # the 4B's text model, tied head once
    small = paper_size.small()
    assert small["layer_types"] == paper_size.QWEN35_4B["layer_types"][:4]
    assert small["linear_num_value_heads"] == 2 * small["linear_num_key_heads"]  # the 4B's ratio
