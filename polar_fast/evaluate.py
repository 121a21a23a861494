"""Evaluation: pass@k per harness on a task split, for the base model or a checkpoint.

    report = await run_eval(cfg, harnesses=["mini-swe-agent", "pi"], samples=4, ks=[1, 2])
    print(format_report(report))

Each task is run `samples` times per harness through the same stack as training (pools, real
harness CLI, capture proxy, engine), sampling as the run's `[sampling]` says. pass@k is the
unbiased estimator of Chen et al. (2021) from n scored samples with c passing:
1 - C(n-c, k) / C(n, k). A sample that ended in an infrastructure failure (sandbox, engine down)
is never scored: it is counted apart, and a task left with fewer than k scored samples has no
pass@k (it is counted as `short`), so a flaky machine never reads as a weak model. A harness's
pass@k is the mean over its tasks that have one. Several harnesses give the checkpoint x harness
matrix: train on one harness, evaluate on all of them.

The evaluation's rollouts go to the record log like training ones, marked `purpose = "eval"`;
their calls are never trained on, nor exported as SFT data.

Held out means held out (`heldout_tasks`): the tasks come from `eval.source`, else from the task
source's own split (families, a datasets dir). A single file or "builtin" has no splits, so an
eval of a held-out split from it, or of any tasks that share an instance_id or a repo + base
commit with the training tasks, is refused before anything runs, with the overlap in the message.
Evaluating the training split itself (`--split train`, as tasks.split) is allowed: it says so.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import subprocess
import time
from pathlib import Path
from typing import Callable, Sequence

import msgspec

from polar_fast.config import Config
from polar_fast.errors import ConfigError, PolarError
from polar_fast.pools import Pools
from polar_fast.records import CALL_CAUSES, Outcome, RolloutRecord
from polar_fast.rollouts.groups import GroupRecord, GroupSpec
from polar_fast.teachers.guide import Guide
from polar_fast.rollouts.tasks import Task, has_splits, load_tasks, shared_tasks

SHOWN_OVERLAPS = 5  # shared tasks named in the refusal; the rest are counted


class EvalError(PolarError):
    """The evaluation cannot run as asked (bad k, unknown harness, no tasks, bad checkpoint)."""


class TaskScore(msgspec.Struct, frozen=True, kw_only=True):
    task_id: str
    scored: int  # samples with a reward (infra failures excluded)
    passed: int  # scored samples with reward 1
    infra_failures: int
    pass_at: dict[str, float | None]  # "k" -> pass@k, None when scored < k


class HarnessScore(msgspec.Struct, frozen=True, kw_only=True):
    harness: str
    tasks: int
    samples: int  # rollouts run, all outcomes
    pass_at: dict[str, float | None]  # "k" -> mean over tasks with >= k scored samples
    short: dict[str, int]  # "k" -> tasks with fewer than k scored samples (left out of pass@k)
    outcomes: dict[str, int]  # Outcome value -> count
    causes: dict[str, int]  # records.CALL_CAUSES summed over the rollouts
    mean_reward: float | None
    per_task: list[TaskScore]


class EvalReport(msgspec.Struct, frozen=True, kw_only=True):
    split: str
    samples: int
    ks: list[int]
    sampling: dict  # the run's [sampling], which every sample used
    model: str  # model path, or the checkpoint evaluated
    harnesses: list[HarnessScore]
    provenance: dict
    duration_s: float
    guided: str = ""  # guide.until when the rollouts were guided (validation only, as training sees it); "" = unguided


GUIDED_SPLITS = ("validation",)  # the one split a guided eval may run on: held-out and transfer are always unguided


def pass_at_k(n: int, c: int, k: int) -> float | None:
    """Unbiased pass@k from n samples with c correct; None when n < k (not enough samples)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if n < k:
        return None
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def score_harness(harness: str, rollouts: Sequence[RolloutRecord], ks: Sequence[int],
                  task_ids: Sequence[str] | None = None) -> HarnessScore:
    """pass@k of one harness's rollouts (all samples of all tasks)."""
    by_task: dict[str, list[RolloutRecord]] = {t: [] for t in task_ids or ()}
    for r in rollouts:
        by_task.setdefault(r.task_id, []).append(r)
    per_task = []
    for task_id, rs in by_task.items():
        scored = [r for r in rs if r.outcome is not Outcome.INFRA_ERROR and r.reward is not None]
        passed = sum(1 for r in scored if r.reward >= 1.0)
        per_task.append(TaskScore(task_id=task_id, scored=len(scored), passed=passed,
                                  infra_failures=len(rs) - len(scored),
                                  pass_at={str(k): pass_at_k(len(scored), passed, k) for k in ks}))
    pass_at, short = {}, {}
    for k in ks:
        values = [t.pass_at[str(k)] for t in per_task if t.pass_at[str(k)] is not None]
        pass_at[str(k)] = sum(values) / len(values) if values else None
        short[str(k)] = len(per_task) - len(values)
    outcomes = {o.value: 0 for o in Outcome}
    causes = dict.fromkeys(CALL_CAUSES, 0)
    for r in rollouts:
        outcomes[r.outcome.value] += 1
        for cause, n in r.causes.items():
            causes[cause] = causes.get(cause, 0) + n
    rewards = [r.reward for r in rollouts if r.reward is not None]
    return HarnessScore(harness=harness, tasks=len(per_task), samples=len(rollouts), pass_at=pass_at, short=short,
                        outcomes=outcomes, causes=causes,
                        mean_reward=sum(rewards) / len(rewards) if rewards else None, per_task=per_task)


