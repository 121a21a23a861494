"""Device check for a lent GPU: what only a GPU can show, in one short run.

The device machine has torch and Triton but no vLLM, no cargo, no msgspec and an older transformers:
carry wheels (bench/support/gpu_wheels.sh fetches them here: the project's transformers and
what it needs, msgspec, flash-linear-attention) and the built extension
(polar_fast/_native.abi3.so), or the merge falls back to the Python reference. Four checks, the
one at the paper's size first (it matters most and has the budget):
  1. the paper's size: a random-weight model in Qwen3.5-4B's published configuration
     (bench/support/paper_size.py: values written there, nothing downloaded), initialised on the
     device; GRPO steps in bf16 with FlexAttention, gradient checkpointing and
     flash-linear-attention's kernels for the Gated DeltaNet layers, on a harness-shaped group
     packed at 16k tokens per micro-batch. Reports, in this order, tokens per second (the anchor:
     prime-rl trains Qwen3-4B at ~3.4k tokens/s per H200 at 16k, trainer only), MFU, peak memory,
     the tree vs paths step time, and the mismatch between the bf16 learner and an fp32 forward of
     the same batch (SDPA per block: an fp32 FlexAttention forward took 381 s on the H200, compile
     included; the figures are a bf16 step's own, learner/mismatch.py). Without
     flash-linear-attention the scan falls back to transformers' torch reference (exact, slow) and
     the row says so; if the first step fails under FlexAttention, the row retries with SDPA per
     block and says so. --quick keeps the layer types and head ratios at a small width (the CPU
     smoke run);
  2. the learner bench on the device (tiny random models, harness-shaped traces,
     bench/learner_bench.py): per-call vs trie paths vs trie tree step time, and the layouts'
     losses, which must agree;
  3. FlexAttention (the CUDA default, a compiled BlockMask) against the SDPA-per-block reference:
     one GRPO step from the same weights on the same packed batch, loss, grad norm and importance
     ratio (the behaviour logprobs are the model's own fp32 ones, so the ratio starts at 1);
     skipped on CPU, where torch has no FlexAttention backward;
  4. bf16 autocast against fp32: the same step's loss, grad norm, importance ratio and mismatch.
Each figure prints as soon as it is measured; a check that fails says why and the exit status is
1. --budget-s bounds the run: the paper row skips its optional steps (a second timed step, the
paths layout) when they would not fit, and says so.

    python bench/gpu_check.py                      # --device cuda when one is visible
    python bench/gpu_check.py --device cpu --quick # the CPU smoke run the tests make

On the device (`run` with carry [".whl"], from the repository root; the whole call must fit
7 minutes, wheels included: the budget leaves the tiny checks and the install their share):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && \
    PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 bench/gpu_check.py --budget-s 300

Last line: RESULT paper_model=qwen3.5-4b|qwen3.5-small paper_fla=0|1 paper_attention=flex_attention|sdpa
           paper_mismatch_kl=K paper_mismatch_abs_max=A paper_tokens_per_s=T paper_mfu=M paper_peak_gib=P
           paper_tree_vs_paths=V tree_vs_percall=X paths_vs_percall=Y flex_vs_sdpa_loss_diff=D
           flex_vs_sdpa_grad_rel=G bf16_vs_fp32_grad_rel=B bf16_vs_fp32_ratio_diff=R ok=1|0
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import sys
import time
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import learner_bench  # noqa: E402
import paper_size  # noqa: E402

from polar_fast.config import LearnerConfig  # noqa: E402
from polar_fast.grpo import Learner, StepBatch, build_step_batch  # noqa: E402
from polar_fast.learner import packed_attention  # noqa: E402
from polar_fast.learner.packed_forward import FLEX_NAMES, batch_tensors  # noqa: E402
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


def _step(model, calls, rollouts, device: str, **learner_options) -> tuple[float, float, float, float, float]:
    """Loss, grad norm, mean importance ratio, seconds and mismatch KL of one GRPO step from a fresh
    copy of `model`. The ratio is against the behaviour logprobs (is_correction "none"), so a
    kernel's error shows in it."""
    cfg = LearnerConfig(lr=1e-4, device=device, check_packed=False, is_correction="none", **learner_options)
    learner = Learner(cfg, copy.deepcopy(model), layout="tree", max_tokens=8192,
                      merge_impl=learner_bench.merge_impl())
    started = time.perf_counter()
    m = learner.step(groups_of(calls, rollouts))
    learner_bench._sync(device)
    return m.loss, m.grad_norm, m.ratio_mean, time.perf_counter() - started, m.mismatch_kl


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
          f"ratio mean {bf16[2]:.6f} vs {fp32[2]:.6f} (fp32 behaviour logprobs), mismatch kl {bf16[4]:.2e} vs "
          f"{fp32[4]:.2e}, step {bf16[3]:.3f} s vs {fp32[3]:.3f} s")
    error = ""
    if max(loss_diff, grad_rel, ratio_diff) > BF16_TOL:
        error = f"bf16 is more than {BF16_TOL:g} off fp32 (loss, grad norm or importance ratio)"
    return {"bf16_vs_fp32_grad_rel": f"{grad_rel:.2e}", "bf16_vs_fp32_ratio_diff": f"{ratio_diff:.2e}"}, error


