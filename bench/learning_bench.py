"""Does RL itself make the policy better inside a real harness, beyond what more SFT would do?

    python bench/learning_bench.py [--config run.toml] [--harness mini-swe-agent] [--rl-steps 20]
                                   [--tasks 40] [--samples 4] [--seeds 1] [--out runs/learning_bench]
                                   [--budget-min 120] [--set section.key=value ...]
                                   [--tune] [--base] [--pi] [--matrix] [--quick]

Everything runs through the real stack: the harness CLI in local sandboxes, the capture proxy,
the embedded engine with the run's [sampling], the packed learner. Per harness:
1. warm: the run's warm start (warm_start.py: a careful teacher's demonstrations, then sft);
2. rl: `--rl-steps` GRPO steps from the warm start on the train split, with the run's recipe
   (its [guide], group size, lr, difficulty filtering; train.py), the KL to the warm start and
   the policy's entropy logged every step;
3. control: the warm start given the same learner compute as more SFT: more teacher
   demonstrations (demos-split seeds the warm start never saw), the same number of optimizer
   steps as the RL stage, and about the same forwarded tokens per step. RL must beat this, or
   its gain is just more training. Its lr is the warm start's; `--control-lr rl` (or `both`)
   trains control_rl_lr on the same rows at the RL stage's lr, so a gap cannot come from a
   harsher step size alone;
4. each stage's last checkpoint (fixed in advance: no picking the best step) evaluated on the same
   frozen tasks, unguided: `--tasks` tasks of the heldout_large split x `--samples`, and the
   transfer split (families no stage ever trains on) at 1 sample per task.

It prints warm -> rl and control -> rl with 95% paired bootstrap intervals over tasks, the train
reward, entropy and KL per RL step, and transfer pass@1 (measured, not a goal). `--tune` instead
evaluates the warm start on the validation split (where every setting is chosen; never held-out
or transfer), guided as training sees it and unguided as held-out will, with pass@1, pass@k and
the share of groups that would carry an advantage, per family. `--base` adds the model as
shipped; `--pi` adds the Pi harness; `--matrix` evaluates each harness's RL policy in the others.

Stages are cached under --out (a JSON file per stage; GRPO resumes from its checkpoints), so a
stopped run continues where it stopped; `--budget-min` stops before a stage that would not fit,
from the estimates printed up front (`--sec-per-rollout`, `--sec-per-step`).

Last line: `RESULT <h>_warm=.. <h>_rl=.. <h>_control=.. <h>_rl_delta_lo=.. <h>_rl_delta_hi=..
<h>_rl_minus_control_lo=.. <h>_rl_minus_control_hi=.. <h>_train_reward_first=.. <h>_train_reward_last=..
<h>_transfer_warm=.. <h>_transfer_rl=.. <h>_transfer_control=..` (held-out pass@1 unless named
transfer; train reward: the mean over the first and the last 3 steps; `-` in harness names
written `_`). With `--seeds n` > 1, each further seed adds the same keys under `<h>_rl_seed<i>`, and
`<h>_control_rl_lr` and `<h>_<rl>_minus_control_rl_lr_lo/hi` come with `--control-lr rl|both`.
`<h>_rl_pooled*` compares the seeds pooled (per task, the mean of their pass rates): the recipe's
policy rather than one run's luck, fixed in advance as the RL estimate whenever n > 1.
With --tune: `<h>_<family>_guided_pass1=.. <h>_<family>_unguided_pass1=..` and pass@k.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Awaitable, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_fast.config import Config, load_config  # noqa: E402
from polar_fast.evaluate import eval_tasks, format_report, pass_at_k, run_eval  # noqa: E402
from polar_fast.report.intervals import bootstrap, paired_verdict  # noqa: E402

HELDOUT = "heldout_large"  # frozen, 48 per family (rollouts/families.py); --tasks of them, interleaved by family
TRANSFER = "transfer"
LAST_STEPS = 3  # train reward: the mean over the first and the last this many steps


def per_task(report: dict, harness: str) -> dict[str, float]:
    """task id -> the share of its scored samples that passed (its pass@1)."""
    [h] = [h for h in report["harnesses"] if h["harness"] == harness]
    return {t["task_id"]: t["passed"] / t["scored"] for t in h["per_task"] if t["scored"]}


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def key(harness: str) -> str:
    return harness.replace("-", "_")


def family_of(task_id: str) -> str:
    """'family__constant-1000100' -> 'constant' (generated tasks); any other id is its own family."""
    return task_id.split("__", 1)[1].rsplit("-", 1)[0] if task_id.startswith("family__") else task_id


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


async def evaluate(cfg: Config, harness: str, split: str, samples: int, checkpoint: str, run_dir: Path, *,
                   limit: int = 0, guided: bool = False) -> dict:
    import msgspec

    report = await run_eval(cfg, harnesses=[harness], split=split, samples=samples, ks=sorted({1, samples}),
                            checkpoint=checkpoint, run_dir=run_dir, limit=limit, guided=guided)
    print(format_report(report), flush=True)
    return msgspec.to_builtins(report)


class Plan:
    """What the bench runs, and its time estimate (printed up front, checked per stage)."""

    def __init__(self, cfg: Config, args) -> None:
        self.cfg, self.args = cfg, args
        self.n_heldout = len(eval_tasks(cfg, HELDOUT, args.tasks))
        self.n_transfer = len(eval_tasks(cfg, TRANSFER, 0))
        self.n_validation = len(eval_tasks(cfg, "validation", args.tasks))

    def eval_s(self, split: str, samples: int, guided: bool = False) -> float:
        n = {HELDOUT: self.n_heldout, TRANSFER: self.n_transfer, "validation": self.n_validation}[split]
        per = self.args.sec_per_rollout * (self.args.guided_share if guided else 1.0)
        return n * samples * per / self.cfg.pools.agent_workers * self.args.parallel_gain

    def rl_s(self) -> float:
        return self.args.rl_steps * self.args.sec_per_step

    def control_s(self) -> float:
        return self.args.rl_steps * self.args.sec_per_step * 0.4

    def policy_evals_s(self) -> float:
        return self.eval_s(HELDOUT, self.args.samples) + self.eval_s(TRANSFER, 1)


async def run_harness(h: str, cfg: Config, args, stages: Stages, out: Path, plan: Plan) -> dict:
    from polar_fast.warm_start import ensure_warm_start

    def log(kind: str, data: dict) -> None:
        print(data.get("message", data), flush=True)

    async def warm() -> dict:
        path, report = await ensure_warm_start(cfg, log)
        return {"path": str(path), **report}

    warm_info = await stages.get(f"{h}/warm_start", 600, warm)
    if args.tune:
        return await tune(h, cfg, args, stages, out, plan, warm_info)
    results: dict[str, dict] = {}

    async def policy(name: str, checkpoint: str) -> None:
        for split, samples, limit in ((HELDOUT, args.samples, args.tasks), (TRANSFER, 1, 0)):
            results[f"{name}:{split}"] = await stages.get(
                f"{h}/{name}_{split}", plan.eval_s(split, samples),
                lambda s=split, n=samples, lim=limit: evaluate(cfg, h, s, n, checkpoint, out / h / f"eval_{name}_{s}",
                                                               limit=lim))

    if args.base:
        await policy("base", "")
    await policy("warm", warm_info["path"])
    rl_runs = []
    for seed in range(args.seeds):
        name = rl_name(seed)
        info = await stages.get(f"{h}/{name}", plan.rl_s(), lambda s=seed, n=name: rl_stage(h, args, out / h / n, s))
        rl_runs.append(info)
        await policy(name, info["checkpoint"])
    controls = {}
    first_demos = out / h / "control" / "sft_data"
    for name, lr in control_lrs(args.control_lr, cfg).items():
        # control_rl_lr trains on control's demonstrations when they exist: only its lr differs
        demos_from = None if name == "control" else first_demos
        controls[name] = await stages.get(
            f"{h}/{name}", plan.control_s(),
            lambda n=name, lr=lr, d=demos_from: control_stage(cfg, warm_info["path"], rl_runs[0], out / h / n, log,
                                                              lr=lr, demos_from=d))
        await policy(name, controls[name]["model_dir"])
    return {"results": results, "rl": rl_runs, "controls": controls, "warm": warm_info,
            "checkpoint": rl_runs[0]["checkpoint"]}


async def rl_stage(h: str, args, rl_dir: Path, seed: int) -> dict:
    from polar_fast.train import train

    rl_cfg = load_config(args.config, [*args.overrides, f"harness.name={h}", f"run.output_dir={rl_dir}",
                                       f"run.steps={args.rl_steps}", f"run.seed={seed}", "eval.every_steps=0",
                                       "eval.at_start=false", "learner.track_kl=true",
                                       f"run.checkpoint_every={args.rl_steps}"])
    resume = (rl_dir / "checkpoints").exists() or (rl_dir / "records.log").exists()
    summary = await train(rl_cfg, resume=resume)
    return {"steps": summary.steps, "groups_trained": summary.groups_trained, "checkpoint": summary.checkpoint,
            "outcomes": summary.outcomes, "causes": summary.causes, "seed": seed,
            "optimizer_steps": len(summary.steps),
            "forwarded_tokens": sum(s.get("merge/tokens_forwarded", 0) for s in summary.steps)}


def control_lrs(which: str, cfg: Config) -> dict[str, float]:
    """--control-lr -> {control stage: its lr}: "warm" (SFT at the warm start's lr: the stage named
    control), "rl" (at the RL stage's lr: control_rl_lr, so a gap to RL cannot come from a harsher
    step size), or both."""
    both = {"control": cfg.warm_start.lr, "control_rl_lr": cfg.learner.lr}
    return {"warm": {"control": both["control"]}, "rl": {"control_rl_lr": both["control_rl_lr"]}, "both": both}[which]


async def control_stage(cfg: Config, warm_path: str, rl: dict, work: Path, log, *, lr: float,
                        demos_from: Path | None = None) -> dict:
    """SFT from the warm start on demonstrations it never saw, for the RL stage's learner compute:
    as many optimizer steps, about as many forwarded tokens per step (rows per step chosen to
    match), one pass over distinct demonstrations where there are enough of them. `demos_from`:
    another control's demonstrations, used when they are enough (the same rows, another lr)."""
    import msgspec

    from polar_fast.grpo import Learner
    from polar_fast.learner.batches import nll_step_batch
    from polar_fast.learner.sft import read_rows, run_sft
    from polar_fast.warm_start import demo_tasks, record_demonstrations

    steps = max(1, rl["optimizer_steps"])
    tokens_per_step = rl["forwarded_tokens"] / steps
    warm_cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=warm_path))
    per_family = cfg.warm_start.demos
    families = len(demo_tasks(cfg)) // max(per_family, 1) or 1
    needed = max(steps, 1)  # grows once the tokens of a row are known
    work.mkdir(parents=True, exist_ok=True)
    rows: list = []
    if demos_from is not None and (demos_from / "tokens.jsonl").is_file():
        rows = await asyncio.to_thread(read_rows, demos_from)
    while True:
        n = -(-needed // families)
        if len(rows) < needed:
            tasks = demo_tasks(cfg, skip=cfg.warm_start.demos, per_family=n)  # seeds the warm start never saw
            await asyncio.to_thread(_clear, work)
            kept, report = await record_demonstrations(cfg, tasks, work, log)
            log("info", {"message": f"control: {kept}/{len(tasks)} new demonstrations passed; {report}"})
            rows = await asyncio.to_thread(read_rows, work / "sft_data")
        packing = {"layout": cfg.merge.layout, "max_tokens": cfg.merge.max_tokens}
        per_row = nll_step_batch(rows, **packing).n_tokens / len(rows)
        rows_per_step = max(1, round(tokens_per_step / per_row))
        if len(rows) >= rows_per_step * steps or needed >= rows_per_step * steps:
            break
        needed = rows_per_step * steps
    epochs = max(1, math.ceil(rows_per_step * steps / len(rows)))
    sft_cfg = msgspec.structs.replace(warm_cfg, sft=msgspec.structs.replace(cfg.sft, rows_per_step=rows_per_step))
    use = rows[: rows_per_step * steps] if epochs == 1 else rows
    data = work / "control_rows.jsonl"
    await asyncio.to_thread(_write_rows, data, use)
    report = await asyncio.to_thread(run_sft, sft_cfg, data, Learner.from_config, out_dir=work / "model",
                                     epochs=epochs, lr=lr, emit=log, measure=False)
    return {"model_dir": report.model_dir, "rows": report.rows, "optimizer_steps": report.steps,
            "rows_per_step": rows_per_step, "epochs": epochs, "forwarded_tokens": report.tokens * epochs,
            "rl_optimizer_steps": steps, "rl_forwarded_tokens": rl["forwarded_tokens"], "lr": lr,
            "nll_first": report.nll_before, "nll_last": report.nll_after}


def _clear(work: Path) -> None:
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)


