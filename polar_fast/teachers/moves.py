"""The pieces every teacher's demonstration is made of, harness-neutral: one shell command form
per step of the plan, and lines of reasoning, worded variously, that name what was found.

Why one form per step: the policy learns from a few dozen demonstrations. With three equivalent
edit forms (sed, python3 -c, a heredoc) each seen a third of the time, SmolLM2-135M wrote the
right fix in its reasoning ("replacing `a - b` with `a + b` fixes it") and then issued a read
command, the form it had seen in every demonstration: 0 of 10 validation samples passed. The
edit is `python3 -c` with str.replace, whose strings are copied literally from the file (sed needs
escapes that differ from the text), so every variable part of a command is a copy of something
in the conversation."""

from __future__ import annotations

import random
import re
import shlex

from polar_fast.teachers.plan import FixPlan

def search_command(plan: FixPlan) -> str:
    return f"grep -rn {shlex.quote(plan.symbol)} --include='*.py' ."


def read_command(plan: FixPlan) -> str:
    return f"cat {plan.path}"


def reproduce_command(plan: FixPlan) -> str:
    name = plan.call.split("(", 1)[0]
    code = f"from {plan.module} import {name}; print(repr({plan.call}))"
    return f"python3 -c {shell_quote(code)}"


def shell_quote(text: str) -> str:
    """Quoted for sh the way a person would: single quotes, else double quotes where nothing in
    the text is special inside them, else shlex's form."""
    if "'" not in text:
        return f"'{text}'"
    if not any(c in text for c in '"$`\\!'):
        return f'"{text}"'
    return shlex.quote(text)


def check_command(plan: FixPlan, test_command: str) -> str:
    if plan.call:
        return reproduce_command(plan)
    return f"{test_command or 'python3 -m unittest'} 2>&1 | tail -n 5"


def word_swap(plan: FixPlan) -> tuple[str, str] | None:
    """(old name, new name) when every edit renames one identifier to another (a rename)."""
    swaps = set()
    for _, old, new in plan.edits:
        a, b = set(re.findall(r"\w+", old)) - set(re.findall(r"\w+", new)), set(re.findall(r"\w+", new)) - set(re.findall(r"\w+", old))
        if len(a) != 1 or len(b) != 1:
            return None
        swaps.add((a.pop(), b.pop()))
    if len(swaps) != 1:
        return None
    name, renamed = swaps.pop()
    ok = all(re.sub(rf"\b{name}\b", renamed, old) == new for _, old, new in plan.edits)
    return (name, renamed) if ok else None


def edit_command(plan: FixPlan) -> str:
    """One command making every edit, `python3 -c` with str.replace per edit. A rename replaces
    the name everywhere in each file, as a person would."""
    if swap := word_swap(plan):
        name, renamed = swap
        edits = [(path, name, renamed, -1) for path in sorted({path for path, _, _ in plan.edits})]
    else:
        edits = [(path, old, new, 1) for path, old, new in plan.edits]
    parts = []
    for path, old, new, count in edits:
        code = (f"from pathlib import Path; p = Path({path!r}); s = p.read_text(); "
                f"p.write_text(s.replace({old!r}, {new!r}, {count}))")
        parts.append(f"python3 -c {shell_quote(code)}")
    return " && ".join(parts)


def _quote(text: str) -> str:
    first = text.strip().splitlines()[0] if text.strip() else text
    return f"`{first.strip()}`"


def thought(step: str, plan: FixPlan, rng: random.Random) -> str:
    """One line of reasoning for `step`, naming what the agent knows at that point."""
    _, old, new = plan.edits[0]
    options = {
        "search": [f"The issue is about `{plan.symbol}`. Let me find where it is defined.",
                   f"First I need to locate `{plan.symbol}` in the repository.",
                   "Let me look at the repository to find the code this issue is about."],
        "read": [f"`{plan.symbol}` is in {plan.path}. Let me read that file.",
                 f"Let me read {plan.path} to see the code around `{plan.symbol}`.",
                 f"The code is in {plan.path}; I will look at it before changing anything."],
        "reproduce": ["Let me reproduce the problem first.",
                      f"Before editing, I will run `{plan.call}` to see what it returns now."],
        "edit": [f"The line {_quote(old)} is wrong; it should be {_quote(new)}. I will replace it.",
                 f"In {plan.path}, {_quote(old)} must become {_quote(new)}.",
                 f"The bug is {_quote(old)}. Replacing it with {_quote(new)} fixes the issue."],
        "check": ["Let me check that the fix works.", "Now I will verify the change.",
                  "Let me run it again to confirm the fix."],
        "submit": ["The fix works. I am done, so I will submit.", "The change is verified; submitting."],
        "finish": [f"Fixed: in {plan.path}, {_quote(old)} is now {_quote(new)}.",
                   f"Done. `{plan.symbol}` in {plan.path} now behaves as the issue asks."],
    }
    return rng.choice(options[step])
