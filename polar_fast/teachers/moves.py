"""The pieces every teacher's demonstration is made of, harness-neutral: shell commands for each
step of the plan in a few equivalent forms, and lines of reasoning that name what was found."""

from __future__ import annotations

import random
import re
import shlex

from polar_fast.teachers.plan import FixPlan

SED_DELIMITERS = "|#@!,%"


def search_command(plan: FixPlan, rng: random.Random) -> str:
    s = plan.symbol
    forms = [f"grep -rn {shlex.quote(s)} --include='*.py' .",
             f"grep -rn {shlex.quote('def ' + s)} --include='*.py' . || grep -rn {shlex.quote(s)} --include='*.py' .",
             "find . -name '*.py' -not -path './.git/*' | sort"]
    return rng.choices(forms, weights=[5, 2, 2])[0]


def read_command(plan: FixPlan, rng: random.Random) -> str:
    return rng.choice([f"cat {plan.path}", f"nl -ba {plan.path}", f"sed -n '1,80p' {plan.path}"])


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


def edit_command(plan: FixPlan, rng: random.Random) -> str:
    """One command making every edit: sed (single-line edits only), python3 -c, or a heredoc. A
    rename replaces the name everywhere in the file, as a person would."""
    if swap := word_swap(plan):
        name, renamed = swap
        paths = sorted({path for path, _, _ in plan.edits})
        if rng.random() < 0.5:
            return f"sed -i 's/\\b{name}\\b/{renamed}/g' {' '.join(paths)}"
        return " && ".join(f"python3 -c \"from pathlib import Path; p = Path('{path}'); "
                           f"p.write_text(p.read_text().replace('{name}', '{renamed}'))\"" for path in paths)
    one_line = all("\n" not in old + new for _, old, new in plan.edits)
    forms = ["python", "heredoc"] + (["sed"] if one_line and _delimiter(plan) else [])
    form = rng.choices(forms, weights=[4, 2, 4][: len(forms)])[0]
    if form == "sed":
        d = _delimiter(plan)
        by_path: dict[str, list[str]] = {}
        for path, old, new in plan.edits:
            by_path.setdefault(path, []).append(f"-e {shell_quote(f's{d}{_bre(old, d)}{d}{_repl(new, d)}{d}')}")
        return " && ".join(f"sed -i {' '.join(exprs)} {path}" for path, exprs in by_path.items())
    if form == "python":
        parts = []
        for path, old, new in plan.edits:
            code = (f"from pathlib import Path; p = Path({path!r}); s = p.read_text(); "
                    f"p.write_text(s.replace({old!r}, {new!r}, 1))")
            parts.append(f"python3 -c {shell_quote(code)}")
        return " && ".join(parts)
    lines = ["python3 - <<'EOF'", "from pathlib import Path"]
    for path, old, new in plan.edits:
        lines += [f"p = Path({path!r})", f"p.write_text(p.read_text().replace({old!r}, {new!r}, 1))"]
    return "\n".join([*lines, "EOF"])


def _delimiter(plan: FixPlan) -> str:
    text = "".join(old + new for _, old, new in plan.edits)
    return next((d for d in SED_DELIMITERS if d not in text), "")


def _bre(text: str, delimiter: str) -> str:
    """`text` as a basic regular expression matching itself."""
    return "".join("\\" + c if c in ".*[]^$\\" + delimiter else c for c in text)


def _repl(text: str, delimiter: str) -> str:
    return "".join("\\" + c if c in "&\\" + delimiter else c for c in text)


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
