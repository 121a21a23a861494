"""`python -m polar_fast check --config run.toml`: a preflight that spends no GPU hours.

One line per item, `pass`, `fail` or `n/a`, each with its evidence, and for a failure the fix;
exit status 1 when any item fails. The items, in the order they would cost GPU time:

- config: the settings a training run refuses at start (train.check_run); then (context.py) per
  harness of the run (harness.name and eval.harnesses), its compaction
  threshold, its first request (the real CLI run once against the real proxy and a scripted
  engine, rendered with the run's model: first_request.py) with room for a few turns, and the
  output cap;
- tasks (tasks.py): the task source loads, the held-out tasks are disjoint from training, and
  every Docker image is present locally (missing ones listed with pull commands and their disk);
- engine (engine.py): the vLLM found (or at engine.url) has the version, routes and flags the run
  uses; the learner's and vLLM's GPU sets are visible and disjoint;
- cluster (cluster.py, `cluster.kind = "ray"`): the cluster answers, enough nodes offer the
  rollout resource and each runs the driver's polar_fast, the engine replicas fit its GPUs;
- learner (learner.py): memory per GPU (learner/memory.py, from the model's config alone) against
  the device, and disk for checkpoints at run.keep_checkpoints.

Each check is a function returning Items, so a test can call one with the inputs it needs.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Callable, Literal, TextIO

import msgspec

from polar_fast.config import Config

Status = Literal["pass", "fail", "n/a"]


class Item(msgspec.Struct, frozen=True, kw_only=True):
    area: str  # config | tasks | engine | cluster | learner | disk
    name: str
    status: Status
    evidence: str
    fix: str = ""  # for a failure: what to change
    details: list[str] = []  # lines printed under the item (e.g. the pull commands of missing images)


def passed(area: str, name: str, evidence: str) -> Item:
    return Item(area=area, name=name, status="pass", evidence=evidence)


def failed(area: str, name: str, evidence: str, fix: str, details: list[str] | None = None) -> Item:
    return Item(area=area, name=name, status="fail", evidence=evidence, fix=fix, details=details or [])


def not_applicable(area: str, name: str, why: str) -> Item:
    return Item(area=area, name=name, status="n/a", evidence=why)


def format_item(item: Item) -> str:
    line = f"{item.status:<5} {item.area}: {item.name}: {item.evidence}"
    if item.fix:
        line += f" -> fix: {item.fix}"
    return "\n".join([line, *(f"        {d}" for d in item.details)])


async def collect(cfg: Config, *, nproc_per_node: int = 0, measure: Callable | None = None,
                  emit: Callable[[Item], None] | None = None) -> list[Item]:
    """Every item for `cfg`; `measure(cfg, harness, prompt) -> tokens` replaces the real first
    request (tests). `emit` sees each item as it is decided."""
    from polar_fast.preflight import cluster, context, engine, learner, tasks

    items: list[Item] = []

    def add(new: list[Item]) -> None:
        for item in new:
            items.append(item)
            if emit:
                emit(item)

    add([check_run_settings(cfg)])
    task_items, train = await asyncio.to_thread(tasks.check_tasks, cfg)
    prompt = train[0].problem_statement if train else context.STAND_IN_PROMPT
    add(await context.check_context(cfg, prompt, measure=measure))
    add(task_items)
    add(await asyncio.to_thread(engine.check_engine, cfg))
    add(await asyncio.to_thread(cluster.check_cluster, cfg))
    add(await asyncio.to_thread(learner.check_learner, cfg, nproc_per_node))
    return items


def check_run_settings(cfg: Config) -> Item:
    """What the run refuses at start anyway (train.check_run), said here with the rest."""
    from polar_fast.errors import PolarError
    from polar_fast.train import check_run

    try:
        check_run(cfg)
    except PolarError as e:
        return failed("config", "run settings", str(e), "change the keys it names (docs/config.md)")
    return passed("config", "run settings", "sampling, merge.max_tokens and weight sync are what training accepts")


def run_check(cfg: Config, *, nproc_per_node: int = 0, out: TextIO = sys.stdout,
              measure: Callable | None = None) -> int:
    """Print every item as it is decided; 1 when one failed, else 0."""
    import uvloop

    def show(item: Item) -> None:
        print(format_item(item), file=out, flush=True)

    items = uvloop.run(collect(cfg, nproc_per_node=nproc_per_node, measure=measure, emit=show))
    failures = sum(item.status == "fail" for item in items)
    print(f"check: {len(items)} items, {failures} failed, "
          f"{sum(item.status == 'n/a' for item in items)} n/a", file=out)
    return 1 if failures else 0
