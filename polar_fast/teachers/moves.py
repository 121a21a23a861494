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

import dataclasses
import random
import re
import shlex

from polar_fast.teachers.plan import FixPlan

SHORT_CONTEXT = 3  # lines a short search shows after the definition it finds (one -A for every task)
SHORT_CONTEXT_MAX = 8  # ... more when the edit sits further down; beyond that the plan stays careful

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


def edit_command(plan: FixPlan, *, swap_words: bool = True) -> str:
    """One command making every edit, `python3 -c` with str.replace per edit. A rename replaces
    the name everywhere in each file, as a person would (with `swap_words`, any one-word change)."""
    if swap_words and (swap := word_swap(plan)):
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


def short_plan(plan: FixPlan) -> tuple[str, str, FixPlan] | None:
    """(search command, edit command, plan) of the short form: one grep whose output shows every
    line the edit changes, with its path, so the edit can follow at once (no read, no reproduce,
    no check); None when no grep shows them (several files, an edit far from the definition),
    and the teacher keeps the careful form for that task.

    Why: a 135M student copies the edit from its context; the fewer calls before it, the fewer
    places a rollout can go wrong, and the shorter every prompt (issue 35: rollouts of 2-3 calls
    let RL take its steps on a CPU). A one-line edit is written without its indentation where
    that text is still unique in the file, so the copy has fewer characters to get wrong, and
    only a rename replaces a word everywhere (a changed number is replaced in its line alone)."""
    swap = word_swap(plan)
    if swap and swap[0] == plan.symbol:  # a rename: grep shows every line with the name, and its path
        return f"grep -rn {shlex.quote(swap[0])} --include='*.py' .", edit_command(plan), plan
    if {path for path, _, _ in plan.edits} != {plan.path} or not plan.symbol:
        return None
    lines = plan.source.splitlines()
    found = next(((i, m.group(1)) for i, line in enumerate(lines) if (m := re.match(
        rf"\s*((?:async\s+)?(?:def|class)\s+{re.escape(plan.symbol)}\b|{re.escape(plan.symbol)}\s*=)", line))), None)
    if found is None:
        return None
    at, pattern = found
    defines = not pattern.endswith("=")
    pattern = re.sub(r"\s+", " ", pattern) if defines else f"{plan.symbol} ="
    last = at
    for _, old, _ in plan.edits:
        first = plan.source[:plan.source.index(old)].count("\n")
        if first < at:
            return None
        last = max(last, first + old.count("\n"))
    if last - at > SHORT_CONTEXT_MAX:
        return None
    context = max(SHORT_CONTEXT, last - at) if defines or last > at else 0
    after = f" -A{context}" if context else ""
    plan = dataclasses.replace(plan, edits=[(plan.path, *_unindented(plan.source, old, new))
                                            for _, old, new in plan.edits])
    return (f"grep -rn{after} {shlex.quote(pattern)} --include='*.py' .",
            edit_command(plan, swap_words=False), plan)


def _unindented(source: str, old: str, new: str) -> tuple[str, str]:
    """A one-line edit without its leading indentation, when that text is still unique."""
    if "\n" in old or "\n" in new:
        return old, new
    indent = old[:len(old) - len(old.lstrip())]
    if indent and new.startswith(indent) and source.count(old.lstrip()) == 1:
        return old.lstrip(), new[len(indent):]
    return old, new


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
