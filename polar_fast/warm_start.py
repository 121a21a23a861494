"""A warm start: the policy RL begins from has seen a careful agent work in the harness.

A base model that never emits a tool call the harness can read gets reward 0 on every rollout,
so every GRPO group has zero variance and a run trains on nothing. The warm start teaches the
format and a way of working, not the answers: teacher demonstrations (teachers/) of the
generated families' "demos" split (seeds apart from train, validation, held-out and transfer),
each a scripted policy (PlaybookEngine) typing a careful agent's replies through the real
harness, proxy and sandbox: search the repo, read the file, reproduce the bug, edit, check,
finish. They are kept only when the tests pass, exported as token rows and fine-tuned on with
`sft`, in a process of its own (learner/sft_process.py). RL then trains the result on the train
split, and held-out eval measures it.

    model_dir = await ensure_warm_start(cfg, emit)   # cached: the second run reuses it

The result is cached under the polar_fast cache by a digest of everything it depends on (base
weights, harness bundle, the recipe's settings, and the demonstrations themselves: every reply
the teacher types), so a change to a teacher rebuilds it, and the first run pays once (a few
minutes on 2 CPU cores) while later runs start at once. Its directory keeps the demonstrations'
record log, the token rows and report.json beside the model.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import msgspec

from polar_fast.config import Config
from polar_fast.errors import PolarError
from polar_fast.teachers import teacher_for
from polar_fast.teachers.mini_swe_agent import SUBMIT, bash_call  # noqa: F401 - re-exported for tests

class WarmStartError(PolarError):
    """The warm start cannot be built (no teacher script for the harness, demonstrations failed)."""


def demo_tasks(cfg: Config, *, skip: int = 0, per_family: int | None = None):
    """The demos split's tasks a warm start demonstrates (`warm_start.demos` per family), or
    `per_family` more after the first `skip` per family (more demonstrations, e.g. the learning
    bench's SFT control, which must not repeat the warm start's)."""
    from polar_fast.rollouts.tasks import load_tasks

    if cfg.tasks.source != "families":
        raise WarmStartError(f"warm_start needs tasks.source = \"families\" (its teacher demonstrates their "
                             f"demos split); tasks.source is {cfg.tasks.source!r}")
    n = cfg.warm_start.demos if per_family is None else per_family
    tasks = load_tasks("families", split="demos", families=cfg.tasks.families or None, per_family=skip + n)
    families = len({t.repo for t in tasks}) or 1
    return tasks[skip * families:]  # interleaved by seed: the first `skip` seeds of every family come first


def demonstrations(cfg: Config, tasks) -> dict[str, list[list[str]]]:
    """The teacher's replies per task statement: the PlaybookEngine's plays."""
    teacher = teacher_for(cfg.harness.name, cfg.warm_start.plan)
    return {t.problem_statement: [teacher.replies(t)] for t in tasks}


def check_lengths(cfg: Config, plays: dict[str, list[list[str]]]) -> None:
    """Every reply fits one call's output cap: a teacher cut at max_tokens demonstrates a broken
    tool call, and its demonstration would be lost (its tests fail)."""
    from polar_fast.model import load_tokenizer

    tok = load_tokenizer(cfg.model.path)
    cap = cfg.sampling.max_tokens
    for statement, (replies, *_) in plays.items():
        for reply in replies:
            n = len(tok.encode(reply, add_special_tokens=False)) + 1  # + the end-of-turn token
            if n > cap:
                raise WarmStartError(f"warm start: a teacher reply takes {n} tokens but sampling.max_tokens is {cap} "
                                     f"(task {statement[:60]!r}...): raise sampling.max_tokens to at least {n}")


def cache_key(cfg: Config, plays: dict[str, list[list[str]]]) -> str:
    """Digest of everything the warm-started weights depend on, the demonstrations included."""
    from polar_fast.evaluate import weights_sha256
    from polar_fast.model import model_dir
    from polar_fast.rollouts.harnesses import bundle_manifest, bundle_root, get_harness

    bundle = get_harness(cfg.harness.name).install(bundle_root(cfg.harness.bundle_dir))  # cached: finds it
    parts = {
        "model": weights_sha256(model_dir(cfg.model.path)),
        "harness": cfg.harness.name, "max_steps": cfg.harness.max_steps,
        "bundle": bundle_manifest(bundle),
        "warm_start": msgspec.to_builtins(cfg.warm_start), "sft_seed": cfg.sft.seed,
        "sft_micro_batch_tokens": cfg.sft.micro_batch_tokens,  # rounding only, but a different sum
        "learner": [cfg.learner.grad_clip, cfg.learner.weight_decay, cfg.merge.layout],
        # sft computes in it. engine.dtype is not in: the demonstrations come from a scripted
        # engine, so the embedded engine's dtype changes nothing the warm start computes
        "learner_dtype": cfg.learner.dtype,
        "sampling": cfg.sampling.max_tokens,
        "demonstrations": sorted(plays.items()),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:20]


async def ensure_warm_start(cfg: Config, emit: Callable[[str, dict], None] | None = None) -> tuple[Path, dict]:
    """(model dir, report) of cfg's warm start, built now unless the cache has it."""
    from polar_fast.model import cache_root

    emit = emit or (lambda kind, data: None)
    tasks = await asyncio.to_thread(demo_tasks, cfg)
    plays = await asyncio.to_thread(demonstrations, cfg, tasks)  # an unsupported harness fails here
    await asyncio.to_thread(check_lengths, cfg, plays)
    key = await asyncio.to_thread(cache_key, cfg, plays)
    root = cache_root() / "warm_start" / key
    report = await asyncio.to_thread(_cached_report, root)
    if report is not None:
        emit("info", {"message": f"warm start: cached ({report['demos_kept']} demonstrations, nll "
                                 f"{report['nll_before']:.3f} -> {report['nll_after']:.3f}) at {root}"})
        return root / "model", {**report, "cached": True}
    started = time.perf_counter()
    work = root.parent / f".{key}.{os.getpid()}"
    await asyncio.to_thread(shutil.rmtree, work, True)
    report = await _build(cfg, tasks, plays, work, emit)
    report["duration_s"] = round(time.perf_counter() - started, 1)
    await asyncio.to_thread(_publish, work, root, report)
    return root / "model", {**report, "cached": False}