async def evaluate_tasks(rollouts, tasks: Sequence[Task], samples: int, *, purpose: str = "eval",
                         on_group: Callable[[list[RolloutRecord]], None] | None = None,
                         guide: Guide | None = None) -> list[RolloutRecord]:
    """Run every task `samples` times on an open rollout stack (rollouts/stack.py); returns the
    rollout records, each written to the record log with `purpose` ("eval"; "demo" for the warm
    start's demonstrations). The groups' calls are dropped here (they are in the record log):
    evaluation never feeds the learner. `guide`: each rollout's first calls answered as a
    guided training rollout's are (run_eval allows it on validation only)."""
    out: list[RolloutRecord] = []

    async def done(group: GroupRecord) -> None:
        records = [msgspec.structs.replace(r, purpose=purpose) for r in group.records]
        await rollouts.proxy.record(*records)
        out.extend(records)
        if on_group:
            on_group(records)

    if guide is not None:
        await asyncio.to_thread(guide.prepare, list(tasks))
    stamp = f"eval{int(time.time() * 1000) % 10**8}"
    specs = [GroupSpec(task=t, group_id=f"{stamp}-{t.instance_id}", group_size=samples,
                       guide=guide.replies(t) if guide else []) for t in tasks]
    await Pools.for_rollouts(rollouts, group_size=samples).run(specs, done)
    return out


def eval_tasks(cfg: Config, split: str, limit: int) -> list[Task]:
    """The tasks of `split` of eval.source (else of tasks.source), unchecked."""
    tc = cfg.tasks
    return load_tasks(cfg.eval.source or tc.source, split=split, limit=limit, image=tc.image,
                      families=tc.families or None, per_family=tc.per_family)


def training_tasks(cfg: Config) -> list[Task]:
    """Every task of the training split (before tasks.limit: rows a shorter run skips still count)."""
    tc = cfg.tasks
    return load_tasks(tc.source, split=tc.split, image=tc.image, families=tc.families or None,
                      per_family=tc.per_family)


def heldout_tasks(cfg: Config, split: str, limit: int) -> list[Task]:
    """The tasks an eval of `split` runs, refused with EvalError when they are training tasks:
    a task source without splits and no eval.source, or tasks that share an instance_id or a
    repo + base commit with the training split. Evaluating the training split itself (eval.source
    unset, split = tasks.split) is what was asked for and is not refused."""
    ec, tc = cfg.eval, cfg.tasks
    if not ec.source and split == tc.split:
        return eval_tasks(cfg, split, limit)
    if not ec.source and not has_splits(tc.source):
        what = "the built-in suite" if tc.source == "builtin" else f"tasks.source {tc.source!r}"
        raise EvalError(
            f"{what} is a single set of tasks with no held-out split: an eval of split {split!r} would run "
            f"on the training tasks. Set eval.source to held-out tasks (a .jsonl / .parquet file or a dataset "
            "dir) that share no instance_id and no repo + base_commit with them")
    tasks = eval_tasks(cfg, split, limit)
    shared = shared_tasks(training_tasks(cfg), tasks)
    if shared:
        where = f"eval.source {ec.source!r}" if ec.source else f"split {split!r} of {tc.source!r}"
        named = "; ".join(shared[:SHOWN_OVERLAPS]) + (f"; and {len(shared) - SHOWN_OVERLAPS} more"
                                                       if len(shared) > SHOWN_OVERLAPS else "")
        raise EvalError(
            f"held-out tasks overlap the training tasks: {len(shared)} of the {len(tasks)} tasks of {where} are in "
            f"the training split {tc.split!r} of {tc.source!r}: {named}. Remove them from the held-out set, or "
            "set eval.source to tasks that share no instance_id and no repo + base_commit with training")
    return tasks


