"""Does RL itself make the policy better inside a real harness? The paper's table at CPU scale.

    python bench/learning_bench.py [--config run.toml] [--harnesses mini-swe-agent,pi] [--rl-steps 12]
                                   [--samples 4] [--out runs/learning_bench] [--budget-min 300]
                                   [--set section.key=value ...] [--tune] [--quick]

Per harness, all through the real stack (the harness CLI, local sandboxes, the capture proxy, the
embedded engine with the run's [sampling]):
1. base: the model as shipped, on the held-out and transfer splits (1 sample per task: it never
   writes a tool call the harness can read);
2. warm: the run's warm start (warm_start.py: a careful teacher's demonstrations through this
   harness, then sft), `--samples` per task;
3. rl: `--rl-steps` GRPO steps from the warm start on the train split (train.py, the run's
   settings), then the same evaluation;
4. the cross-harness matrix: each harness's RL policy evaluated in every other harness too.

Held-out tasks are the trainable families' frozen held-out seeds; transfer tasks come from two
families that no demonstration, training step or tuning run ever saw (rollouts/families.py), with
names and numbers from a vocabulary the train side never uses. `--tune` evaluates on the
validation split instead (what every setting was chosen on), never on held-out or transfer.

The warm -> rl change on held-out comes with a 95% paired bootstrap interval over tasks (each
task's pass@1 is its mean over samples); every pass@1 with a bootstrap interval over tasks.

Stages are cached under --out (a JSON file per stage; GRPO resumes from its checkpoints), so a
stopped run continues where it stopped; `--budget-min` stops before a stage that would not fit,
from per-rollout and per-step estimates printed up front (`--sec-per-rollout`, `--sec-per-step`).

Last line: `RESULT <h>_base=.. <h>_warm=.. <h>_rl=.. <h>_rl_delta_lo=.. <h>_rl_delta_hi=..
<h>_transfer_base=.. <h>_transfer_warm=.. <h>_transfer_rl=.. ... matrix_<train>_on_<eval>=..`
(held-out pass@1 unless named transfer; harness names with `-` written with `_`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Awaitable, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_fast.config import Config, load_config  # noqa: E402
from polar_fast.evaluate import eval_tasks, format_report, run_eval  # noqa: E402


def paired_bootstrap(before: list[float], after: list[float], *, draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% interval of mean(after - before), resampling tasks with replacement."""
    diffs = [a - b for a, b in zip(after, before)]
    return bootstrap(diffs, draws=draws, seed=seed)