def _cached_report(root: Path) -> dict | None:
    path = root / "report.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _publish(work: Path, root: Path, report: dict) -> None:
    """report.json last, then one rename: a cache entry is whole or absent."""
    (work / "report.json").write_text(json.dumps(report, indent=1))
    try:
        work.rename(root)
    except OSError:  # a parallel run built the same one first: its copy is as good
        shutil.rmtree(work, ignore_errors=True)


async def record_demonstrations(cfg: Config, tasks, work: Path, emit=None) -> tuple[int, str]:
    """Each task's teacher demonstration typed through the real harness, proxy and sandbox by
    a scripted policy (PlaybookEngine), those whose tests pass exported as token rows under
    `work/sft_data`. Returns (demonstrations kept, export's report)."""
    from polar_fast.engines.scripted import PlaybookEngine
    from polar_fast.evaluate import evaluate_tasks
    from polar_fast.cluster import rollout_side
    from polar_fast.export import export_run
    from polar_fast.model import load_tokenizer

    emit = emit or (lambda kind, data: None)
    plays = await asyncio.to_thread(demonstrations, cfg, tasks)
    await asyncio.to_thread(check_lengths, cfg, plays)
    tok = await asyncio.to_thread(load_tokenizer, cfg.model.path)
    run_dir = work / "demos" / cfg.harness.name
    await asyncio.to_thread(run_dir.mkdir, parents=True, exist_ok=True)
    async with rollout_side(cfg, run_dir, emit=emit, engine=PlaybookEngine(plays, tok)) as stack:
        records = await evaluate_tasks(stack, tasks, 1, purpose="demo")
    kept = sum(1 for r in records if r.reward is not None and r.reward >= 1.0)
    if kept == 0:
        raise WarmStartError(f"warm start: none of the {len(tasks)} teacher demonstrations passed its tests; "
                             f"the records are in {run_dir}")
    exported = await asyncio.to_thread(export_run, run_dir, work / "sft_data", min_reward=1.0)
    return kept, exported


async def _build(cfg: Config, tasks, plays: dict[str, list[list[str]]], work: Path, emit) -> dict:
    from polar_fast.grpo import Learner
    from polar_fast.learner.sft_process import run_sft_in_process

    ws = cfg.warm_start
    emit("info", {"message": f"warm start: {len(tasks)} teacher demonstrations through {cfg.harness.name} "
                             f"(built once, then cached)"})
    kept, exported = await record_demonstrations(cfg, tasks, work, emit)
    emit("info", {"message": f"warm start: {kept}/{len(tasks)} demonstrations passed; {exported}"})
    sft_cfg = msgspec.structs.replace(cfg, sft=msgspec.structs.replace(cfg.sft, rows_per_step=ws.rows_per_step))
    # in a process of its own: what the sft learner held must not stay beside the run's learner and
    # engine (learner/sft_process.py: the run's peak was 0.6 GiB higher with it built in-process)
    sft = await run_sft_in_process(sft_cfg, work / "sft_data", Learner.from_config, out_dir=work / "model",
                                   epochs=ws.epochs, lr=ws.lr, emit=emit, measure=False)
    return {"demos": len(tasks), "demos_kept": kept, "rows": sft.rows, "trained_tokens": sft.trained_tokens,
            "forwarded_tokens": sft.tokens, "sft_steps": sft.steps, "nll_before": sft.nll_before,
            "nll_after": sft.nll_after, "sft_s": round(sft.duration_s, 1)}