async def run_eval(cfg: Config, *, harnesses: Sequence[str] = (), samples: int = 1, ks: Sequence[int] = (1,),
                   split: str | None = None, limit: int = 0, checkpoint: str = "", run_dir: Path | None = None,
                   engine_for: Callable[[Config], object] | None = None,
                   emit: Callable[[str, dict], None] | None = None, purpose: str = "eval",
                   guided: bool = False) -> EvalReport:
    """pass@k of the base model (or `checkpoint`) for each harness; see the module docstring.
    `engine_for(cfg)` replaces the configured engine (tests: a scripted one). `purpose` labels
    the rollout records: "eval" (held-out tasks, checked by heldout_tasks; never exported) or
    "demo" (the warm start's teacher demonstrations, exported for sft; no held-out check).
    `guided`: the rollouts are guided as the run's [guide] guides training (validation only:
    held-out and transfer always run unguided)."""
    from polar_fast.cluster import rollout_side
    from polar_fast.rollouts.harnesses import get_harness

    emit = emit or (lambda kind, data: None)
    ks = sorted(set(ks))
    if not ks or ks[0] < 1:
        raise EvalError(f"k must be a list of integers >= 1, got {list(ks)}")
    if samples < 1:
        raise EvalError(f"samples must be >= 1, got {samples}")
    names = list(harnesses) or [cfg.harness.name]
    for name in names:
        try:
            await asyncio.to_thread(get_harness, name, cfg.harness)  # a definition file is read
        except ConfigError as e:
            raise EvalError(str(e).replace("key 'harness.name': ", "")) from None
    if max(ks) > samples:
        emit("info", {"message": f"pass@{max(ks)} needs >= {max(ks)} samples per task; --samples is {samples}"})
    split = split or cfg.eval.split
    if guided and (split not in GUIDED_SPLITS or not cfg.guide.until):
        raise EvalError(f"a guided eval runs on {' or '.join(GUIDED_SPLITS)} with guide.until set (split {split!r}, "
                        f"guide.until {cfg.guide.until!r}): held-out and transfer tasks are always evaluated unguided")
    tasks = await asyncio.to_thread(heldout_tasks if purpose == "eval" else eval_tasks, cfg, split, limit)
    model_path = cfg.model.path
    if checkpoint:
        model_path = await asyncio.to_thread(checkpoint_model_dir, checkpoint, cfg.model.path)
        cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=str(model_path)))
    run_dir = Path(run_dir or Path(cfg.run.output_dir) / "eval")
    started = time.perf_counter()
    scores = []
    for name in names:
        hcfg = msgspec.structs.replace(cfg, harness=msgspec.structs.replace(cfg.harness, name=name))
        emit("info", {"message": f"evaluating {name}: {len(tasks)} tasks x {samples} samples ({split})"})
        hdir = run_dir / name
        await asyncio.to_thread(hdir.mkdir, parents=True, exist_ok=True)
        engine = engine_for(hcfg) if engine_for else None
        guide = Guide.for_run(cfg.guide, name, cfg.warm_start.plan) if guided else None
        async with rollout_side(hcfg, hdir, emit=emit, engine=engine) as stack:  # here, or on a Ray cluster
            records = await evaluate_tasks(stack, tasks, samples, purpose=purpose, guide=guide)
        scores.append(score_harness(name, records, ks, [t.instance_id for t in tasks]))
    provenance = await asyncio.to_thread(collect_provenance, cfg, names)
    return EvalReport(split=split, samples=samples, ks=ks, sampling=msgspec.structs.asdict(cfg.sampling),
                      model=checkpoint or str(model_path) or cfg.model.name, harnesses=scores,
                      provenance=provenance, duration_s=time.perf_counter() - started,
                      guided=cfg.guide.until if guided else "")


