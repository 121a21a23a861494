"""Pi's teacher: its own tools (`bash` to search and run, `read` to read a file, `edit` with exact
`oldText` / `newText` pairs), and a last reply with no tool call, which is how a Pi task ends."""

from __future__ import annotations

from polar_fast.rollouts.tasks import Task
from polar_fast.teachers import moves, rng_for
from polar_fast.teachers.mini_swe_agent import tool_call
from polar_fast.teachers.plan import fix_plan


class PiTeacher:
    harness = "pi"

    def __init__(self, form: str = "careful") -> None:
        self.form = form

    def steps(self, task: Task) -> list[tuple[str, str]]:
        plan, rng = fix_plan(task), rng_for(task, self.harness)
        short = moves.short_plan(plan) if self.form == "short" else None

        def say(step: str, name: str, arguments: dict) -> tuple[str, str]:
            return step, f"{moves.thought(step, plan, rng)}\n{tool_call(name, arguments)}"

        if short:  # the short form: search showing the lines to change, then the edits
            search, _, plan = short
            out = [say("search", "bash", {"command": search})]
        else:
            out = [say("search", "bash", {"command": moves.search_command(plan)}),
                   say("read", "read", {"path": plan.path})]
            if plan.call:
                out.append(say("reproduce", "bash", {"command": moves.reproduce_command(plan)}))
        by_path: dict[str, list[dict[str, str]]] = {}
        for path, old, new in plan.edits:
            by_path.setdefault(path, []).append({"oldText": old, "newText": new})
        first = True
        for path, edits in by_path.items():
            arguments = {"path": path, "edits": edits}
            out.append(say("edit", "edit", arguments) if first else ("edit", tool_call("edit", arguments)))
            first = False
        if not short:
            out.append(say("check", "bash", {"command": moves.check_command(plan, task.test_command)}))
        out.append(("finish", moves.thought("finish", plan, rng)))
        return out

    def replies(self, task: Task) -> list[str]:
        return [reply for _, reply in self.steps(task)]
