"""The three worker pools: boot -> agent -> eval, joined by bounded queues.

    pools = Pools(cfg.pools, factory, agent, agent_timeout_s=cfg.harness.timeout_s)
    # or, on an open rollout stack (rollouts/stack.py): pools = Pools.for_rollouts(rollouts)
    await pools.run(tasks, on_group)   # on_group(GroupRecord) is awaited once per finished group

- boot: `boot_workers` create + start + prepare a sandbox (the task repo at base_commit, history
  scrubbed). A box token is held from boot until the agent is done with the box; there are
  `agent_workers + prewarm` tokens, so `prewarm` sandboxes are booted ahead of demand and no more.
- agent: `agent_workers` run the agent runner (a harness, or a scripted command in tests) with a
  hard timeout that kills its process tree, collect the diff, remove the box. The runner hands
  back the calls it captured, also when the hard timeout cut it off.
- eval: `eval_workers` score the diff in a fresh sandbox from the same image (rollouts/reward.py), so long
  test runs never hold an agent slot.
Each task yields one group of `group_size` rollouts (a `GroupSpec` item instead names its own
group id and size; the task source may be an async iterable, e.g. a memory stream that a
service feeds); when all its rollouts have a final record, the grouper builds the group's one
`GroupRecord` (rollouts/groups.py: the task, each rollout's record, calls, diff and test results)
and awaits `on_group` with it. A slow `on_group` fills the queues behind it and finally stops the
producer: backpressure all the way to the task list.

Stragglers: groups finish in any order, so a rollout that hangs up to its timeout delays only
its own group while the others run on. `max_groups_in_flight` (0 = only the queues bound it;
the training run passes `run.groups_in_flight`) caps the groups started but not finished: the
producer starts no new group past it, which bounds how far rollouts run ahead of the learner.
A straggler is a rollout still running when only its group's last quarter (at least its last
one) is; statistics() counts them and gives the longest time a group has waited on its own. With `partial_group_after_s` > 0 (off by default) a group
whose stragglers have waited that long goes to `on_group` without them: it then holds only its
finished members, and GRPO's advantage is taken over those, which biases learning toward short
rollouts (the long ones are exactly those left out). The late rollouts still finish and are
recorded, and go to `on_late` as FinishedRollouts (never trained).

Outcomes: ok (reward from the tests), agent_error, timeout and diff_too_large (its diff passed
the sandbox's output cap; reward 0, no eval), infra_error (sandbox died or would not boot,
evaluation sandbox failed): retried up to `infra_retries` times with a fresh sandbox and a new
rollout id (`<id>.a<attempt>`; the calls captured during a failed attempt never join the group,
they stay in the record log), then recorded with reward None, never as 0. A box that fills its
own disk (sandbox.disk_mb) is the agent's doing: its diff is read without writing to the box and
scored as usual.

Disk: with a `reserve` (rollouts/admission.py; the rollout stack makes one) a boot, and an
evaluation box, waits while the host's disks are short, and statistics() says why. A run that
stops cancels `run`; `abandon(reason)` then gives what its groups in flight leave, an `abandoned`
record for each rollout that was still booting, running or being evaluated.

Structure: every worker lives in one anyio task group; streams are closed in order so workers
exit when their input ends. The boot queue accepts retries without blocking (its new-job part is
bounded by a semaphore), which keeps the retry path free of cycles. Boxes waiting in a queue are
owned by the pools and removed in `run`'s shielded finally, so cancelling a run mid-way (or an
error, or Ctrl-C) leaves no sandbox behind.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import math
import time
from typing import TYPE_CHECKING, Any, AsyncIterable, Awaitable, Callable, Iterable

import anyio
import msgspec

from polar_fast.config import PoolsConfig
from polar_fast.records import CallRecord, Outcome, RolloutRecord, attempt_id
from polar_fast.rollouts.admission import DiskReserve
from polar_fast.rollouts.agent import AgentInfraError, AgentResult, AgentRunner
from polar_fast.rollouts.groups import FinishedRollout, GroupRecord, GroupSpec, group_specs
from polar_fast.rollouts.reward import EvalResult, evaluate
from polar_fast.rollouts.sandboxes import SandboxError, SandboxSpec
from polar_fast.rollouts.tasks import DiffTooLarge, Task, TaskError, prepare_repo, repo_diff

if TYPE_CHECKING:
    from polar_fast.rollouts.stack import Rollouts

HISTOGRAM_BOUNDS_S = (0.1, 0.3, 1, 3, 10, 30, 100, 300, 1000, 3000)  # upper bucket edges, seconds
INFRA_ERRORS = (SandboxError, TaskError, TimeoutError, OSError)
KILL_GRACE_S = 30.0  # past the agent's own timeout, the pool cancels the run itself


# ------------------------------------------------------------------------------------ statistics


class StageStatistics(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    workers: int
    running: int  # items being worked on now
    queued: int  # items waiting in this stage's input queue
    completed: int
    failed: int  # items that ended in an infra error at this stage
    busy_fraction: float  # worker-seconds busy / (workers * seconds since start)
    oldest_running_s: float
    histogram: list[int]  # counts per HISTOGRAM_BOUNDS_S bucket, last = above the top edge
    mean_s: float


class PoolsStatistics(msgspec.Struct, frozen=True, kw_only=True):
    boot: StageStatistics
    agent: StageStatistics
    eval: StageStatistics
    groups_done: int
    rollouts_done: int
    retries: int
    elapsed_s: float
    groups_in_flight: int = 0  # started, not yet handed to on_group
    stragglers: int = 0  # rollouts still running while the rest of their group is final
    oldest_straggler_s: float = 0.0  # longest such wait, since the group's other rollouts finished
    partial_groups: int = 0  # groups handed on without their stragglers (partial_group_after_s)
    waiting_for_disk: str = ""  # why boots wait now (the disk reserve, rollouts/admission.py); "" = they do not


class _Stage:
    def __init__(self, name: str, workers: int, clock: Callable[[], float]) -> None:
        self.name, self.workers, self.clock = name, workers, clock
        self.started_at = clock()
        self.running: dict[int, float] = {}
        self.busy_s = 0.0
        self.completed = self.failed = 0
        self.histogram = [0] * (len(HISTOGRAM_BOUNDS_S) + 1)
        self.total_s = 0.0
        self._next = 0
        self.queue: Any = None  # a memory stream, for its buffer statistics

    @contextlib.contextmanager
    def busy(self):
        key, self._next = self._next, self._next + 1
        self.running[key] = self.clock()
        try:
            yield
        finally:
            duration = self.clock() - self.running.pop(key)
            self.busy_s += duration
            self.total_s += duration
            self.completed += 1
            self.histogram[bisect.bisect_left(HISTOGRAM_BOUNDS_S, duration)] += 1

    def statistics(self) -> StageStatistics:
        now = self.clock()
        elapsed = max(now - self.started_at, 1e-9)
        busy = self.busy_s + sum(now - t for t in self.running.values())
        queued = self.queue.statistics().current_buffer_used if self.queue is not None else 0
        return StageStatistics(
            name=self.name, workers=self.workers, running=len(self.running), queued=queued,
            completed=self.completed, failed=self.failed,
            busy_fraction=min(busy / (self.workers * elapsed), 1.0),
            oldest_running_s=max((now - t for t in self.running.values()), default=0.0),
            histogram=list(self.histogram), mean_s=self.total_s / self.completed if self.completed else 0.0,
        )


# ----------------------------------------------------------------------------------------- pools


class _Job(msgspec.Struct, kw_only=True):
    task: Task
    group_id: str
    index: int  # position in the group
    group_size: int
    attempt: int = 0
    started_at: float = 0.0
    guide: list[str] = []  # GroupSpec.guide: replies that answer its first calls

    @property
    def rollout_id(self) -> str:
        return attempt_id(f"{self.group_id}-r{self.index}", self.attempt)


class _Final(msgspec.Struct, kw_only=True):
    job: _Job
    rollout: FinishedRollout


class _InFlight(msgspec.Struct, kw_only=True):
    """A rollout past the boot queue whose group has not been handed on (see Pools.abandon)."""

    job: _Job
    stage: str  # what it was doing, in words
    calls: list[CallRecord] = []  # the list its agent appends to
    final: FinishedRollout | None = None  # its record, once it ended


class Pools:
    def __init__(
        self,
        cfg: PoolsConfig,
        factory: Any,
        agent: AgentRunner,
        *,
        agent_timeout_s: float,
        eval_factory: Any = None,
        prepare: Callable[[Any, Task], Awaitable[None]] = prepare_repo,
        collect_diff: Callable[[Any, Task], Awaitable[str]] | None = None,
        score: Callable[..., Awaitable[EvalResult]] = evaluate,
        clock: Callable[[], float] = time.monotonic,
        max_groups_in_flight: int = 0,
        partial_group_after_s: float = 0.0,
        on_late: Callable[[FinishedRollout], Awaitable[None]] | None = None,
        reserve: DiskReserve | None = None,
    ) -> None:
        self.cfg = cfg
        self.factory = factory
        self.eval_factory = eval_factory or factory
        self.agent = agent
        self.agent_timeout_s = agent_timeout_s
        self.prepare = prepare
        self.collect_diff = collect_diff or (lambda box, task: repo_diff(box, task.base_commit))
        self.score = score
        self.clock = clock
        self._stages = {n: _Stage(n, w, clock) for n, w in
                        (("boot", cfg.boot_workers), ("agent", cfg.agent_workers), ("eval", cfg.eval_workers))}
        self._live: set[Any] = set()  # booted boxes not yet removed
        self._groups_done = self._rollouts_done = self._retries = 0
        self._started_at = clock()
        self.max_groups_in_flight = max_groups_in_flight
        self.partial_group_after_s = partial_group_after_s
        self.on_late = on_late
        self._in_flight: dict[str, int] = {}  # group id -> rollouts not yet final
        self._straggling: dict[str, float] = {}  # group id -> when only its stragglers were left
        self._partial: set[str] = set()  # groups handed on without their stragglers
        self._partial_groups = 0
        self.reserve = reserve  # boots (and evaluation boxes) wait while the host's disks are short
        self._flying: dict[str, _InFlight] = {}  # rollout id -> what abandon() needs

    @classmethod
    def for_rollouts(cls, rollouts: Rollouts, *, group_size: int | None = None, **options: Any) -> Pools:
        """Pools on an open rollout stack: its sandbox factory and harness agent, the run's pools
        config and reward mode. group_size: per group (evaluation samples); options: the keywords
        above (max_groups_in_flight, partial_group_after_s, on_late). A Ray cluster's driver
        (cluster/driver.py) brings pools of its own that hand each group to a rollout node."""
        cfg = rollouts.cfg
        if cfg.cluster.kind == "ray" and hasattr(rollouts, "cluster_pools"):
            return rollouts.cluster_pools(group_size=group_size, **options)
        pools_cfg = cfg.pools if group_size is None else msgspec.structs.replace(cfg.pools, group_size=group_size)
        score = evaluate if cfg.tasks.reward == "binary" else functools.partial(evaluate, mode=cfg.tasks.reward)
        return cls(pools_cfg, rollouts.factory, rollouts.agent, agent_timeout_s=cfg.harness.timeout_s, score=score,
                   reserve=rollouts.reserve, **options)

    def statistics(self) -> PoolsStatistics:
        return PoolsStatistics(
            boot=self._stages["boot"].statistics(), agent=self._stages["agent"].statistics(),
            eval=self._stages["eval"].statistics(), groups_done=self._groups_done,
            rollouts_done=self._rollouts_done, retries=self._retries, elapsed_s=self.clock() - self._started_at,
            groups_in_flight=len(self._in_flight) - len(self._partial),
            stragglers=sum(self._in_flight.get(g, 0) for g in self._straggling),
            oldest_straggler_s=max((self.clock() - t for t in self._straggling.values()), default=0.0),
            partial_groups=self._partial_groups,
            waiting_for_disk=self.reserve.waiting if self.reserve is not None else "",
        )

    def abandon(self, reason: str) -> list[FinishedRollout]:
        """After `run` ended early: what its groups in flight leave. A rollout that finished in
        a group that did not keeps its record; one still booting, running or being evaluated gets
        an `abandoned` record with `reason`, what it was doing and the calls it made. Rollouts
        still queued for a box never started and are not listed."""
        out = []
        for flying in self._flying.values():
            job = flying.job
            if flying.final is not None:
                out.append(flying.final)
                continue
            record = RolloutRecord(
                rollout_id=job.rollout_id, group_id=job.group_id, task_id=job.task.instance_id,
                harness=self.agent.name, outcome=Outcome.ABANDONED, reward=None, n_calls=len(flying.calls),
                duration_s=self.clock() - job.started_at, attempt=job.attempt,
                error=f"{reason}, while {flying.stage} ({len(flying.calls)} model calls)",
            )
            out.append(FinishedRollout(record=record, calls=list(flying.calls)))
        self._flying.clear()
        return out

    async def run(self, tasks: Iterable[Task | GroupSpec] | AsyncIterable[Task | GroupSpec],
                  on_group: Callable[[GroupRecord], Awaitable[None]]) -> None:
        cfg = self.cfg
        self._started_at = self.clock()
        for stage in self._stages.values():
            stage.started_at = self._started_at
        self._boot_tx, boot_rx = anyio.create_memory_object_stream[_Job](math.inf)
        self._new_slots = anyio.Semaphore(cfg.queue_size)
        self._box_tokens = anyio.Semaphore(cfg.agent_workers + cfg.prewarm)
        ready_tx, ready_rx = anyio.create_memory_object_stream[tuple](cfg.agent_workers + cfg.prewarm)
        eval_tx, eval_rx = anyio.create_memory_object_stream[tuple](cfg.queue_size)
        done_tx, done_rx = anyio.create_memory_object_stream[_Final](cfg.queue_size)
        self._stages["boot"].queue, self._stages["agent"].queue = boot_rx, ready_rx
        self._stages["eval"].queue = eval_rx
        self._unfinished = 0
        self._producer_done = False
        self._group_slots = anyio.Semaphore(self.max_groups_in_flight) if self.max_groups_in_flight > 0 else None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._grouper, done_rx, on_group)
                tg.start_soon(self._producer, tasks)
                for _ in range(cfg.boot_workers):
                    tg.start_soon(self._boot_worker, boot_rx.clone(), ready_tx.clone(), done_tx.clone())
                for _ in range(cfg.agent_workers):
                    tg.start_soon(self._agent_worker, ready_rx.clone(), eval_tx.clone(), done_tx.clone())
                for _ in range(cfg.eval_workers):
                    tg.start_soon(self._eval_worker, eval_rx.clone(), done_tx.clone())
                for stream in (boot_rx, ready_tx, ready_rx, eval_tx, eval_rx, done_tx):
                    stream.close()  # only the workers' clones keep each stream open
        finally:
            with anyio.CancelScope(shield=True):
                self._boot_tx.close()
                for stream in (ready_rx, eval_rx, done_rx):
                    stream.close()
                await self._remove_live()

    # -------------------------------------------------------------------------- producer + grouper

    async def _producer(self, tasks: Iterable[Task | GroupSpec] | AsyncIterable[Task | GroupSpec]) -> None:
        async for spec in group_specs(tasks, self.cfg.group_size):
            await self._produce(spec)
        self._producer_done = True
        self._maybe_close_boot()

    async def _produce(self, item: GroupSpec) -> None:
        if self._group_slots is not None:
            await self._group_slots.acquire()  # released when the group goes to on_group
        self._in_flight[item.group_id] = item.group_size
        for index in range(item.group_size):
            await self._new_slots.acquire()
            self._unfinished += 1
            self._boot_tx.send_nowait(_Job(task=item.task, group_id=item.group_id, index=index,
                                           group_size=item.group_size, attempt=item.first_attempt,
                                           started_at=self.clock(), guide=item.guide))

    def _maybe_close_boot(self) -> None:
        if self._producer_done and self._unfinished == 0:
            self._boot_tx.close()  # every rollout is final: the stages wind down in order

    async def _grouper(self, done_rx, on_group) -> None:
        pending: dict[str, dict[int, _Final]] = {}
        # with partial groups on, wake up now and then to hand on groups whose stragglers waited too long
        poll_s = self.partial_group_after_s / 4 if self.partial_group_after_s > 0 else math.inf
        async with done_rx:
            while True:
                final = None
                with anyio.move_on_after(poll_s):
                    try:
                        final = await done_rx.receive()
                    except anyio.EndOfStream:
                        return
                if final is not None:
                    await self._take_final(final, pending, on_group)
                    self._unfinished -= 1
                    self._maybe_close_boot()
                if self.partial_group_after_s > 0:
                    await self._hand_on_partial(pending, on_group)

    async def _take_final(self, final: _Final, pending: dict[str, dict[int, _Final]], on_group) -> None:
        job = final.job
        self._rollouts_done += 1
        self._in_flight[job.group_id] -= 1
        left = self._in_flight[job.group_id]
        if left == 0:
            del self._in_flight[job.group_id]
            self._straggling.pop(job.group_id, None)
        if job.group_id in self._partial:  # its group went on without it: recorded, never trained
            if left == 0:
                self._partial.discard(job.group_id)
            if self.on_late is not None:
                await self.on_late(final.rollout)
            self._flying.pop(job.rollout_id, None)
            return
        group = pending.setdefault(job.group_id, {})
        group[job.index] = final
        if left == 0:
            del pending[job.group_id]
            await self._hand_on(job.group_id, [group[i] for i in range(job.group_size)], on_group)
        elif left <= max(1, job.group_size // 4) and job.group_id not in self._straggling:
            self._straggling[job.group_id] = self.clock()  # only its last quarter is still running

    async def _hand_on_partial(self, pending: dict[str, dict[int, _Final]], on_group) -> None:
        now = self.clock()
        for group_id, since in list(self._straggling.items()):
            finals = pending.get(group_id, {})
            if group_id in self._partial or now - since < self.partial_group_after_s or len(finals) < 2:
                continue  # an advantage needs at least two finished members
            del pending[group_id]
            self._partial.add(group_id)
            self._partial_groups += 1
            await self._hand_on(group_id, [finals[i] for i in sorted(finals)], on_group)

    async def _hand_on(self, group_id: str, finals: list[_Final], on_group) -> None:
        """The group's record, built here where its last rollout ended, goes to `on_group`."""
        await on_group(GroupRecord(group_id=group_id, task=finals[0].job.task, rollouts=[f.rollout for f in finals]))
        for f in finals:  # only now: a stop while on_group runs leaves them to abandon()
            self._flying.pop(f.job.rollout_id, None)
        self._groups_done += 1
        if self._group_slots is not None:
            self._group_slots.release()

    def _final(self, job: _Job, outcome: Outcome, *, reward: float | None, n_calls: int = 0, error: str = "",
               causes: dict[str, int] | None = None, calls: list[CallRecord] | None = None, diff: str = "",
               scored: EvalResult | None = None) -> _Final:
        """The rollout's final record, with what it captured (calls) and what scored it (diff, eval)."""
        record = RolloutRecord(
            rollout_id=job.rollout_id, group_id=job.group_id, task_id=job.task.instance_id,
            harness=self.agent.name, outcome=outcome, reward=reward, n_calls=n_calls,
            duration_s=self.clock() - job.started_at, attempt=job.attempt, error=error[-1000:],
            causes=causes or {},
        )
        rollout = FinishedRollout(record=record, calls=calls or [], diff=diff, eval=scored)
        if (flying := self._flying.get(job.rollout_id)) is not None:
            flying.final = rollout
        return _Final(job=job, rollout=rollout)

    async def _infra(self, job: _Job, stage: str, error: BaseException | str, done_tx,
                     calls: list[CallRecord] | None = None) -> None:
        """Retry with a fresh sandbox, or record the infra error (reward None) when out of tries.
        A retried attempt's calls are dropped here (they are in the record log)."""
        self._stages[stage].failed += 1
        message = f"{stage}: {error if isinstance(error, str) else f'{type(error).__name__}: {error}'}"
        if job.attempt < self.cfg.infra_retries:
            self._flying.pop(job.rollout_id, None)  # its retry takes over
            self._retries += 1
            self._boot_tx.send_nowait(_Job(task=job.task, group_id=job.group_id, index=job.index,
                                           group_size=job.group_size, attempt=job.attempt + 1,
                                           started_at=job.started_at, guide=job.guide))
        else:
            await done_tx.send(self._final(job, Outcome.INFRA_ERROR, reward=None, error=message, calls=calls))

    # --------------------------------------------------------------------------------------- stages

    async def _boot_worker(self, boot_rx, ready_tx, done_tx) -> None:
        async with boot_rx, ready_tx, done_tx:
            async for job in boot_rx:
                if job.attempt == 0:
                    self._new_slots.release()
                await self._box_tokens.acquire()
                self._flying[job.rollout_id] = _InFlight(job=job, stage="booting its sandbox")
                if self.reserve is not None:
                    await self.reserve.wait_room()
                box = None
                try:
                    with self._stages["boot"].busy(), anyio.fail_after(self.cfg.boot_timeout_s):
                        box = await self.factory.create(self.agent.spec(job.task, job.rollout_id))
                        self._live.add(box)
                        await self.prepare(box, job.task)
                except INFRA_ERRORS as e:
                    if box is not None:
                        await self._remove(box)
                    self._box_tokens.release()
                    await self._infra(job, "boot", e, done_tx)
                    continue
                await ready_tx.send((job, box))

    async def _agent_worker(self, ready_rx, eval_tx, done_tx) -> None:
        async with ready_rx, eval_tx, done_tx:
            async for job, box in ready_rx:
                calls: list[CallRecord] = []  # the agent puts what it captured here, even when cut off
                self._flying[job.rollout_id] = _InFlight(job=job, stage="running the agent", calls=calls)
                try:
                    with self._stages["agent"].busy():
                        outcome, result, diff = await self._run_agent(job, box, calls)
                finally:
                    await self._remove(box)
                    self._box_tokens.release()
                if isinstance(outcome, BaseException) or result.infra_error:
                    error = outcome if isinstance(outcome, BaseException) else result.infra_error
                    await self._infra(job, "agent", error, done_tx, calls)
                elif outcome is Outcome.OK:
                    self._flying[job.rollout_id].stage = "being evaluated"
                    await eval_tx.send((job, result, diff, calls))
                else:  # the agent's own outcome (for a diff too large to take, `diff` says why): reward 0
                    error = {Outcome.TIMEOUT: "agent timed out", Outcome.DIFF_TOO_LARGE: diff}.get(
                        outcome, f"agent exited {result.exit_code}")
                    await done_tx.send(self._final(job, outcome, reward=0.0, n_calls=result.n_calls, error=error,
                                                   causes=result.causes, calls=calls))

    async def _run_agent(self, job: _Job, box, calls: list[CallRecord]
                         ) -> tuple[Outcome | BaseException, AgentResult, str]:
        timeout_s = self.agent_timeout_s
        result = AgentResult(exit_code=-1, timed_out=True)
        try:
            with anyio.move_on_after(timeout_s + KILL_GRACE_S):
                result = await self.agent.run(box, job.task, rollout_id=job.rollout_id, group_id=job.group_id,
                                              timeout_s=timeout_s, calls=calls, guide=job.guide)
            if result.infra_error:  # e.g. the engine was down: not the agent's fault, retry it
                return AgentInfraError(result.infra_error), result, ""
            if result.timed_out:
                return Outcome.TIMEOUT, result, ""
            if result.exit_code != 0:
                return Outcome.AGENT_ERROR, result, ""
            return Outcome.OK, result, await self.collect_diff(box, job.task)
        except DiffTooLarge as e:
            return Outcome.DIFF_TOO_LARGE, result, str(e)
        except INFRA_ERRORS as e:
            return e, result, ""

    async def _eval_worker(self, eval_rx, done_tx) -> None:
        async with eval_rx, done_tx:
            async for job, agent_result, diff, calls in eval_rx:
                scored = await self._evaluate_with_retries(job, diff)
                if isinstance(scored, EvalResult):
                    await done_tx.send(self._final(job, Outcome.OK, reward=scored.reward, n_calls=agent_result.n_calls,
                                                   error=scored.error, causes=agent_result.causes, calls=calls,
                                                   diff=diff, scored=scored))
                else:  # the diff is kept, so only the evaluation is retried, never the agent
                    error = f"eval: {type(scored).__name__}: {scored}"
                    await done_tx.send(self._final(job, Outcome.INFRA_ERROR, reward=None, n_calls=agent_result.n_calls,
                                                   error=error, calls=calls, diff=diff))

    async def _evaluate_with_retries(self, job: _Job, diff: str) -> EvalResult | BaseException:
        for attempt in range(self.cfg.infra_retries + 1):
            if self.reserve is not None:
                await self.reserve.wait_room()
            try:
                with self._stages["eval"].busy():
                    return await self._evaluate(job, diff)
            except INFRA_ERRORS as e:
                self._stages["eval"].failed += 1
                if attempt == self.cfg.infra_retries:
                    return e
                self._retries += 1
        raise AssertionError("unreachable")

    async def _evaluate(self, job: _Job, diff: str) -> EvalResult:
        with anyio.fail_after(self.cfg.eval_timeout_s + KILL_GRACE_S):
            spec = SandboxSpec(name=f"{job.rollout_id}-eval", image=job.task.image)
            async with self.eval_factory.open(spec) as box:
                return await self.score(box, job.task, diff, timeout_s=self.cfg.eval_timeout_s)

    async def _remove(self, box) -> None:
        self._live.discard(box)
        await box.remove()

    async def _remove_live(self) -> None:
        boxes, self._live = list(self._live), set()
        async with anyio.create_task_group() as tg:
            for box in boxes:
                tg.start_soon(box.remove)