# ------------------------------------------------------------------------------ 1. the paper's size


def _paper_traces(quick: bool, vocab: int):
    """One group of four harness-shaped rollouts (one compacts midway), sized so the tree and
    paths layouts fill micro-batches of `_paper_tokens` (16k on the device)."""
    size = dict(groups=1, rollouts=4, calls=4, prompt=300, completion=24, tool=48) if quick else \
        dict(groups=1, rollouts=4, calls=8, prompt=2048, completion=256, tool=512)
    return learner_bench.harness_traces(vocab=vocab, seed=5, **size)


def _paper_tokens(quick: bool) -> int:
    return 1024 if quick else 16384


@torch.no_grad()
def _fp32_behaviour(learner: Learner, batch: StepBatch) -> StepBatch:
    """The batch with the learner's own fp32 logprobs (no autocast) as its behaviour logprobs: the
    next bf16 step's mismatch figures are then bf16 against fp32 on the same tokens."""
    learner.policy.eval()
    logps = [learner.policy(**batch_tensors(mb, t, learner.device), chunk_tokens=learner.cfg.logprob_chunk_tokens)
             .float().cpu().numpy() for mb, t in zip(batch.micro_batches, batch.terms)]
    return dataclasses.replace(batch, terms=[t._replace(behaviour_logp=lp) for t, lp in zip(batch.terms, logps)])


def _timed(learner: Learner, batch: StepBatch, device: str):
    """(StepMetrics, seconds, peak GiB) of one training step."""
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    learner_bench._sync(device)
    started = time.perf_counter()
    metrics = learner.train_step(batch)
    learner_bench._sync(device)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return metrics, time.perf_counter() - started, peak


def _sdpa_if_flex_fails(learner: Learner, what: str, run, values: dict):
    """run(), and if FlexAttention fails in it (at this head size, say), once more with SDPA per
    block, saying so."""
    try:
        return run()
    except Exception as e:  # noqa: BLE001 - any kernel failure: report it and try the reference
        if learner.policy.lm.config._attn_implementation not in FLEX_NAMES:
            raise
        print(f"the {what} failed under FlexAttention (head_dim {values['head_dim']}; {type(e).__name__}: "
              f"{str(e).splitlines()[0][:300]}); retrying with SDPA per block")
        learner.optimizer.zero_grad(set_to_none=True)
        learner.policy.lm.set_attn_implementation(packed_attention.NAME)
        return run()