def checkpoint_model_dir(checkpoint: str, base_path: str) -> Path:
    """An HF model directory for `checkpoint`: itself when it is one (config.json, as `sft`
    writes), else a learner checkpoint `step_N.pt` (or its directory's latest) converted once
    beside it into `<name>.hf/` (learner/checkpoint.export_hf, also `export-model`)."""
    from polar_fast.learner.checkpoint import CheckpointError, export_hf, latest_checkpoint

    path = Path(checkpoint)
    if (path / "config.json").is_file():
        return path
    if path.is_dir():
        latest = latest_checkpoint(path)
        if latest is None:
            raise EvalError(f"checkpoint {checkpoint}: neither a model directory (config.json) nor a "
                            "checkpoints directory with a `latest` file")
        path = latest
    if not path.is_file():
        raise EvalError(f"checkpoint {checkpoint} does not exist")
    out = path.with_name(path.name + ".hf")
    if (out / "config.json").is_file() and (out / "config.json").stat().st_mtime >= path.stat().st_mtime:
        return out
    try:
        return export_hf(path, base_path, out)
    except CheckpointError as e:
        raise EvalError(str(e)) from None


def collect_provenance(cfg: Config, harnesses: Sequence[str]) -> dict:
    """What a reader needs to reproduce a number: code, harness and model versions."""
    from polar_fast.model import model_dir as resolve_model_dir
    from polar_fast.rollouts.harnesses import bundle_manifest, bundle_root, get_harness

    root = Path(__file__).resolve().parent.parent
    commit = _git(root, "rev-parse", "HEAD")
    dirty = bool(_git(root, "status", "--porcelain", "--untracked-files=no")) if commit else False
    root = bundle_root(cfg.harness.bundle_dir)
    versions = {}
    for name in harnesses:
        versions[name] = bundle_manifest(get_harness(name, cfg.harness).install(root))  # cached: finds the bundle
    model_dir = resolve_model_dir(cfg.model.path)
    return {
        "git_commit": commit, "git_dirty": dirty, "harnesses": versions,
        "model": str(model_dir), "model_sha256": weights_sha256(model_dir),
        "tokenizer_sha256": _hash_files([p for p in (model_dir / "tokenizer.json",) if p.exists()]),
        "engine": cfg.engine.kind, "tasks": {"source": cfg.tasks.source, "reward": cfg.tasks.reward},
    }


def _git(root: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def weights_sha256(model_dir: Path) -> str:
    """sha256 over an HF directory's safetensors files, in name order."""
    return _hash_files(sorted(Path(model_dir).glob("*.safetensors")))


def _hash_files(paths: list[Path]) -> str:
    if not paths:
        return ""
    h = hashlib.sha256()
    for p in paths:
        with p.open("rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()


def format_report(report: EvalReport) -> str:
    s = report.sampling
    guided = f", guided up to the teacher's {report.guided!r} step" if report.guided else ""
    lines = [f"eval: {report.split} split{guided}, {report.samples} samples per task, model {report.model}",
             f"sampling (the run's [sampling]): temperature {s['temperature']}, top_p {s['top_p']}, "
             f"max_tokens {s['max_tokens']}, seed {s['seed']}"]
    ks = report.ks
    header = f"{'harness':<16}{'tasks':>6}{'samples':>8}" + "".join(f"{'pass@' + str(k):>9}" for k in ks) + \
        f"{'ok':>5}{'agent_err':>10}{'timeout':>8}{'infra':>6}"
    lines += [header, "-" * len(header)]
    for h in report.harnesses:
        cells = "".join(f"{_pct(h.pass_at[str(k)]):>9}" for k in ks)
        o = h.outcomes
        lines.append(f"{h.harness:<16}{h.tasks:>6}{h.samples:>8}{cells}{o['ok']:>5}{o['agent_error']:>10}"
                     f"{o['timeout']:>8}{o['infra_error']:>6}")
    for h in report.harnesses:
        short = [f"pass@{k}: {h.short[str(k)]} tasks with fewer than {k} scored samples, left out"
                 for k in ks if h.short[str(k)]]
        causes = ", ".join(f"{c} {n}" for c, n in h.causes.items() if n)
        if short or causes:
            lines.append(f"{h.harness}: " + "; ".join(short + ([f"causes: {causes}"] if causes else [])))
    lines.append("infrastructure failures are counted apart and never scored")
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "n<k" if value is None else f"{100 * value:.1f}"


def write_report(report: EvalReport, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    return path
