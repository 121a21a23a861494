"""Does the policy get better inside a real harness? The paper's before/after table at CPU scale.

    python bench/learning_bench.py [--config run.toml] [--demos 8] [--heldout 8] [--samples 1]
                                   [--rl-steps 2] [--out runs/learning_bench] [--quick]

Phases, all through the real stack (mini-swe-agent CLI, local sandboxes, the capture proxy):
1. teacher demonstrations: the train split's tasks solved by a scripted policy (PlaybookEngine)
   typing each task's one-line fix, captured by the proxy like any rollout;
2. `export` of the test-verified demonstrations as token rows, and `sft` on them;
3. held-out pass@1 of the base model and of the fine-tuned one (the embedded engine, the run's
   [sampling]);
4. optionally `--rl-steps` GRPO steps from the fine-tuned model, and held-out pass@1 after.

The pass@1 change comes with a paired bootstrap 95% interval over the held-out tasks. The last
line is `RESULT eval_before=... eval_after=... eval_delta_lo=... eval_delta_hi=...
reward_first=... reward_last=... eval_sft=...` (eval_after is the last policy evaluated).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_fast.config import load_config  # noqa: E402
from polar_fast.engines.scripted import PlaybookEngine  # noqa: E402
from polar_fast.evaluate import format_report, run_eval  # noqa: E402
from polar_fast.export import export_run  # noqa: E402
from polar_fast.learner.sft import run_sft  # noqa: E402
from polar_fast.model import load_tokenizer  # noqa: E402
from polar_fast.rollouts.tasks import load_tasks  # noqa: E402

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def bash_call(command: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": command}}) + "\n</tool_call>"


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
    overrides = ["tasks.source=families", f"sampling.max_tokens={args.max_tokens}",
                 f"harness.max_steps={args.max_steps}", "harness.name=mini-swe-agent", "sandbox.kind=local"]
    cfg = load_config(args.config, overrides)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: pass another --out")
    timings = {}

    # 1. teacher demonstrations
    t0 = time.perf_counter()
    train_tasks = await asyncio.to_thread(load_tasks, "families", split="train", limit=args.demos,
                                          per_family=max(1, args.demos))
    tok = await asyncio.to_thread(load_tokenizer, cfg.model.path)
    plays = {t.problem_statement: [[bash_call(t.solution_command), bash_call(SUBMIT)]] for t in train_tasks}
    demo_cfg = msgspec.structs.replace(cfg, tasks=msgspec.structs.replace(cfg.tasks, per_family=max(1, args.demos)))
    demos = await run_eval(demo_cfg, split="train", limit=args.demos, samples=1, ks=[1], run_dir=out / "demos",
                           engine_for=lambda c: PlaybookEngine(plays, tok))
    [dh] = demos.harnesses
    export = await asyncio.to_thread(export_run, out / "demos" / "mini-swe-agent", out / "sft_data", min_reward=1.0)
    timings["demos_s"] = time.perf_counter() - t0
    print(f"teacher demonstrations: {dh.per_task and sum(t.passed for t in dh.per_task)}/{len(train_tasks)} solved")
    print(export)

    # 2. sft
    t0 = time.perf_counter()
    sft = await asyncio.to_thread(run_sft, cfg, out / "sft_data", out_dir=out / "sft_model", epochs=args.epochs,
                                  lr=args.sft_lr, emit=lambda k, d: print(d["message"], flush=True))
    timings["sft_s"] = time.perf_counter() - t0
    print(f"sft: {sft.rows} rows, {sft.trained_tokens} trained tokens, nll {sft.nll_before:.4f} -> {sft.nll_after:.4f}")

    # 3. held-out eval: base and fine-tuned
    evals = {}
    for name, checkpoint in (("base", ""), ("sft", str(out / "sft_model"))):
        t0 = time.perf_counter()
        evals[name] = await run_eval(cfg, split="heldout", limit=args.heldout, samples=args.samples, ks=[1],
                                     checkpoint=checkpoint, run_dir=out / f"eval_{name}")
        timings[f"eval_{name}_s"] = time.perf_counter() - t0
        print(f"== {name}")
        print(format_report(evals[name]))

    # 4. GRPO from the fine-tuned model
    reward_first = reward_last = float("nan")
    if args.rl_steps:
        from polar_fast.train import train

        rl_cfg = load_config(args.config, overrides + [
            f"model.path={out / 'sft_model'}", f"run.output_dir={out / 'rl'}", f"run.steps={args.rl_steps}",
            f"learner.lr={args.rl_lr}"])
        t0 = time.perf_counter()
        summary = await train(rl_cfg)
        timings["rl_s"] = time.perf_counter() - t0
        rewards = [s.get("reward/mean", float("nan")) for s in summary.steps]
        reward_first, reward_last = rewards[0], rewards[-1]
        print("reward per step: " + ", ".join(f"{r:.3f}" for r in rewards))
        evals["rl"] = await run_eval(cfg, split="heldout", limit=args.heldout, samples=args.samples, ks=[1],
                                     checkpoint=str(out / "rl" / "checkpoints"), run_dir=out / "eval_rl")
        print("== rl")
        print(format_report(evals["rl"]))

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
    p.add_argument("--config", default=None, help="run.toml (default: built-in defaults)")
    p.add_argument("--out", default="runs/learning_bench")
    p.add_argument("--demos", type=int, default=8, help="teacher demonstrations (train tasks)")
    p.add_argument("--heldout", type=int, default=8, help="held-out tasks evaluated (0 = all 24)")
    p.add_argument("--samples", type=int, default=1)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--sft-lr", type=float, default=5e-5)
    p.add_argument("--rl-steps", type=int, default=0)
    p.add_argument("--rl-lr", type=float, default=1e-6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--max-steps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smoke run: 2 demos, 2 held-out tasks, 1 epoch")
    args = p.parse_args(argv)
    if args.quick:
        args.demos, args.heldout, args.epochs, args.rl_steps = 2, 2, 1, 0
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
