"""Device check for a lent GPU: what only a GPU can show, in one short run.

The device machine has torch but no vLLM and no cargo: carry the built extension
(polar_fast/_native.abi3.so) and a venv with transformers, or the merge falls back to the Python
reference. Three checks on tiny random models and harness-shaped traces (bench/learner_bench.py):
  1. the learner bench on the device: per-call vs trie paths vs trie tree step time, and the
     layouts' losses, which must agree;
  2. FlexAttention (the CUDA default, a compiled BlockMask) against the SDPA-per-block reference:
     one GRPO step from the same weights on the same packed batch, loss, grad norm and importance
     ratio (the behaviour logprobs are the model's own fp32 ones, so the ratio starts at 1);
     skipped on CPU, where torch has no FlexAttention backward;
  3. bf16 autocast against fp32: the same step's loss, grad norm and importance ratio.
Each check prints its figures; a check that fails says why and the exit status is 1.

    python bench/gpu_check.py                      # --device cuda when one is visible
    python bench/gpu_check.py --device cpu --quick # the CPU smoke run the tests make

Last line: RESULT tree_vs_percall=X paths_vs_percall=Y flex_vs_sdpa_loss_diff=D flex_vs_sdpa_grad_rel=G
           bf16_vs_fp32_grad_rel=B bf16_vs_fp32_ratio_diff=R ok=1|0
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import sys
import time
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import learner_bench  # noqa: E402

from polar_fast.config import LearnerConfig  # noqa: E402
from polar_fast.grpo import Learner  # noqa: E402
from polar_fast.testing import groups_of  # noqa: E402

FLEX_LOSS_TOL = 1e-4  # fp32: the kernels differ only in summation order
FLEX_GRAD_TOL = 1e-3  # relative grad norm
BF16_TOL = 5e-2  # bf16 keeps ~3 significant digits per matmul


def _batch(quick: bool, vocab: int):
    size = dict(groups=1, rollouts=4, calls=4, prompt=300, completion=16, tool=32) if quick else \
        dict(groups=2, rollouts=4, calls=8, prompt=2000, completion=60, tool=120)
    return learner_bench.harness_traces(vocab=vocab, seed=3, **size)


def _own_logprobs(model, calls):
    """The calls with the model's own fp32 logprobs as behaviour logprobs (one plain forward per
    call), so the first step's importance ratio is 1 and any kernel's error shows in it."""
    out = []
    with torch.no_grad():
        for c in calls:
            ids = torch.tensor([list(c.prompt_ids) + list(c.completion_ids)])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            n = len(c.prompt_ids)
            picked = logp[n - 1:].gather(1, ids[0, n:, None])[:, 0]
            out.append(msgspec.structs.replace(c, completion_logprobs=picked.tolist()))
    return out


def _step(model, calls, rollouts, device: str, **learner_options) -> tuple[float, float, float, float]:
    """Loss, grad norm, mean importance ratio and seconds of one GRPO step from a fresh copy of `model`."""
    cfg = LearnerConfig(lr=1e-4, device=device, check_packed=False, **learner_options)
    learner = Learner(cfg, copy.deepcopy(model), layout="tree", max_tokens=8192,
                      merge_impl=learner_bench.merge_impl())
    started = time.perf_counter()
    metrics = learner.step(groups_of(calls, rollouts))
    learner_bench._sync(device)
    return metrics.loss, metrics.grad_norm, metrics.ratio_mean, time.perf_counter() - started


def check_flex(model, calls, rollouts, device: str) -> tuple[dict, str]:
    if device == "cpu":  # torch has FlexAttention's forward on CPU, not its backward
        print("skipped: FlexAttention has no backward on CPU; this check needs the device")
        return {"flex_vs_sdpa": "skipped_cpu"}, ""
    sdpa = _step(model, calls, rollouts, device, attention="sdpa")
    flex = _step(model, calls, rollouts, device, attention="flex_attention")
    loss_diff = abs(flex[0] - sdpa[0])
    grad_rel = abs(flex[1] - sdpa[1]) / max(abs(sdpa[1]), 1e-12)
    print(f"flex vs sdpa: loss {flex[0]:.6f} vs {sdpa[0]:.6f} (diff {loss_diff:.2e}), grad norm {flex[1]:.5f} vs "
          f"{sdpa[1]:.5f} (rel {grad_rel:.2e}), ratio mean {flex[2]:.6f} vs {sdpa[2]:.6f}, "
          f"step {flex[3]:.3f} s vs {sdpa[3]:.3f} s")
    error = ""
    if loss_diff > FLEX_LOSS_TOL or grad_rel > FLEX_GRAD_TOL or abs(flex[2] - sdpa[2]) > FLEX_LOSS_TOL:
        error = f"flex_attention disagrees with the SDPA reference beyond {FLEX_LOSS_TOL:g} / {FLEX_GRAD_TOL:g}"
    return {"flex_vs_sdpa_loss_diff": f"{loss_diff:.2e}", "flex_vs_sdpa_grad_rel": f"{grad_rel:.2e}"}, error


def check_bf16(model, calls, rollouts, device: str) -> tuple[dict, str]:
    fp32 = _step(model, calls, rollouts, device, attention="sdpa")
    bf16 = _step(model, calls, rollouts, device, attention="sdpa", dtype="bfloat16")
    # at ratio 1 the GRPO loss is ~0 (advantages sum to 0 in a group): compare it absolutely
    loss_diff = abs(bf16[0] - fp32[0])
    grad_rel = abs(bf16[1] - fp32[1]) / max(abs(fp32[1]), 1e-12)
    ratio_diff = abs(bf16[2] - fp32[2])
    print(f"bf16 vs fp32: loss {bf16[0]:.6f} vs {fp32[0]:.6f} (diff {loss_diff:.2e}), grad norm rel {grad_rel:.2e}, "
          f"ratio mean {bf16[2]:.6f} vs {fp32[2]:.6f} (fp32 behaviour logprobs), step {bf16[3]:.3f} s vs {fp32[3]:.3f} s")
    error = ""
    if max(loss_diff, grad_rel, ratio_diff) > BF16_TOL:
        error = f"bf16 is more than {BF16_TOL:g} off fp32 (loss, grad norm or importance ratio)"
    return {"bf16_vs_fp32_grad_rel": f"{grad_rel:.2e}", "bf16_vs_fp32_ratio_diff": f"{ratio_diff:.2e}"}, error


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="small traces (the CPU smoke run)")
    args = p.parse_args(argv)
    print(f"device {args.device}" + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
          + f", torch {torch.__version__}, merge {learner_bench.merge_impl()}")
    errors: list[str] = []

    print("\n== 1. learner bench")
    bench_args = ["--device", args.device, "--models", "tiny"] + (["--quick"] if args.quick else [])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = learner_bench.main(bench_args)
    lines = out.getvalue().splitlines()
    print("\n".join(line for line in lines if not line.startswith("RESULT ")))
    result: dict[str, str] = dict(kv.split("=", 1) for line in lines if line.startswith("RESULT ")
                                  for kv in line.split()[1:])
    if status != 0:
        errors.append("learner bench: the layouts disagree on the loss")

    vocab = 8000 if args.quick else 32000
    model = learner_bench.build_model("tiny", vocab, 128, 2 if args.quick else 4)
    calls, rollouts = _batch(args.quick, vocab)
    calls = _own_logprobs(model.float().eval(), calls)
    for title, check in (("2. FlexAttention vs SDPA", check_flex), ("3. bf16 vs fp32", check_bf16)):
        print(f"\n== {title}")
        values, error = check(model, calls, rollouts, args.device)
        result.update(values)
        if error:
            print(f"FAILED: {error}")
            errors.append(error)
    print(f"\n{len(errors)} check(s) failed" + "".join(f"\n  {e}" for e in errors) if errors else "\nall checks passed")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()) + f" ok={int(not errors)}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