def check_paper_size(device: str, quick: bool, deadline: float) -> tuple[dict, str]:
    import transformers

    knows = hasattr(transformers, "Qwen3_5ForCausalLM")
    print(f"transformers {transformers.__version__} {'knows' if knows else 'does not know'} Qwen3.5")
    if not knows:
        return {"paper": "skipped_no_qwen35"}, (f"transformers {transformers.__version__} has no Qwen3_5ForCausalLM: "
                                                "carry the project's version (bench/support/gpu_wheels.sh)")
    values = paper_size.small() if quick else paper_size.QWEN35_4B
    name = "qwen3.5-small" if quick else "qwen3.5-4b"
    fla = paper_size.fla_version()
    started = time.perf_counter()
    model = paper_size.build(values, device)
    learner_bench._sync(device)
    total, non_embedding = paper_size.parameters(model)
    print(f"model {name}: {total / 1e9:.3f}B parameters ({non_embedding / 1e9:.3f}B outside the embedding), random, "
          f"initialised on {device} in {time.perf_counter() - started:.1f} s")
    result = {"paper_model": name, "paper_fla": str(int(fla is not None))}
    cfg = LearnerConfig(lr=1e-6, device=device, dtype="bfloat16", gradient_checkpointing=True, check_packed=False,
                        attention="flex_attention" if device == "cuda" else "sdpa")
    learner = Learner(cfg, model, layout="tree", max_tokens=_paper_tokens(quick), merge_impl=learner_bench.merge_impl())
    scan = paper_size.scan_kernel()
    print(f"Gated DeltaNet scan: {scan}" + (f" (flash-linear-attention {fla})" if fla and "fla" in scan else
          f"; flash-linear-attention {'not installed' if fla is None else fla + ' installed but unused'}: the torch "
          "reference kernels run (exact, slow), so this row's speed is not a run's with fla"))
    calls, rollouts = _paper_traces(quick, values["vocab_size"])
    groups = groups_of(calls, rollouts)
    batches = {layout: build_step_batch(groups, cfg, layout=layout, max_tokens=_paper_tokens(quick),
                                        merge_impl=learner_bench.merge_impl()) for layout in ("tree", "paths")}
    call_tokens = sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
    for layout, b in batches.items():
        sizes = [len(mb.tokens) for mb in b.micro_batches]
        print(f"{layout}: {b.n_tokens} tokens in {len(sizes)} micro-batches (largest {max(sizes)}, budget "
              f"{_paper_tokens(quick)}), {b.n_terms} sampled tokens; per-call would forward {call_tokens}")
    tree = batches["tree"]
    first, first_s, peak = _sdpa_if_flex_fails(learner, "first bf16 step", lambda: _timed(learner, tree, device),
                                               values)
    attention = learner.policy.lm.config._attn_implementation
    result["paper_attention"] = "flex_attention" if attention in FLEX_NAMES else "sdpa"
    print(f"first bf16 step (tree, {attention}, kernels compiling): {first_s:.1f} s" + _gib(peak))
    step_s = {"tree": first_s}
    if time.perf_counter() + 1.5 * first_s < deadline:
        _, step_s["tree"], peak = _timed(learner, tree, device)
        print(f"tree step: {step_s['tree']:.2f} s" + _gib(peak))
    else:
        print("skipped: a second tree step (budget); the figures below use the first, compile included")
    _report_speed(result, tree, step_s["tree"], peak, values, non_embedding, call_tokens, device)
    if time.perf_counter() + 3 * step_s["tree"] < deadline:
        _timed(learner, batches["paths"], device)  # warm-up: new shapes compile
        _, step_s["paths"], _ = _timed(learner, batches["paths"], device)
        print(f"paths step: {step_s['paths']:.2f} s ({batches['paths'].n_tokens} tokens); tree vs paths "
              f"{step_s['paths'] / step_s['tree']:.2f}x")
        result["paper_tree_vs_paths"] = f"{step_s['paths'] / step_s['tree']:.2f}"
    else:
        print("skipped: the paths layout (budget)")
    if time.perf_counter() + 4 * step_s["tree"] < deadline:
        result |= _mismatch(learner, tree, device)
    else:
        print("skipped: the mismatch against an fp32 forward (budget)")
    error = "" if first.grad_norm == first.grad_norm and abs(first.loss) < 1e3 else \
        f"the first bf16 step is not finite (loss {first.loss}, grad norm {first.grad_norm})"
    return result, error


