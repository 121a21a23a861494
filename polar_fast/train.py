"""The training run, in one uvloop process:

    tasks -> pools (boot | agent: harness -> proxy -> engine | eval) -> group records
          -> merge + GRPO step (worker thread) -> weight sync -> policy version + 1 -> ...

A finished group arrives as one GroupRecord (rollouts/groups.py: its task, rollouts and their
calls), built by the pools where its last rollout ended; the loop logs its rollouts, queues it,
and hands the step's groups to the learner as they are.

Rollouts keep running while the learner trains (async RL): the pools never wait for a step, only
for room in the ready-groups queue. A group whose oldest call is more than `max_staleness`
policy versions behind the learner is withheld from training and counted; its calls stay in the
record log. Everything captured goes to `<output_dir>/records.log` as it happens, so a crash
loses nothing; checkpoints go to `<output_dir>/checkpoints`, and `resume=True` continues from the
newest with the same step numbering, after removing sandboxes a killed run left behind.

The first step of a run (and the first after a resume) carries the mismatch gate
(learner/mismatch.py): when the engine's behaviour logprobs and the learner's disagree by more
than `learner.max_mismatch_kl`, the run stops before the update with one MismatchError naming
the likely causes. The scripted engines' logprobs are made up, so their runs are not gated.

Under torchrun this is rank 0; ranks > 0 run `distributed.follow` and join every learner call.
With `cluster.kind = "ray"` the rollouts run on the cluster's rollout nodes and this process (the
driver) keeps the learner and the record log (cluster/driver.py); the loop is the same.

Ctrl-C (SIGINT/SIGTERM) asks the run to stop: in-flight rollouts are abandoned (their sandboxes
removed, their calls already logged), a checkpoint is saved, and `train` returns normally. A
second Ctrl-C cancels at once. A learner step in progress stops within a layer's time, before
its update (learner/step_control.py): the checkpoint is the last finished step's, and the
interrupted step's groups are marked `interrupted` in groups.jsonl (their rollouts and calls
stay in records.log; `--resume` does not train them again, it trains on new groups). A long
step prints where it is (micro-batch i of n, tokens, layer) every PROGRESS_EVERY_S.

Every stop is recorded: the rollouts the run leaves in flight (once its last step has its groups, a stop
request, an error such as a checkpoint that cannot be written, a cancellation from outside)
each get an `abandoned` record with the reason and the calls they made, and a `RunEndRecord`
closes the run; the teardown that writes them is shielded, since an anyio scope cancels again
at every await. A run killed or crashed has no such marker; `--resume` then writes the missing `abandoned` records and a
`crashed` marker for it before it starts, so every run in the log ends with one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Callable, Iterable, Sequence

import anyio
import msgspec

from polar_fast.cluster import rollout_side
from polar_fast.config import Config, RunConfig, groups_in_flight
from polar_fast.errors import PolarError
from polar_fast.grpo import Gate, Learner, StepControl, StepInterrupted, trains_on
from polar_fast.learner import distributed
from polar_fast.learner.checkpoint import prune_checkpoints
from polar_fast.learner.distributed import Leader
from polar_fast.learner.weight_sync import WeightSync, weight_sync_for
from polar_fast.pools import Pools
from polar_fast.proxy import Proxy
from polar_fast.records import CALL_CAUSES, Outcome, RolloutRecord, RunEndRecord
from polar_fast.report.metrics import MetricsWriter
from polar_fast.rollouts.groups import FinishedRollout, GroupRecord, GroupSpec
from polar_fast.teachers.guide import Guide
from polar_fast.rollouts.stream import TrainingStream
from polar_fast.rollouts.task_images import check_images
from polar_fast.rollouts.tasks import Task, load_tasks
from polar_fast.signals import StopSignal


Emit = Callable[[str, dict], None]  # on_event(kind, data): progress display


class RunError(PolarError):
    """The run cannot start (output dir in use, no tasks, ...); the message says what to do."""


@dataclass
class RunSummary:
    steps: list[dict] = field(default_factory=list)  # flattened metrics per step
    outcomes: dict[str, int] = field(default_factory=dict)
    groups_trained: int = 0
    groups_withheld: int = 0
    calls: int = 0
    sampled_tokens: int = 0
    leftovers_removed: int = 0
    stopped_early: bool = False
    checkpoint: str = ""
    evals: list[dict] = field(default_factory=list)  # periodic evals: step, split, pass@k, mean reward
    causes: dict[str, dict[str, int]] = field(default_factory=dict)  # harness -> CALL_CAUSES, trained rollouts
    warm_start: dict = field(default_factory=dict)  # warm_start.py's report, when the run has one


def _periodic_eval_tasks(cfg: Config) -> list[Task]:
    """The held-out tasks of the periodic eval ([] when there is none), refused (EvalError) when
    they are training tasks: evaluate.heldout_tasks."""
    if not (cfg.eval.every_steps or cfg.eval.at_start):
        return []
    from polar_fast.evaluate import heldout_tasks

    return heldout_tasks(cfg, cfg.eval.split, cfg.eval.limit)


def save_checkpoint(learner: Learner | Leader, run: RunConfig) -> str:
    """A checkpoint of the learner in `<output_dir>/checkpoints`, then only the newest
    `run.keep_checkpoints` kept (the one just written always is)."""
    directory = Path(run.output_dir) / "checkpoints"
    path = learner.save(str(directory))
    prune_checkpoints(directory, run.keep_checkpoints)
    return path


def _prepare_output_dir(cfg: Config, resume: bool) -> Path:
    out = Path(cfg.run.output_dir)
    has_state = (out / "records.log").exists() or (out / "checkpoints").exists()
    if has_state and not resume:
        raise RunError(f"{out} already holds a run: pass --resume to continue it, or set run.output_dir")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_bytes(msgspec.json.format(msgspec.json.encode(cfg)))
    return out


def check_run(cfg: Config) -> None:
    """What a training run needs of its config, checked before anything starts: sampling the
    learner can reproduce (its logprobs are at `sampling.temperature`, no top-p), and packed
    micro-batches that hold the longest sequence the context allows."""
    if cfg.merge.max_tokens < cfg.model.max_context_tokens:
        raise RunError(f"merge.max_tokens = {cfg.merge.max_tokens} is below model.max_context_tokens = "
                       f"{cfg.model.max_context_tokens}: a full-context sequence would not fit one micro-batch")
    s = cfg.sampling
    if s.from_harness:
        raise RunError("sampling.from_harness = true lets a harness choose the temperature, but the learner computes "
                       "its logprobs at sampling.temperature: the importance ratio would be wrong. Set it false to train")
    if s.top_p < 1:
        raise RunError(f"sampling.top_p = {s.top_p}: the learner does not reproduce top-p truncation, so the importance "
                       "ratio would be wrong. Train with top_p = 1 (temperature is fine)")
    if s.temperature <= 0:
        raise RunError(f"sampling.temperature = {s.temperature}: greedy samples have no logprob the learner can "
                       "reproduce. Train with a temperature > 0")
    e = cfg.engine
    if e.weight_sync == "transfer" and cfg.cluster.kind == "ray":
        raise RunError("engine.weight_sync = \"transfer\" is not supported on a Ray cluster yet (the NCCL group would "
                       "have to span the driver and every replica's node): use weight_sync = \"disk\", which each "
                       "replica's node writes and reloads (docs/scaling.md)")
    if e.weight_sync == "transfer" and (e.kind != "vllm" or not cfg.learner.device.startswith("cuda")):
        raise RunError(f"engine.weight_sync = \"transfer\" broadcasts the weights over NCCL from a GPU learner to vLLM, "
                       f"but engine.kind = {e.kind!r} and learner.device = {cfg.learner.device!r}: use "
                       "engine.kind = \"vllm\" and a cuda learner, or weight_sync = \"disk\"")


async def _close_crashed_run(rollouts, run_dir: Path, step: int, emit: Emit) -> None:
    """Before a resumed run logs anything: when the run before it was killed or crashed (its log
    does not end in a RunEndRecord), an `abandoned` record for each rollout it left without an
    end record (a retried attempt's later attempt ends it), then a `crashed` marker."""
    from polar_fast.report.view.run_data import RunData

    data = RunData(run_dir)
    await asyncio.to_thread(data.refresh)
    if data.ended is not None or not data.rollouts:
        return
    why = "the run was killed or crashed while it ran (no run-end marker); closed by --resume"
    left = [RolloutRecord(rollout_id=row.rollout_id, group_id=row.group_id, task_id=row.task_id,
                          harness=row.harness or rollouts.cfg.harness.name, outcome=Outcome.ABANDONED,
                          n_calls=row.n_calls, error=why) for row in data.unended()]
    await rollouts.proxy.record(*left, RunEndRecord(reason="crashed: no run-end marker (closed by --resume)",
                                                    step=step, abandoned=len(left), ended_at=time.time()))
    emit("info", {"message": f"the run before this one ended without a marker (killed or crashed): "
                             f"{len(left)} rollouts it left in flight recorded as abandoned"})


async def train(cfg: Config, *, resume: bool = False, on_event: Callable[[str, dict], None] | None = None,
                engine=None) -> RunSummary:
    """Run `cfg.run.steps` GRPO steps; see the module docstring. `on_event(kind, data)` receives
    "status" (every second), "step" (after each step), "eval" and "info" events for progress
    display. `engine` replaces the configured engine (tests: a scripted policy)."""
    emit = on_event or (lambda kind, data: None)
    check_run(cfg)
    eval_tasks = await asyncio.to_thread(_periodic_eval_tasks, cfg)  # refused now if they are training tasks
    summary = RunSummary()
    run_dir = await asyncio.to_thread(_prepare_output_dir, cfg, resume)
    if cfg.warm_start.demos:  # learner and engine both start from the warm-started weights
        from polar_fast.warm_start import ensure_warm_start

        warm_dir, summary.warm_start = await ensure_warm_start(cfg, emit)
        cfg = msgspec.structs.replace(cfg, model=msgspec.structs.replace(cfg.model, path=str(warm_dir)))
    tc = cfg.tasks
    tasks = await asyncio.to_thread(load_tasks, tc.source, split=tc.split, limit=tc.limit, shuffle_seed=tc.shuffle_seed,
                                    image=tc.image, families=tc.families or None, per_family=tc.per_family)
    if not tasks:
        raise RunError("the task source yielded no tasks")
    guide = Guide.for_run(cfg.guide, cfg.harness.name, cfg.warm_start.plan)  # a bad guide fails now, before anything starts
    if guide is not None:
        await asyncio.to_thread(guide.prepare, tasks)
    if cfg.sandbox.kind == "docker":  # a missing image is one clear error now, not an infra failure per rollout
        await asyncio.to_thread(check_images, tasks + eval_tasks)
    emit("info", {"message": "loading the model for the learner"})
    # under torchrun, a Leader that has ranks > 0 join each collective call (learner/distributed.py)
    learner = await asyncio.to_thread(lambda: distributed.lead(Learner.from_config(cfg)))
    if resume and await asyncio.to_thread(learner.resume, str(run_dir / "checkpoints")):
        emit("info", {"message": f"resumed at step {learner.step_count}, policy version {learner.version}"})
    stream = TrainingStream(tasks, seed=cfg.run.seed + learner.step_count, group_size=cfg.pools.group_size,
                            guide=guide, retire_after=cfg.tasks.retire_after, step=lambda: learner.step_count)
    metrics = await asyncio.to_thread(lambda: MetricsWriter(
        run_dir, tensorboard=cfg.run.tensorboard, wandb=cfg.run.wandb, wandb_project=cfg.run.wandb_project,
        config=msgspec.to_builtins(cfg)))
    try:
        async with _one_error(), rollout_side(cfg, run_dir, emit=emit, engine=engine) as rollouts:
            summary.leftovers_removed = rollouts.leftovers_removed
            if resume:
                await _close_crashed_run(rollouts, run_dir, learner.step_count, emit)
            sync = rollouts.weight_sync if cfg.cluster.kind == "ray" else weight_sync_for(cfg, rollouts.engine, run_dir)
            if learner.version:  # the engine starts from the resumed policy
                await learner.sync_weights(sync)
            with StopSignal(asyncio.current_task()) as stop:
                evaluator = _PeriodicEval(cfg, eval_tasks, rollouts, metrics, summary, emit)
                pools = Pools.for_rollouts(rollouts, max_groups_in_flight=groups_in_flight(cfg.run),
                                           partial_group_after_s=cfg.run.partial_group_after_s)
                loop = _Loop(rollouts.cfg, learner=learner, sync=sync, pools=pools, proxy=rollouts.proxy,
                             metrics=metrics, summary=summary, stop=stop.event, emit=emit, evaluator=evaluator,
                             stopped_by=lambda: stop.signal, gate=first_step_gate(cfg, rollouts.engine),
                             stream=stream)
                pools.on_late = loop.on_late
                try:
                    if cfg.eval.at_start and learner.step_count == 0:
                        await evaluator.run(0)
                    await loop.run(stream)
                    summary.checkpoint = await asyncio.to_thread(save_checkpoint, learner, cfg.run)
                except Exception as e:
                    loop.failed(e)
                    raise
                finally:
                    await loop.record_end()
        await asyncio.to_thread(distributed.stop_followers, learner)
    finally:
        with anyio.CancelScope(shield=True):
            await asyncio.to_thread(metrics.close)
    return summary


def first_step_gate(cfg: Config, engine) -> Gate | None:
    """The mismatch gate of the run's first step: None when learner.max_mismatch_kl is 0 or the
    engine's logprobs are made up (engines/scripted.py: tests and dry runs)."""
    if cfg.learner.max_mismatch_kl <= 0 or getattr(engine, "made_up_logprobs", False):
        return None
    return Gate.for_run(cfg)


@contextlib.asynccontextmanager
async def _one_error() -> AsyncIterator[None]:
    """One of our errors (a PolarError: the gate's MismatchError, a checkpoint that cannot be
    written) leaves the run as itself, its one message intact, not inside the exception groups
    of the TaskGroups it passes (proxy, loop)."""
    try:
        yield
    except BaseExceptionGroup as group:
        if isinstance(error := _the_error(group), PolarError):
            raise error from None
        raise


def _the_error(group: BaseExceptionGroup) -> BaseException | None:
    """The one error inside nested task-group wrappers (cancellations aside), else None."""
    leaves = _leaves(group)
    return leaves[0] if len(leaves) == 1 else None


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for e in error.exceptions for leaf in _leaves(e)]
    return [] if isinstance(error, asyncio.CancelledError) else [error]


