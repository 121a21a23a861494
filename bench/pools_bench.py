"""Agent-slot utilisation: the three pools vs one sandbox per rollout, run sequentially per slot.

Stage durations are simulated with log-normal long tails, clipped to the ranges seen in agentic
RL on SWE-style tasks (boot 5-60 s, agent 1-20 min, tests 10 s-10 min), and time is scaled down
(1 simulated minute = 0.1 s real by default). Both pipelines get the same number of agent slots
and an endless stream of tasks for the same simulated window; we report the fraction of
agent-slot time spent running agents and the rollouts finished per simulated minute. The pools
run through the real `polar_fast.pools.Pools` (only the sandbox, agent and scoring are simulated),
and the bench checks that every finished rollout of both pipelines got a reward.

    python bench/pools_bench.py [--quick] [--slots 8] [--minutes 240]

Last line: RESULT pools_busy=B sequential_busy=S speedup=X  (X = rollouts/min ratio)
"""

from __future__ import annotations

import argparse
import math
import random
import time

import anyio

from polar_fast.config import PoolsConfig
from polar_fast.pools import Pools
from polar_fast.records import Outcome
from polar_fast.rollouts.agent import AgentResult
from polar_fast.rollouts.reward import EvalResult
from polar_fast.rollouts.sandboxes import SandboxSpec
from polar_fast.rollouts.tasks import load_builtin

RANGES_S = {"boot": (5, 60, 15), "agent": (60, 1200, 300), "tests": (10, 600, 60)}  # min, max, median
SIGMA = {"boot": 0.6, "agent": 0.8, "tests": 1.0}


class Durations:
    def __init__(self, seed: int, scale: float) -> None:
        self.rng = random.Random(seed)
        self.scale = scale  # real seconds per simulated second

    def __call__(self, stage: str) -> float:
        low, high, median = RANGES_S[stage]
        sim = min(max(self.rng.lognormvariate(math.log(median), SIGMA[stage]), low), high)
        return sim * self.scale


class SimBox:
    workdir = home = "/sim"
    proxy_url = ""

    async def remove(self) -> None:
        pass


class SimFactory:
    kind, run_id = "sim", "bench"

    def __init__(self, durations: Durations) -> None:
        self.durations = durations

    async def create(self, spec: SandboxSpec) -> SimBox:
        await anyio.sleep(self.durations("boot"))
        return SimBox()

    def open(self, spec: SandboxSpec):
        from polar_fast.rollouts.sandboxes import open_sandbox

        return open_sandbox(self, spec)


class SimAgent:
    name = "sim"

    def __init__(self, durations: Durations) -> None:
        self.durations = durations

    def spec(self, task, rollout_id: str) -> SandboxSpec:
        return SandboxSpec(name=rollout_id)

    async def run(self, box, task, *, rollout_id, group_id, timeout_s, calls, guide=()) -> AgentResult:
        await anyio.sleep(self.durations("agent"))
        return AgentResult(exit_code=0)


def endless(tasks):
    while True:
        yield from tasks


async def run_pools(slots: int, window_s: float, durations: Durations, tasks) -> dict:
    cfg = PoolsConfig(group_size=4, boot_workers=max(2, slots // 2), agent_workers=slots,
                      eval_workers=slots, prewarm=2, queue_size=slots)

    async def score(box, task, diff, *, timeout_s) -> EvalResult:
        await anyio.sleep(durations("tests"))
        return EvalResult(reward=1.0, tests={}, failed=[])

    async def no_prepare(box, task):
        pass

    async def no_diff(box, task):
        return "diff"

    rewards: list[float | None] = []

    async def on_group(group):
        rewards.extend(r.reward for r in group.records if r.outcome is Outcome.OK)

    pools = Pools(cfg, SimFactory(durations), SimAgent(durations), agent_timeout_s=3600 * durations.scale,
                  prepare=no_prepare, collect_diff=no_diff, score=score)
    with anyio.move_on_after(window_s):
        await pools.run(endless(tasks), on_group)
    stats = pools.statistics()
    assert all(r == 1.0 for r in rewards), "a finished rollout lost its reward"
    return {"busy": stats.agent.busy_fraction, "rollouts": len(rewards), "agent_done": stats.agent.completed,
            "boot_busy": stats.boot.busy_fraction, "eval_busy": stats.eval.busy_fraction}


async def run_sequential(slots: int, window_s: float, durations: Durations) -> dict:
    """Each slot: boot a sandbox, run the agent, run the tests in it, remove; then the next one."""
    busy = [0.0]
    done = [0]
    started = time.monotonic()

    async def slot() -> None:
        while True:
            await anyio.sleep(durations("boot"))
            t0 = time.monotonic()
            try:
                await anyio.sleep(durations("agent"))
            finally:
                busy[0] += time.monotonic() - t0
            await anyio.sleep(durations("tests"))
            done[0] += 1

    with anyio.move_on_after(window_s):
        async with anyio.create_task_group() as tg:
            for _ in range(slots):
                tg.start_soon(slot)
    elapsed = time.monotonic() - started
    return {"busy": busy[0] / (slots * elapsed), "rollouts": done[0]}


async def main(args) -> None:
    scale = 0.1 / 60  # real seconds per simulated second: 1 simulated minute = 0.1 s
    minutes = args.minutes or (120 if args.quick else 480)
    window_s = minutes * 60 * scale
    tasks = load_builtin()
    pools = await run_pools(args.slots, window_s, Durations(args.seed, scale), tasks)
    seq = await run_sequential(args.slots, window_s, Durations(args.seed, scale))
    pools_rate, seq_rate = pools["rollouts"] / minutes, seq["rollouts"] / minutes
    speedup = pools_rate / seq_rate if seq_rate else float("inf")
    print(f"simulated window {minutes} min, {args.slots} agent slots, time scale 1 min = 0.1 s")
    print(f"{'pipeline':<12} {'agent busy':>10} {'rollouts':>9} {'rollouts/min':>13}")
    print(f"{'pools':<12} {pools['busy']:>10.1%} {pools['rollouts']:>9d} {pools_rate:>13.3f}")
    print(f"{'sequential':<12} {seq['busy']:>10.1%} {seq['rollouts']:>9d} {seq_rate:>13.3f}")
    print(f"pools: boot busy {pools['boot_busy']:.1%}, eval busy {pools['eval_busy']:.1%}, "
          f"agent runs finished {pools['agent_done']}")
    print(f"RESULT pools_busy={pools['busy']:.3f} sequential_busy={seq['busy']:.3f} speedup={speedup:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a 120-minute window (~25 s)")
    parser.add_argument("--slots", type=int, default=8, help="agent slots in both pipelines")
    parser.add_argument("--minutes", type=int, default=0, help="simulated window; 0 = 120 quick / 480")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    anyio.run(main, args, backend_options={"use_uvloop": True})