def _write_rows(path: Path, rows) -> None:
    with path.open("w") as f:
        for ids, mask in rows:
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")


async def tune(h: str, cfg: Config, args, stages: Stages, out: Path, plan: Plan, warm_info: dict) -> dict:
    """The warm start on validation, guided (as training sees it) and unguided (as held-out will)."""
    results = {}
    modes = [("guided", True)] if cfg.guide.until else []
    if not args.guided_only:
        modes.append(("unguided", False))
    for mode, guided in modes:
        results[mode] = await stages.get(
            f"{h}/tune_{mode}", plan.eval_s("validation", args.tune_samples, guided),
            lambda g=guided, m=mode: evaluate(cfg, h, "validation", args.tune_samples, warm_info["path"],
                                              out / h / f"tune_{m}", limit=args.tasks, guided=g))
    return {"tune": results, "warm": warm_info}


def print_tune(harnesses, done, args) -> dict[str, float]:
    result: dict[str, float] = {}
    k, g = args.tune_samples, args.group_size
    for h in harnesses:
        for mode, report in done[h]["tune"].items():
            [scores] = [s for s in report["harnesses"] if s["harness"] == h]
            by_family: dict[str, list[dict]] = {}
            for t in scores["per_task"]:
                if t["scored"]:
                    by_family.setdefault(family_of(t["task_id"]), []).append(t)
            print(f"\n{h}, validation, {mode}: per family ({k} samples per task; advantage@{g}: the share of "
                  f"groups of {g} whose rewards would differ, 1 - p^{g} - (1-p)^{g} per task)")
            print(f"| family | tasks | pass@1 | pass@{k} | advantage@{g} | mixed samples |")
            print("| --- | ---: | ---: | ---: | ---: | ---: |")
            rows = sorted(by_family.items()) + [("all", [t for ts in by_family.values() for t in ts])]
            for family, tasks in rows:
                p1 = mean(t["passed"] / t["scored"] for t in tasks)
                pk = mean(pass_at_k(t["scored"], t["passed"], k) or 0.0 for t in tasks)
                adv = mean(1 - (t["passed"] / t["scored"]) ** g - (1 - t["passed"] / t["scored"]) ** g for t in tasks)
                mixed = mean(0 < t["passed"] < t["scored"] for t in tasks)
                print(f"| {family} | {len(tasks)} | {100 * p1:.1f}% | {100 * pk:.1f}% | {100 * adv:.0f}% | {100 * mixed:.0f}% |")
                result[f"{key(h)}_{family}_{mode}_pass1"] = p1
                result[f"{key(h)}_{family}_{mode}_pass{k}"] = pk
    return result