END_RECORD_TIMEOUT_S = 60  # writing the abandoned records and the run-end marker
PROGRESS_EVERY_S = 30.0  # a learner step still running says where it is this often


class _Loop:
    """Pools and learner side by side; ends after the last step or at a stop request."""

    def __init__(self, cfg: Config, *, learner: Learner | Leader, sync: WeightSync, pools: Pools, proxy: Proxy,
                 metrics: MetricsWriter, summary: RunSummary, stop: asyncio.Event, emit: Emit,
                 evaluator: _PeriodicEval | None = None, stopped_by: Callable[[], str] = lambda: "",
                 gate: Gate | None = None, stream: TrainingStream | None = None) -> None:
        self.cfg, self.learner, self.sync, self.pools, self.proxy = cfg, learner, sync, pools, proxy
        self.metrics, self.summary, self.stop, self.emit, self.evaluator = metrics, summary, stop, emit, evaluator
        self.stopped_by = stopped_by  # the signal that asked for a stop
        self.gate = gate  # the mismatch gate, for the first step only
        self.stream = stream  # told every group's rewards (difficulty filtering)
        self.ready: asyncio.Queue[GroupRecord] = asyncio.Queue(maxsize=max(cfg.run.groups_per_step, 1))
        self.end_reason = ""  # why the run ends, for the abandoned records and the run-end marker
        self.abandoned = 0
        self._logged: set[str] = set()  # rollouts whose end record is in the log

    async def run(self, tasks: Iterable[Task | GroupSpec]) -> None:
        try:
            await self._rollouts_and_learner(tasks)
        finally:
            await self._abandon()
        # the last eval runs alone: rollouts for a step that will never come would only slow it down
        if self._evaluates(self.learner.step_count, final=True) and not self.summary.stopped_early:
            await self.evaluator.run(self.learner.step_count)

    async def _rollouts_and_learner(self, tasks: Iterable[Task | GroupSpec]) -> None:
        """Until the last step or a stop; sets end_reason on every way out. One of our errors
        (the gate's MismatchError, a checkpoint that cannot be written) leaves as itself, not in
        a group."""
        try:
            async with asyncio.TaskGroup() as tg:
                pools = tg.create_task(self.pools.run(tasks, self.on_group))
                status = tg.create_task(self._report_status())
                try:
                    await self._learn(stop_rollouts=pools.cancel)
                finally:
                    pools.cancel()  # abandons in-flight rollouts; the pools remove their sandboxes
                    status.cancel()
        except BaseExceptionGroup as group:
            error = _the_error(group) or group
            self.failed(error)
            if isinstance(error, PolarError):
                raise error from None
            raise
        if self.summary.stopped_early:
            self.end_reason = f"stopped: {self.stopped_by() or 'stop requested'}"
        else:
            self.end_reason = f"finished: {self.learner.step_count} of {self.cfg.run.steps} steps done"

    def failed(self, error: BaseException) -> None:
        if not self.end_reason.startswith("error"):
            self.end_reason = f"error: {type(error).__name__}: {error}"

    async def _abandon(self) -> None:
        """An end record for each rollout the pools left in flight (Pools.abandon)."""
        self.end_reason = self.end_reason or "cancelled"
        left = [r.record for r in self.pools.abandon(f"the run ended ({self.end_reason})")
                if r.record.rollout_id not in self._logged]
        for record in left:  # counted first: a cancellation may still cut the wait for the write short
            self.summary.outcomes[record.outcome.value] = self.summary.outcomes.get(record.outcome.value, 0) + 1
        self.abandoned = sum(r.outcome is Outcome.ABANDONED for r in left)
        await self._write_end(*left)

    async def record_end(self) -> None:
        """The run-end marker, after everything the run logged."""
        self.end_reason = self.end_reason or "cancelled"
        await self._write_end(RunEndRecord(reason=self.end_reason, step=self.learner.step_count,
                                           abandoned=self.abandoned, ended_at=time.time()))

    async def _write_end(self, *records) -> None:
        """Records of the run's end. When the run is already failing (the record log's disk may
        be what failed) a write that fails is reported, never put in front of that error."""
        try:  # shielded: a run cancelled from outside (an anyio scope cancels at every await) still records its end
            with anyio.CancelScope(shield=True), anyio.move_on_after(END_RECORD_TIMEOUT_S):
                await self.proxy.record(*records)
        except Exception as e:
            if not self.end_reason.startswith("error"):
                raise
            self.emit("info", {"message": f"the end of the run could not be recorded: {type(e).__name__}: {e}"})

    def _evaluates(self, step: int, *, final: bool = False) -> bool:
        every, last = self.cfg.eval.every_steps, self.cfg.run.steps
        if not every or self.evaluator is None or not step:
            return False
        return step == last if final else (step % every == 0 and step < last)

    async def on_group(self, group: GroupRecord) -> None:
        """The pools' callback: log the group's rollouts, then queue it for the learner (a full
        queue holds the pools back)."""
        for rollout in group.rollouts:
            await self._log(rollout)
        await self.ready.put(group)

    async def on_late(self, rollout: FinishedRollout) -> None:
        """A straggler whose group already trained without it (run.partial_group_after_s):
        logged, never trained; its calls are in records.log."""
        await self._log(rollout)

    async def _log(self, rollout: FinishedRollout) -> None:
        await self.proxy.record(rollout.record)
        self._logged.add(rollout.record.rollout_id)
        outcome = rollout.record.outcome.value
        self.summary.outcomes[outcome] = self.summary.outcomes.get(outcome, 0) + 1

    async def _next_group(self) -> GroupRecord | None:
        """The next finished group, or None once a stop was requested (also when groups are
        ready: a stop asked during a step or its weight sync ends the run after that step)."""
        if self.stop.is_set():
            return None
        get = asyncio.ensure_future(self.ready.get())
        stopped = asyncio.ensure_future(self.stop.wait())
        try:
            done, _ = await asyncio.wait({get, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when cancelled: neither waiter outlives the call
            stopped.cancel()
            get.cancel()  # a no-op once it holds its group
        return get.result() if get in done and not self.stop.is_set() else None

    async def _learn(self, stop_rollouts: Callable[[], object] = lambda: None) -> None:
        cfg = self.cfg.run
        while self.learner.step_count < cfg.steps:
            groups: list[GroupRecord] = []
            withheld: list[str] = []
            skipped: list[GroupRecord] = []
            while len(groups) < cfg.groups_per_step:
                group = await self._next_group()
                if group is None:
                    self.summary.stopped_early = True
                    return
                if self.stream is not None:
                    self.stream.observe(group)
                oldest = group.oldest_version
                if oldest is not None and self.learner.version - oldest > cfg.max_staleness:
                    withheld.append(group.group_id)  # its calls stay in records.log; it just does not train
                    continue
                if len(skipped) < cfg.zero_variance_skips and not trains_on(group, self.cfg.learner):
                    skipped.append(group)  # all rewards equal: no advantage, nothing to learn; wait for another
                    continue
                groups.append(group)
            if self.learner.step_count + 1 == cfg.steps:
                # the last step has its groups: rollouts for a step that will never come would be
                # abandoned at its end anyway; stopped now, they take no CPU or memory from it
                stop_rollouts()
            await self._step(groups, withheld, skipped)

    async def _step(self, groups: list[GroupRecord], withheld_ids: list[str],
                    skipped: Sequence[GroupRecord] = ()) -> None:
        withheld = len(withheld_ids)
        calls = [c for g in groups for c in g.calls]
        rollouts = [r for g in groups for r in g.records]
        started = time.perf_counter()
        gate, self.gate = self.gate, None
        step = await self._learner_step(groups, gate)
        if step is None:  # a stop request interrupted it: nothing of it was applied
            self.summary.stopped_early = True
            await self.metrics.write_groups(self.learner.step_count + 1, [(g.group_id, "interrupted") for g in groups])
            self.emit("info", {"message": f"stopped during learner step {self.learner.step_count + 1}: its "
                                          f"{len(groups)} groups were not trained (their rollouts are in records.log)"})
            return
        await self.learner.sync_weights(self.sync)
        if step.step % self.cfg.run.checkpoint_every == 0:
            await asyncio.to_thread(save_checkpoint, self.learner, self.cfg.run)
        call_tokens = sum(len(c.prompt_ids) + len(c.completion_ids) for c in calls)
        sampled = sum(len(c.completion_ids) for c in calls)
        self.summary.groups_trained += len(groups)
        self.summary.groups_withheld += withheld
        self.summary.calls += len(calls)
        self.summary.sampled_tokens += sampled
        stats = self.pools.statistics()
        values = {
            "learner": msgspec.structs.asdict(step),
            # over every group this step finished, skipped ones too: the curve is the policy's, not the filter's
            "reward": {**_reward_stats([*groups, *skipped]), "skipped_groups": len(skipped)},
            "outcomes": _outcome_counts(rollouts),
            "causes": _cause_counts(rollouts),
            "pools": {s.name: {"busy_fraction": s.busy_fraction, "queued": s.queued, "running": s.running}
                      for s in (stats.boot, stats.agent, stats.eval)},
            "stragglers": {"running": stats.stragglers, "oldest_s": stats.oldest_straggler_s,
                           "groups_in_flight": stats.groups_in_flight, "partial_groups": stats.partial_groups},
            "proxy": {"calls": len(calls), "call_tokens": call_tokens, "sampled_tokens": sampled},
            "merge": {"tokens_forwarded": step.n_tokens,
                      "per_call_over_merged": call_tokens / step.n_tokens if step.n_tokens else 0.0},
            "staleness": {"max": max((self.learner.version - 1 - (g.oldest_version or 0) for g in groups), default=0),
                          "withheld_groups": withheld},
            "step_time_s": time.perf_counter() - started,
            # calls a guide answered (never trained) per trained rollout, and tasks retired from the stream
            "guide": {"calls_per_rollout": sum(len(r.calls) - len(r.sampled_calls) for g in groups for r in g.rollouts)
                      / max(len(rollouts), 1)},
            "tasks": {"retired": len(self.stream.retired) if self.stream is not None else 0},
        }
        for harness, counts in values["causes"].items():
            total = self.summary.causes.setdefault(harness, dict.fromkeys(CALL_CAUSES, 0))
            for cause, n in counts.items():
                total[cause] = total.get(cause, 0) + n
        flat = await self.metrics.write(step.step, values)
        await self.metrics.write_groups(step.step, [(g.group_id, "trained") for g in groups]
                                        + [(g, "withheld") for g in withheld_ids]
                                        + [(g.group_id, "skipped") for g in skipped])
        self.summary.steps.append(flat)
        self.emit("step", flat)
        if self._evaluates(step.step):
            await self.evaluator.run(step.step)

    async def _learner_step(self, groups: list[GroupRecord], gate: Gate | None):
        """The learner step in a worker thread, watched: a stop request interrupts it (None), and
        while it runs it says where it is every PROGRESS_EVERY_S."""
        control = StepControl()
        number = self.learner.step_count + 1
        work = asyncio.ensure_future(asyncio.to_thread(self.learner.step, groups, gate=gate, control=control))
        stopped = asyncio.ensure_future(self.stop.wait())
        try:
            while not work.done():
                await asyncio.wait({work, stopped}, timeout=PROGRESS_EVERY_S, return_when=asyncio.FIRST_COMPLETED)
                if stopped.done():
                    control.stop.set()
                    await asyncio.wait({work})
                elif not work.done():
                    self.emit("info", {"message": f"learner step {number}: {control.describe()}"})
        finally:
            stopped.cancel()
            if not work.done():  # cancelled from outside: the thread stops at its next check
                control.stop.set()
                work.add_done_callback(lambda f: f.cancelled() or f.exception())  # its StepInterrupted is expected
        try:
            return await work
        except StepInterrupted:
            return None

    async def _report_status(self) -> None:
        while True:
            stats = self.pools.statistics()
            self.emit("status", {
                "queued": stats.boot.queued, "booting": stats.boot.running, "running": stats.agent.running,
                "evaluating": stats.eval.running, "rollouts_done": stats.rollouts_done,
                "stragglers": stats.stragglers, "oldest_straggler_s": round(stats.oldest_straggler_s, 1),
                "groups_ready": self.ready.qsize(), "calls_in_flight": self.proxy.state.calls_in_flight,
                "step": self.learner.step_count, "version": self.learner.version,
                "waiting_for_disk": stats.waiting_for_disk,
            })
            await asyncio.sleep(1.0)


def _reward_stats(groups: Sequence[GroupRecord]) -> dict[str, float]:
    import statistics

    scored = [r.reward for g in groups for r in g.records if r.reward is not None]
    per_group_std = []
    for g in groups:
        rewards = [r.reward for r in g.records if r.reward is not None]
        if len(rewards) > 1:
            per_group_std.append(statistics.pstdev(rewards))
    return {
        "mean": statistics.fmean(scored) if scored else 0.0,
        "std": statistics.pstdev(scored) if len(scored) > 1 else 0.0,
        "group_std_mean": statistics.fmean(per_group_std) if per_group_std else 0.0,
        "zero_variance_groups": sum(1 for s in per_group_std if s == 0.0),
        "groups": len(per_group_std),  # groups with two or more scored rollouts (those the line above counts over)
    }


def _cause_counts(rollouts) -> dict[str, dict[str, int]]:
    """Per harness: how often each cause of a zero reward happened (records.CALL_CAUSES), and
    how many rollouts scored 0."""
    out: dict[str, dict[str, int]] = {}
    for r in rollouts:
        counts = out.setdefault(r.harness, {**dict.fromkeys(CALL_CAUSES, 0), "zero_reward": 0})
        for cause, n in r.causes.items():
            counts[cause] = counts.get(cause, 0) + n
        counts["zero_reward"] += r.reward == 0.0
    return out


class _PeriodicEval:
    """Held-out evaluation during training (eval.every_steps) on the run's own rollout stack,
    beside the training rollouts; logged to metrics.jsonl / TensorBoard under `eval/`."""

    def __init__(self, cfg: Config, tasks: list[Task], rollouts, metrics: MetricsWriter, summary: RunSummary,
                 emit) -> None:
        self.cfg, self.rollouts, self.metrics, self.summary, self.emit = cfg, rollouts, metrics, summary, emit
        self._tasks = tasks

    async def run(self, step: int) -> None:
        from polar_fast.evaluate import evaluate_tasks, score_harness

        ec = self.cfg.eval
        self.emit("info", {"message": f"evaluating step {step}: {len(self._tasks)} {ec.split} tasks x {ec.samples}"})
        started = time.perf_counter()
        records = await evaluate_tasks(self.rollouts, self._tasks, ec.samples)
        score = score_harness(self.cfg.harness.name, records, ec.k, [t.instance_id for t in self._tasks])
        values = {"eval": {f"pass@{k}": v for k, v in score.pass_at.items() if v is not None}
                  | {"mean_reward": score.mean_reward or 0.0, "infra_failures": score.outcomes["infra_error"],
                     "duration_s": time.perf_counter() - started}}
        await self.metrics.write(step, values)
        entry = {"step": step, "split": ec.split, "tasks": score.tasks, "samples": ec.samples,
                 "pass_at": score.pass_at, "mean_reward": score.mean_reward, "causes": score.causes,
                 # each task's pass@1 (share of its scored samples that passed): the summary's paired interval
                 "per_task": {t.task_id: t.passed / t.scored for t in score.per_task if t.scored}}
        self.summary.evals.append(entry)
        self.emit("eval", entry)


def _outcome_counts(rollouts) -> dict[str, int]:
    counts = {o.value: 0 for o in Outcome}
    for r in rollouts:
        counts[r.outcome.value] += 1
    return counts