def _mismatch(learner: Learner, batch: StepBatch, device: str) -> dict[str, str]:
    """The bf16 learner against an fp32 forward of the same batch: the fp32 logprobs become the
    behaviour logprobs and a bf16 step reports its mismatch figures. The fp32 forward runs SDPA per
    block (an fp32 FlexAttention compile at head_dim 256 took minutes on the H200), as an engine
    runs its own kernels; its Gated DeltaNet scan is the learner's."""
    attention = learner.policy.lm.config._attn_implementation
    started = time.perf_counter()
    try:
        learner.policy.lm.set_attn_implementation(packed_attention.NAME)
        reference = _fp32_behaviour(learner, batch)
        learner_bench._sync(device)
    except Exception as e:  # noqa: BLE001 - the row's other figures stand; say what failed
        print(f"FAILED: the fp32 forward ({type(e).__name__}: {str(e).splitlines()[0][:300]})")
        return {"paper_mismatch": "failed"}
    finally:
        learner.policy.lm.set_attn_implementation(attention)
    print(f"fp32 forward of the tree batch (SDPA per block): {time.perf_counter() - started:.1f} s")
    m, _, _ = _timed(learner, reference, device)
    print(f"mismatch, bf16 learner vs fp32 forward of the same batch: kl {m.mismatch_kl:.3e}, mean |delta| "
          f"{m.mismatch_abs_mean:.3e}, max |delta| {m.mismatch_abs_max:.3e}, outside the clip band "
          f"{100 * m.mismatch_out_of_clip:.2f}% of {m.n_terms} tokens")
    return {"paper_mismatch_kl": f"{m.mismatch_kl:.2e}", "paper_mismatch_abs_max": f"{m.mismatch_abs_max:.2e}"}


def _gib(peak: float) -> str:
    return f", peak memory {peak:.1f} GiB" if peak == peak else ""  # nan off CUDA


def _report_speed(result: dict, batch: StepBatch, step_s: float, peak: float, values: dict, non_embedding: int,
                  call_tokens: int, device: str) -> None:
    flops = paper_size.step_flops(batch, values, non_embedding)
    rate = batch.n_tokens / step_s
    peak_flops = paper_size.peak_flops(torch.cuda.get_device_name()) if device == "cuda" else None
    mfu = flops / step_s / peak_flops if peak_flops else float("nan")
    print(f"tree: {rate:,.0f} tokens/s forwarded ({call_tokens / step_s:,.0f} per-call tokens/s covered; prime-rl's "
          f"anchor: ~3,400 tokens/s per H200 at 16k), {flops / step_s / 1e12:.3g} TFLOP/s, MFU "
          + (f"{100 * mfu:.1f}% of {peak_flops / 1e12:.0f} TFLOP/s bf16" if peak_flops else "n/a on this device")
          + _gib(peak))
    result |= {"paper_tokens_per_s": f"{rate:.0f}", "paper_mfu": f"{mfu:.3f}", "paper_peak_gib": f"{peak:.1f}"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="small traces (the CPU smoke run)")
    p.add_argument("--budget-s", type=float, default=360.0, help="the paper row skips optional steps past this")
    p.add_argument("--only", choices=["all", "paper", "tiny"], default="all", help="check 1, checks 2-4, or all")
    args = p.parse_args(argv)
    deadline = time.perf_counter() + args.budget_s
    if args.quick and args.device == "cpu":
        torch.set_num_threads(1)  # as learner_bench --quick: on a shared 2-core box OpenMP spin-waits dominate
    print(f"device {args.device}" + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "")
          + f", torch {torch.__version__}, merge {learner_bench.merge_impl()}")
    errors: list[str] = []
    result: dict[str, str] = {}
    if args.only in ("all", "paper"):
        print("\n== 1. the paper's size: Qwen3.5-4B's configuration, random weights" + (" (small: --quick)" if args.quick else ""))
        try:
            values, error = check_paper_size(args.device, args.quick, deadline)
        except Exception as e:  # noqa: BLE001 - report the row's failure with the rest of the run's figures
            values, error = {"paper": "failed"}, f"the paper-size row failed: {type(e).__name__}: {str(e)[:500]}"
        result.update(values)
        if error:
            print(f"FAILED: {error}")
            errors.append(error)
        if args.device == "cuda":
            torch.cuda.empty_cache()  # the 4B model, its gradients and optimizer state are gone
    if args.only in ("all", "tiny"):
        result |= _tiny_checks(args, errors)
    print(f"\n{len(errors)} check(s) failed" + "".join(f"\n  {e}" for e in errors) if errors else "\nall checks passed")
    print("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()) + f" ok={int(not errors)}")
    return 1 if errors else 0


def _tiny_checks(args: argparse.Namespace, errors: list[str]) -> dict[str, str]:
    """Checks 2-4 on tiny random models; their RESULT values."""
    print("\n== 2. learner bench")
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
    for title, check in (("3. FlexAttention vs SDPA", check_flex), ("4. bf16 vs fp32", check_bf16)):
        print(f"\n== {title}")
        values, error = check(model, calls, rollouts, args.device)
        result.update(values)
        if error:
            print(f"FAILED: {error}")
            errors.append(error)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