def bootstrap(values: list[float], *, draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% interval of mean(values), resampling them with replacement."""
    if not values:
        return 0.0, 0.0
    rng = random.Random(seed)
    means = sorted(sum(rng.choice(values) for _ in values) / len(values) for _ in range(draws))
    return means[int(0.025 * draws)], means[int(0.975 * draws) - 1]


def per_task(report: dict, harness: str) -> dict[str, float]:
    """task id -> the share of its scored samples that passed (its pass@1)."""
    [h] = [h for h in report["harnesses"] if h["harness"] == harness]
    return {t["task_id"]: t["passed"] / t["scored"] for t in h["per_task"] if t["scored"]}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def key(harness: str) -> str:
    return harness.replace("-", "_")


class Stages:
    """Each stage's result as JSON under `root`: computed once, then read back (resumable)."""

    def __init__(self, root: Path, budget_s: float, started: float) -> None:
        self.root, self.budget_s, self.started = root, budget_s, started
        self.timings: dict[str, float] = {}

    async def get(self, name: str, estimate_s: float, compute: Callable[[], Awaitable[dict]]) -> dict:
        path = self.root / f"{name}.json"
        if await asyncio.to_thread(path.is_file):
            return json.loads(await asyncio.to_thread(path.read_text))
        spent = time.monotonic() - self.started
        if self.budget_s and spent + estimate_s > self.budget_s:
            raise SystemExit(f"budget: stage {name} (~{estimate_s / 60:.0f} min) would pass the {self.budget_s / 60:.0f}-min "
                             f"budget after {spent / 60:.0f} min; rerun with the same --out to continue from here")
        print(f"== stage {name} (~{estimate_s / 60:.0f} min)", flush=True)
        t0 = time.monotonic()
        result = await compute()
        self.timings[name] = time.monotonic() - t0
        await asyncio.to_thread(self._write, path, {**result, "duration_s": self.timings[name]})
        return result

    @staticmethod
    def _write(path: Path, result: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(path)  # a stage is on disk whole or not at all


async def evaluate(cfg: Config, harness: str, split: str, samples: int, checkpoint: str, run_dir: Path) -> dict:
    import msgspec

    report = await run_eval(cfg, harnesses=[harness], split=split, samples=samples, ks=[1], checkpoint=checkpoint,
                            run_dir=run_dir)
    print(format_report(report), flush=True)
    return msgspec.to_builtins(report)


async def run_harness(h: str, cfg: Config, args, stages: Stages, out: Path) -> dict:
    from polar_fast.train import train
    from polar_fast.warm_start import ensure_warm_start

    splits = ["validation"] if args.tune else ["heldout", "transfer"]
    n_tasks = {s: len(eval_tasks(cfg, s, 0)) for s in splits}
    per_rollout = args.sec_per_rollout

    async def warm() -> dict:
        path, report = await ensure_warm_start(cfg, lambda kind, d: print(d.get("message", d), flush=True))
        return {"path": str(path), **report}

    warm_info = await stages.get(f"{h}/warm_start", 600, warm)
    policies = {"base": ("", 1), "warm": (warm_info["path"], args.samples)}
    results: dict[str, dict] = {}
    for policy, (checkpoint, samples) in policies.items():
        for split in splits:
            results[f"{policy}:{split}"] = await stages.get(
                f"{h}/{policy}_{split}", n_tasks[split] * samples * per_rollout,
                lambda p=policy, c=checkpoint, s=samples, sp=split: evaluate(cfg, h, sp, s, c, out / h / f"eval_{p}_{sp}"))

    rl_dir = out / h / "rl"

    async def rl() -> dict:
        rl_cfg = load_config(args.config, [*args.overrides, f"harness.name={h}", f"run.output_dir={rl_dir}",
                                           f"run.steps={args.rl_steps}", "eval.every_steps=0", "eval.at_start=false"])
        resume = (rl_dir / "checkpoints").exists() or (rl_dir / "records.log").exists()
        summary = await train(rl_cfg, resume=resume)
        return {"steps": summary.steps, "groups_trained": summary.groups_trained, "checkpoint": summary.checkpoint,
                "outcomes": summary.outcomes, "causes": summary.causes}

    rl_info = await stages.get(f"{h}/rl", args.rl_steps * args.sec_per_step, rl)
    for split in splits:
        results[f"rl:{split}"] = await stages.get(
            f"{h}/rl_{split}", n_tasks[split] * args.samples * per_rollout,
            lambda sp=split: evaluate(cfg, h, sp, args.samples, str(rl_dir / "checkpoints"), out / h / f"eval_rl_{sp}"))
    return {"results": results, "rl": rl_info, "warm": warm_info, "checkpoint": str(rl_dir / "checkpoints")}


async def main(args) -> None:
    out = Path(args.out)
    started = time.monotonic()
    harnesses = args.harnesses.split(",")
    base_overrides = ["eval.every_steps=0", "eval.at_start=false", *args.overrides]
    cfgs = {h: load_config(args.config, [*base_overrides, f"harness.name={h}"]) for h in harnesses}
    if not all(c.warm_start.demos for c in cfgs.values()):
        raise SystemExit("the config has no warm start (warm_start.demos = 0): pass --set warm_start.demos=N")
    splits = ["validation"] if args.tune else ["heldout", "transfer"]
    print(f"learning bench: harnesses {', '.join(harnesses)}; splits {', '.join(splits)}; {args.samples} samples per "
          f"task (base: 1); {args.rl_steps} GRPO steps; out {out}")

    any_cfg = next(iter(cfgs.values()))
    rollouts = sum(len(eval_tasks(any_cfg, s, 0)) for s in splits) * (1 + 2 * args.samples) * len(harnesses)
    matrix = 0 if args.tune else len(eval_tasks(any_cfg, "heldout", 0)) * args.samples * len(harnesses) * (len(harnesses) - 1)
    estimate = (rollouts + matrix) * args.sec_per_rollout + len(harnesses) * (args.rl_steps * args.sec_per_step + 600)
    print(f"budget: ~{estimate / 60:.0f} min estimated ({rollouts + matrix} eval rollouts at ~{args.sec_per_rollout:g} s, "
          f"{len(harnesses) * args.rl_steps} GRPO steps at ~{args.sec_per_step:g} s, warm starts); "
          f"limit {args.budget_min or 'none'} min; stages cached in {out}", flush=True)
    stages = Stages(out, args.budget_min * 60, started)
    done = {}
    for h in harnesses:
        done[h] = await run_harness(h, cfgs[h], args, stages, out)
    cells = {}
    if not args.tune:
        for trained in harnesses:
            for other in harnesses:
                if other == trained:
                    cells[(trained, other)] = done[trained]["results"]["rl:heldout"]
                    continue
                n = len(eval_tasks(cfgs[other], "heldout", 0)) * args.samples
                cells[(trained, other)] = await stages.get(
                    f"matrix/{trained}_on_{other}", n * args.sec_per_rollout,
                    lambda t=trained, o=other: evaluate(cfgs[o], o, "heldout", args.samples, done[t]["checkpoint"],
                                                        out / "matrix" / f"{t}_on_{o}"))
    print_summary(harnesses, done, cells, splits, stages)


def print_summary(harnesses, done, cells, splits, stages) -> None:
    result: dict[str, float] = {}
    for h in harnesses:
        r = done[h]["results"]
        print(f"\n{h}: pass@1 (95% bootstrap interval over tasks)")
        print(f"| policy | {' | '.join(splits)} |")
        print("| --- |" + " ---: |" * len(splits))
        for policy in ("base", "warm", "rl"):
            row = []
            for split in splits:
                scores = per_task(r[f"{policy}:{split}"], h)
                lo, hi = bootstrap(list(scores.values()))
                row.append(f"{100 * mean(scores.values()):.1f}% [{100 * lo:.0f}, {100 * hi:.0f}]")
                name = f"{key(h)}_{policy}" if split in ("heldout", "validation") else f"{key(h)}_{split}_{policy}"
                result[name] = mean(scores.values())
            print(f"| {policy} | {' | '.join(row)} |")
        first = splits[0]
        warm, rl = per_task(r[f"warm:{first}"], h), per_task(r[f"rl:{first}"], h)
        ids = sorted(set(warm) & set(rl))
        lo, hi = paired_bootstrap([warm[i] for i in ids], [rl[i] for i in ids])
        delta = mean(rl[i] for i in ids) - mean(warm[i] for i in ids)
        print(f"warm -> rl on {first}: {100 * delta:+.1f} points, 95% paired bootstrap over {len(ids)} tasks "
              f"[{100 * lo:+.1f}, {100 * hi:+.1f}]")
        rewards = [s.get("reward/mean", float("nan")) for s in done[h]["rl"]["steps"]]
        print("GRPO reward per step: " + ", ".join(f"{x:.2f}" for x in rewards))
        result[f"{key(h)}_rl_delta_lo"], result[f"{key(h)}_rl_delta_hi"] = lo, hi
    if cells:
        print("\ncross-harness matrix: held-out pass@1 of each harness's RL policy in every harness")
        print("| trained in \\ evaluated in | " + " | ".join(harnesses) + " |")
        print("| --- |" + " ---: |" * len(harnesses))
        for t in harnesses:
            row = []
            for o in harnesses:
                scores = per_task(cells[(t, o)], o)
                lo, hi = bootstrap(list(scores.values()))
                row.append(f"{100 * mean(scores.values()):.1f}% [{100 * lo:.0f}, {100 * hi:.0f}]")
                result[f"matrix_{key(t)}_on_{key(o)}"] = mean(scores.values())
            print(f"| {t} | " + " | ".join(row) + " |")
    print("timings this run: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in stages.timings.items()))
    print("RESULT " + " ".join(f"{k}={v:.4f}" for k, v in result.items()))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "run.toml"),
                   help="the run's config (default: the repo's run.toml, the default run)")
    p.add_argument("--harnesses", default="mini-swe-agent,pi")
    p.add_argument("--out", default="runs/learning_bench")
    p.add_argument("--samples", type=int, default=4, help="samples per task for the warm and RL policies")
    p.add_argument("--rl-steps", type=int, default=12)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="section.key=value",
                   help="config overrides for every stage (e.g. learner.lr=1e-5)")
    p.add_argument("--tune", action="store_true", help="evaluate on the validation split (tuning runs)")
    p.add_argument("--budget-min", type=float, default=0, help="stop before a stage that would pass this many minutes")
    p.add_argument("--sec-per-rollout", type=float, default=45.0,
                   help="budget estimate per eval rollout (measured: 35-80 s for a warm-started policy on 2 cores)")
    p.add_argument("--sec-per-step", type=float, default=240.0, help="budget estimate per GRPO step")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 demo per family, 1 sample, 1 GRPO step")
    args = p.parse_args(argv)
    if args.quick:
        args.samples, args.rl_steps = 1, 1
        args.overrides = ["warm_start.demos=1", "tasks.families=[\"constant\",\"operator\"]", "pools.group_size=2",
                          "warm_start.epochs=1", *args.overrides]
    return args


if __name__ == "__main__":
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    asyncio.run(main(parse_args()))
