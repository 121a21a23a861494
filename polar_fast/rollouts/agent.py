"""The agent stage's runners: what the pools' agent workers call for each rollout.

`AgentRunner` is the interface; `CommandAgent` runs one scripted shell command (tests, dry runs);
`HarnessAgent` is the runner for real harnesses: one proxy session per rollout, the harness CLI
in its sandbox, pointed at that session.

    agent = HarnessAgent(proxy, get_harness("codex"), bundle_dir, model="qwen3", ...)
    Pools(cfg.pools, factory, agent, agent_timeout_s=...)

The harness bundle (Node + npm CLI, or mini-swe-agent's site dir) is mounted read-only. In a
Docker box with `network = "none"` the proxy's Unix socket is mounted and a forwarder inside
answers on loopback; with host networking or the local sandbox the harness reaches the proxy's
TCP port directly. The session is closed when the run ends, and its calls go into the `calls`
list the pools passed in (also when the pools' hard timeout cancels the run), so they travel with
the rollout in its group's record (rollouts/groups.py).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import anyio
import msgspec

from polar_fast.errors import PolarError
from polar_fast.records import CallRecord
from polar_fast.rollouts.harnesses import Harness, ModelLimits
from polar_fast.rollouts.sandboxes import Mount, SandboxSpec
from polar_fast.rollouts.tasks import Task

if TYPE_CHECKING:
    from polar_fast.proxy import Proxy

BUNDLE_MOUNT = "/opt/polar/harness"
PROXY_PORT_IN_BOX = 18080  # loopback port the forwarder listens on inside a network-none box
OUTPUT_TAIL_CHARS = 4000


class AgentInfraError(PolarError):
    """The agent could not do its work for reasons outside it (AgentResult.infra_error)."""


class AgentResult(msgspec.Struct, frozen=True, kw_only=True):
    exit_code: int
    timed_out: bool = False
    n_calls: int = 0  # model calls the proxy captured for this rollout
    infra_error: str = ""  # set when the agent could not run for reasons outside it (engine down)
    causes: dict[str, int] = {}  # records.CALL_CAUSES the proxy counted over its calls
    requests: dict[str, int] = {}  # "<dialect> stream|json" -> model requests the proxy got
    output_tail: str = ""


class AgentRunner(Protocol):
    name: str

    def spec(self, task: Task, rollout_id: str) -> SandboxSpec: ...

    async def run(self, box: Any, task: Task, *, rollout_id: str, group_id: str, timeout_s: float,
                  calls: list[CallRecord], guide: Sequence[str] = ()) -> AgentResult:
        """Run the agent on `task` in `box`; append the model calls it made to `calls` (the list
        outlives a run the pools cancel at their hard timeout). `guide`: replies that answer
        its first model calls instead of the policy (GroupSpec.guide)."""
        ...


class CommandAgent:
    """A scripted agent: one shell command in the task repo (tests, dry runs; no model)."""

    def __init__(self, script: str | Callable[[Task], str], *, name: str = "scripted") -> None:
        self.script = script
        self.name = name

    def spec(self, task: Task, rollout_id: str) -> SandboxSpec:
        return SandboxSpec(name=rollout_id, image=task.image)

    async def run(self, box: Any, task: Task, *, rollout_id: str, group_id: str, timeout_s: float,
                  calls: list[CallRecord], guide: Sequence[str] = ()) -> AgentResult:
        script = self.script(task) if callable(self.script) else self.script
        env = {"POLAR_ROLLOUT_ID": rollout_id, "POLAR_GROUP_ID": group_id}
        done = await box.exec(["sh", "-c", script], env=env, cwd=box.workdir, timeout_s=timeout_s)
        return AgentResult(exit_code=done.exit_code, timed_out=done.timed_out,
                           output_tail=(done.stdout[-1000:] + done.stderr[-1000:]))


class HarnessAgent:
    def __init__(self, proxy: Proxy, harness: Harness, bundle: Path, *, model: str, max_steps: int,
                 use_socket: bool, limits: ModelLimits) -> None:
        self.proxy = proxy
        self.limits = limits  # told to the harness, so it compacts before the proxy refuses a prompt
        self.harness = harness
        self.name = harness.name
        self.model = model
        self.max_steps = max_steps
        self.use_socket = use_socket and bool(proxy.unix_socket)
        self.mount = Mount(source=str(bundle), target=f"{BUNDLE_MOUNT}/{harness.name}", read_only=True)

    def spec(self, task: Task, rollout_id: str) -> SandboxSpec:
        if self.use_socket:
            return SandboxSpec(name=rollout_id, image=task.image, mounts=[self.mount],
                               proxy_port=PROXY_PORT_IN_BOX, proxy_socket=self.proxy.unix_socket)
        port = int(self.proxy.base_url.rsplit(":", 1)[1])
        return SandboxSpec(name=rollout_id, image=task.image, mounts=[self.mount], proxy_port=port)

    async def run(self, box, task: Task, *, rollout_id: str, group_id: str, timeout_s: float,
                  calls: list[CallRecord], guide: Sequence[str] = ()) -> AgentResult:
        session = self.proxy.new_session(rollout_id, group_id, guide=tuple(guide),
                                         format_error_markers=getattr(self.harness, "format_error_markers", ()))
        try:
            cmd = self.harness.command(
                prompt=task.problem_statement, proxy_url=f"{box.proxy_url}/s/{session.token}",
                api_key=session.token, model=self.model, home=box.home, bundle=box.path(self.mount.target),
                max_steps=self.max_steps, limits=self.limits,
            )
            await box.write_files({f"{box.home}/{rel}": text for rel, text in cmd.files.items()})
            result = await box.exec(cmd.argv, env=cmd.env, cwd=box.workdir, timeout_s=timeout_s)
        finally:
            self.proxy.close_session(session.token)  # late requests now get 401
            # shielded: a rollout cut off at the pools' hard timeout keeps the calls it made
            with anyio.CancelScope(shield=True):
                calls.extend(await asyncio.to_thread(session.records))
        output = (result.stdout + result.stderr)[-OUTPUT_TAIL_CHARS:]
        failed = result.exit_code != 0 or result.timed_out
        infra = ""
        if failed and session.failing_calls:
            # the harness gave up because the engine did not answer or its calls could not be
            # recorded: the pools retry the rollout instead of scoring it 0. A harness that got
            # past such a failure (its own retry was answered) is scored as usual.
            infra = "; ".join(text for n, text in (
                (session.engine_failures, f"the engine failed {session.engine_failures} of this rollout's model calls"),
                (session.record_failures, f"{session.record_failures} of its calls could not be recorded"),
            ) if n)
        return AgentResult(exit_code=result.exit_code, timed_out=result.timed_out, n_calls=session.n_calls,
                           infra_error=infra, output_tail=output, causes=dict(session.causes),
                           requests=dict(session.requests))
