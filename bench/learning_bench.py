"""Does the policy get better inside a real harness? The paper's before/after table at CPU scale.

    python bench/learning_bench.py [--config run.toml] [--heldout 0] [--samples 1] [--rl-steps 2]
                                   [--out runs/learning_bench] [--quick]

It runs the default setup (run.toml: its task families, warm start and GRPO settings), all
through the real stack (mini-swe-agent CLI, local sandboxes, the capture proxy):
1. the run's warm start (warm_start.py): teacher demonstrations of the "demos" split typed by a
   scripted policy through the harness, exported as token rows, `sft` on them; cached, so a
   default run made before reuses it (the report says so);
2. held-out pass@1 of the base model and of the warm-started one (the embedded engine, the run's
   [sampling]);
3. `--rl-steps` GRPO steps from the warm-started model on the train split, and held-out pass@1
   after.

The pass@1 change (base -> the last policy) comes with a paired bootstrap 95% interval over the
held-out tasks. The last line is `RESULT eval_before=... eval_after=... eval_delta_lo=...
eval_delta_hi=... reward_first=... reward_last=... eval_sft=...`.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_fast.config import load_config  # noqa: E402
from polar_fast.evaluate import format_report, run_eval  # noqa: E402
from polar_fast.warm_start import ensure_warm_start  # noqa: E402


def paired_bootstrap(before: list[float], after: list[float], *, draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% interval of mean(after - before), resampling tasks with replacement."""
    diffs = [a - b for a, b in zip(after, before)]
    if not diffs:
        return 0.0, 0.0
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(diffs) for _ in diffs) / len(diffs) for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def per_task_pass1(report) -> dict[str, float]:
    [h] = report.harnesses
    return {t.task_id: (t.pass_at["1"] or 0.0) for t in h.per_task}


async def main(args) -> None:
    overrides = ["eval.every_steps=0", "eval.at_start=false"]
    if args.demos:
        overrides.append(f"warm_start.demos={args.demos}")
    cfg = load_config(args.config, overrides)
    if not cfg.warm_start.demos:
        raise SystemExit("the config has no warm start (warm_start.demos = 0): pass --demos N")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: pass another --out")
    timings = {}

    # 1. warm start (teacher demonstrations -> export -> sft), cached by content
    t0 = time.perf_counter()
    warm_dir, warm = await ensure_warm_start(cfg, lambda kind, d: print(d["message"], flush=True))
    timings["warm_start_s"] = time.perf_counter() - t0
    print(f"warm start{' (cached: built earlier in ' + str(warm['duration_s']) + ' s)' if warm['cached'] else ''}: "
          f"{warm['demos_kept']}/{warm['demos']} demonstrations kept, {warm['rows']} rows, "
          f"{warm['trained_tokens']} trained tokens, sft nll (epoch mean) {warm['nll_before']:.4f} -> "
          f"{warm['nll_after']:.4f}")

    # 2. held-out eval: base and warm-started
    evals = {}
    for name, checkpoint in (("base", ""), ("sft", str(warm_dir))):
        t0 = time.perf_counter()
        evals[name] = await run_eval(cfg, split="heldout", limit=args.heldout, samples=args.samples, ks=[1],
                                     checkpoint=checkpoint, run_dir=out / f"eval_{name}")
        timings[f"eval_{name}_s"] = time.perf_counter() - t0
        print(f"== {name}")
        print(format_report(evals[name]), flush=True)

    # 3. GRPO from the warm-started model (train() applies the same, cached, warm start)
    reward_first = reward_last = float("nan")
    if args.rl_steps:
        from polar_fast.train import train

        rl_cfg = load_config(args.config, overrides + [f"run.output_dir={out / 'rl'}", f"run.steps={args.rl_steps}"])
        t0 = time.perf_counter()
        summary = await train(rl_cfg)
        timings["rl_s"] = time.perf_counter() - t0
        rewards = [s.get("reward/mean", float("nan")) for s in summary.steps]
        reward_first, reward_last = rewards[0], rewards[-1]
        print("reward per step: " + ", ".join(f"{r:.3f}" for r in rewards))
        print("forwarded tokens per step: " + ", ".join(f"{s.get('merge/tokens_forwarded', 0):.0f}"
                                                         for s in summary.steps))
        t0 = time.perf_counter()
        evals["rl"] = await run_eval(cfg, split="heldout", limit=args.heldout, samples=args.samples, ks=[1],
                                     checkpoint=str(out / "rl" / "checkpoints"), run_dir=out / "eval_rl")
        timings["eval_rl_s"] = time.perf_counter() - t0
        print("== rl")
        print(format_report(evals["rl"]), flush=True)

    base = per_task_pass1(evals["base"])
    last_name = "rl" if "rl" in evals else "sft"
    last = per_task_pass1(evals[last_name])
    ids = sorted(base)
    before, after = [base[i] for i in ids], [last.get(i, 0.0) for i in ids]
    lo, hi = paired_bootstrap(before, after)
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    sft_mean = mean(list(per_task_pass1(evals["sft"]).values()))
    print()
    print(f"{'policy':<8}{'held-out pass@1':>16}{'tasks':>7}")
    for name, report in evals.items():
        vals = list(per_task_pass1(report).values())
        print(f"{name:<8}{100 * mean(vals):>15.1f}%{len(vals):>7}")
    print(f"pass@1 change base -> {last_name}: {100 * (mean(after) - mean(before)):+.1f} points, "
          f"95% paired bootstrap over tasks [{100 * lo:+.1f}, {100 * hi:+.1f}]")
    print("timings: " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))
    print(f"RESULT eval_before={mean(before):.4f} eval_after={mean(after):.4f} eval_delta_lo={lo:.4f} "
          f"eval_delta_hi={hi:.4f} reward_first={reward_first:.4f} reward_last={reward_last:.4f} "
          f"eval_sft={sft_mean:.4f}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "run.toml"),
                   help="the run's config (default: the repo's run.toml, the default run)")
    p.add_argument("--out", default="runs/learning_bench")
    p.add_argument("--demos", type=int, default=0, help="teacher demonstrations per family (0 = the config's)")
    p.add_argument("--heldout", type=int, default=0, help="held-out tasks evaluated (0 = all of the run's families)")
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--rl-steps", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 demo per family, 2 held-out tasks, no RL")
    args = p.parse_args(argv)
    if args.quick:
        args.demos, args.heldout, args.rl_steps = 1, 2, 0
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