def rl_name(seed: int) -> str:
    """The RL stage of one training seed: "rl" for seed 0 (the name older runs cached), then rl_seed1, ..."""
    return "rl" if seed == 0 else f"rl_seed{seed}"


def pooled(per_seed: list[dict[str, float]]) -> dict[str, float]:
    """Per task, the mean pass rate over the RL seeds: the recipe's policy, not one run's luck."""
    ids = set.intersection(*(set(s) for s in per_seed))
    return {i: mean(s[i] for s in per_seed) for i in ids}


def print_summary(harnesses, done, cells, stages, *, samples: int) -> dict[str, float]:
    result: dict[str, float] = {}
    for h in harnesses:
        r = done[h]["results"]
        rls = [rl_name(seed) for seed in range(len(done[h]["rl"]))]
        policies = [p for p in ("base", "warm", *rls, "control", "control_rl_lr") if f"{p}:{HELDOUT}" in r]
        scores = {(p, split): per_task(r[f"{p}:{split}"], h) for p in policies for split in (HELDOUT, TRANSFER)}
        if len(rls) > 1:  # seeds pooled: fixed in advance as the RL estimate whenever --seeds > 1
            for split in (HELDOUT, TRANSFER):
                scores[("rl_pooled", split)] = pooled([scores[(n, split)] for n in rls])
            policies.insert(policies.index(rls[-1]) + 1, "rl_pooled")
        print(f"\n{h}: pass@1, unguided (95% bootstrap interval over tasks)"
              + (f"; rl_pooled: per task, the mean over the {len(rls)} RL seeds" if len(rls) > 1 else ""))
        print(f"| policy | {HELDOUT} (x{samples}) | {TRANSFER} (x1) |")
        print("| --- | ---: | ---: |")
        for policy in policies:
            row = []
            for split in (HELDOUT, TRANSFER):
                s = scores[(policy, split)]
                lo, hi = bootstrap(list(s.values()))
                row.append(f"{100 * mean(s.values()):.1f}% [{100 * lo:.0f}, {100 * hi:.0f}]")
                result[f"{key(h)}_{policy}" if split == HELDOUT else f"{key(h)}_{split}_{policy}"] = mean(s.values())
            print(f"| {policy} | {' | '.join(row)} |")
        for name in [p for p in policies if p.startswith("rl")]:
            rl = scores[(name, HELDOUT)]
            for before, suffix in (("warm", "delta"), ("control", "minus_control"),
                                   ("control_rl_lr", "minus_control_rl_lr")):
                if (before, HELDOUT) not in scores:
                    continue
                other = scores[(before, HELDOUT)]
                ids = sorted(set(other) & set(rl))
                lo, hi, p, verdict = paired_verdict([other[i] for i in ids], [rl[i] for i in ids])
                delta = mean(rl[i] for i in ids) - mean(other[i] for i in ids)
                print(f"{before} -> {name} on {HELDOUT}: {100 * delta:+.1f} points, 95% paired bootstrap over "
                      f"{len(ids)} tasks [{100 * lo:+.1f}, {100 * hi:+.1f}], sign-flip p {p:.3f}: {verdict}")
                result[f"{key(h)}_{name}_{suffix}_lo"], result[f"{key(h)}_{name}_{suffix}_hi"] = lo, hi
        for name, run in zip(rls, done[h]["rl"]):
            steps = run["steps"]
            label = f" ({name})" if len(rls) > 1 else ""
            rewards = [s.get("reward/mean", float("nan")) for s in steps]
            print(f"GRPO train reward per step{label}: " + ", ".join(f"{x:.2f}" for x in rewards))
            print(f"policy entropy per step (nats){label}: "
                  + ", ".join(f"{s.get('learner/entropy', float('nan')):.3f}" for s in steps))
            print(f"KL to the warm start per step{label}: "
                  + ", ".join(f"{s.get('learner/kl', float('nan')):.4f}" for s in steps))
            with_adv = [1 - s.get("reward/zero_variance_groups", 0) / s["reward/groups"]
                        for s in steps if s.get("reward/groups")]
            print(f"share of finished groups with an advantage per step{label}: "
                  + ", ".join(f"{x:.2f}" for x in with_adv))
            if rewards:
                prefix = f"{key(h)}_" if name == "rl" else f"{key(h)}_{name}_"
                result[f"{prefix}train_reward_first"] = mean(rewards[:LAST_STEPS])
                result[f"{prefix}train_reward_last"] = mean(rewards[-LAST_STEPS:])
        for name, control in done[h].get("controls", {}).items():
            print(f"{name}: {control['optimizer_steps']} sft steps of {control['rows_per_step']} rows "
                  f"({control['forwarded_tokens']} tokens forwarded) vs rl: {control['rl_optimizer_steps']} steps "
                  f"({control['rl_forwarded_tokens']} tokens); lr {control['lr']}")
    if cells:
        print("\ncross-harness matrix: held-out pass@1 of each harness's RL policy in every harness")
        print("| trained in \\ evaluated in | " + " | ".join(harnesses) + " |")
        print("| --- |" + " ---: |" * len(harnesses))
        for t in harnesses:
            row = []
            for o in harnesses:
                scores = per_task(cells[(t, o)], o)
                row.append(f"{100 * mean(scores.values()):.1f}%")
                result[f"matrix_{key(t)}_on_{key(o)}"] = mean(scores.values())
            print(f"| {t} | " + " | ".join(row) + " |")
    return result


