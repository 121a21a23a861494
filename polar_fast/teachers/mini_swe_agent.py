"""mini-swe-agent's teacher: reasoning text and one `bash` tool call per reply (what its
mini.yaml asks for), ending with the submit command on its own (mini.yaml: "Do not combine it
with any other command"). The careful form searches, reads, reproduces, edits, checks and
submits; the short form (moves.short_plan) greps the lines to change, edits and submits."""

from __future__ import annotations

import json

from polar_fast.rollouts.tasks import Task
from polar_fast.teachers import moves, rng_for
from polar_fast.teachers.plan import fix_plan

SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"  # mini-swe-agent's end-of-task command


def tool_call(name: str, arguments: dict) -> str:
    """A tool call as SmolLM2 / Hermes-style models write it (the proxy's tool-call parser)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def bash_call(command: str) -> str:
    return tool_call("bash", {"command": command})


class MiniSweAgentTeacher:
    harness = "mini-swe-agent"

    def __init__(self, form: str = "careful") -> None:
        self.form = form

    def steps(self, task: Task) -> list[tuple[str, str]]:
        plan, rng = fix_plan(task), rng_for(task, self.harness)
        short = moves.short_plan(plan) if self.form == "short" else None

        def say(step: str, command: str) -> tuple[str, str]:
            return step, f"{moves.thought(step, plan, rng)}\n\n{bash_call(command)}"

        if short:  # search showing the lines to change, edit, submit
            search, edit, plan = short
            return [say("search", search), say("edit", edit), say("submit", SUBMIT)]
        out = [say("search", moves.search_command(plan)), say("read", moves.read_command(plan))]
        if plan.call:
            out.append(say("reproduce", moves.reproduce_command(plan)))
        out.append(say("edit", moves.edit_command(plan)))
        out.append(say("check", moves.check_command(plan, task.test_command)))
        out.append(say("submit", SUBMIT))
        return out

    def replies(self, task: Task) -> list[str]:
        return [reply for _, reply in self.steps(task)]