async def main(args) -> None:
    out = Path(args.out)
    started = time.monotonic()
    harnesses = [args.harness] + (["pi"] if args.pi and args.harness != "pi" else [])
    base = ["eval.every_steps=0", "eval.at_start=false", *args.overrides]
    cfgs = {h: load_config(args.config, [*base, f"harness.name={h}"]) for h in harnesses}
    if not all(c.warm_start.demos for c in cfgs.values()):
        raise SystemExit("the config has no warm start (warm_start.demos = 0): pass --set warm_start.demos=N")
    any_cfg = next(iter(cfgs.values()))
    args.group_size = any_cfg.pools.group_size
    plan = Plan(any_cfg, args)
    if args.tune:
        estimate = len(harnesses) * (600 + plan.eval_s("validation", args.tune_samples, True)
                                     + plan.eval_s("validation", args.tune_samples))
        what = f"validation ({plan.n_validation} tasks x {args.tune_samples}, guided and unguided)"
    else:
        controls = control_lrs(args.control_lr, any_cfg)
        n_controls = len(controls)
        n_policies = 1 + args.seeds + n_controls + args.base
        estimate = len(harnesses) * (600 + n_policies * plan.policy_evals_s() + args.seeds * plan.rl_s()
                                     + n_controls * plan.control_s())
        if args.matrix:
            estimate += len(harnesses) * (len(harnesses) - 1) * plan.eval_s(HELDOUT, args.samples)
        what = (f"{HELDOUT}: {plan.n_heldout} tasks x {args.samples}, {TRANSFER}: {plan.n_transfer} x 1; "
                f"{args.rl_steps} GRPO steps x {args.seeds} seed(s); "
                f"{' and '.join(controls)}: sft at the same compute")
    print(f"learning bench: {', '.join(harnesses)}; {what}; out {out}")
    if args.overrides:
        print(f"settings over {args.config}: {' '.join(args.overrides)}")
    print(f"budget: ~{estimate / 60:.0f} min estimated (~{args.sec_per_rollout:g} s per unguided rollout, "
          f"{args.pools_note}~{args.sec_per_step:g} s per GRPO step); limit {args.budget_min or 'none'} min; "
          f"stages cached in {out}", flush=True)
    stages = Stages(out, args.budget_min * 60, started)
    done = {h: await run_harness(h, cfgs[h], args, stages, out, plan) for h in harnesses}
    if args.tune:
        result = print_tune(harnesses, done, args)
    else:
        cells = {}
        if args.matrix:
            for trained in harnesses:
                for other in harnesses:
                    if other == trained:
                        cells[(trained, other)] = done[trained]["results"][f"rl:{HELDOUT}"]
                        continue
                    cells[(trained, other)] = await stages.get(
                        f"matrix/{trained}_on_{other}", plan.eval_s(HELDOUT, args.samples),
                        lambda t=trained, o=other: evaluate(cfgs[o], o, HELDOUT, args.samples, done[t]["checkpoint"],
                                                            out / "matrix" / f"{t}_on_{o}", limit=args.tasks))
        result = print_summary(harnesses, done, cells, stages, samples=args.samples)
    print(f"wall time this run: {(time.monotonic() - started) / 60:.1f} min; stages: "
          + ", ".join(f"{k} {v / 60:.1f} min" for k, v in stages.timings.items()))
    print("RESULT " + " ".join(f"{k}={v:.4f}" for k, v in result.items()))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "run.toml"),
                   help="the run's config (default: the repo's run.toml, the default run)")
    p.add_argument("--harness", default="mini-swe-agent")
    p.add_argument("--pi", action="store_true", help="also run every stage with the Pi harness")
    p.add_argument("--matrix", action="store_true", help="evaluate each harness's RL policy in the other harnesses")
    p.add_argument("--base", action="store_true", help="also evaluate the model as shipped (it never writes a tool call)")
    p.add_argument("--out", default="runs/learning_bench")
    p.add_argument("--tasks", type=int, default=40, help=f"{HELDOUT} tasks (interleaved by family); --tune: validation tasks")
    p.add_argument("--samples", type=int, default=4, help=f"samples per {HELDOUT} task (transfer: 1)")
    p.add_argument("--rl-steps", type=int, default=20)
    p.add_argument("--seeds", type=int, default=1, help="RL training seeds (run.seed 0..n-1), each evaluated")
    p.add_argument("--control-lr", choices=["warm", "rl", "both"], default="warm",
                   help="the SFT control's lr: the warm start's (control), the RL stage's (control_rl_lr), or both")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="section.key=value",
                   help="config overrides for every stage (e.g. learner.lr=1e-5)")
    p.add_argument("--tune", action="store_true", help="evaluate the warm start on the validation split")
    p.add_argument("--tune-samples", type=int, default=8, help="--tune: samples per task (pass@k at this k)")
    p.add_argument("--guided-only", action="store_true", help="--tune: skip the unguided validation eval")
    p.add_argument("--budget-min", type=float, default=0, help="stop before a stage that would pass this many minutes")
    p.add_argument("--sec-per-rollout", type=float, default=40.0,
                   help="budget estimate: seconds of one unguided rollout run alone (agent_workers run at once)")
    p.add_argument("--guided-share", type=float, default=0.5, help="budget estimate: a guided rollout's share of that")
    p.add_argument("--parallel-gain", type=float, default=1.0, help="budget estimate: a wave's slowdown from batching")
    p.add_argument("--sec-per-step", type=float, default=90.0, help="budget estimate per GRPO step (rollouts included)")
    p.add_argument("--quick", action="store_true", help="smoke run: 1 demo per family, 2 families, 1 sample, 1 GRPO step")
    args = p.parse_args(argv)
    args.pools_note = ""
    if args.quick:
        args.samples, args.rl_steps, args.tasks, args.tune_samples = 1, 1, 2, 2
        args.overrides = ["warm_start.demos=1", "tasks.families=[\"constant\",\"rename\"]", "pools.group_size=2",
                          "warm_start.epochs=1", *args.overrides]
    return args


if __name__ == "__main__":
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    asyncio.run(main(parse_args()))
