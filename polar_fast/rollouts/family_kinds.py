"""The kinds of generated repair task: one generator per family, each a small bug in a small repo.

A generator draws one task from a `Side`, the vocabulary of a split group: module and package
names, people, and the numbers its failing calls use. Train-side tasks (train, demos), validation
tasks and eval-side tasks (held-out, transfer) draw from disjoint vocabularies, so no held-out or
transfer statement can equal a train, demo or validation one (tests/test_families.py checks it).

Every repo holds the buggy module beside decoys: other modules with functions of their own, in a
flat layout, a package or a nested package, so that a statement that does not name the file makes
the agent search. Each fix replaces one line of one file (`rename` also updates its callers).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Side:
    words: tuple[str, ...]  # module, package and helper names
    people: tuple[str, ...]
    numbers: range  # values the statements quote


TRAIN_SIDE = Side(
    words=("alpha", "basket", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "iris", "juniper",
           "kestrel", "lumen"),
    people=("Ann", "Bo", "Cleo", "Dev", "Eli", "Fay"),
    numbers=range(2, 40),
)
VALIDATION_SIDE = Side(
    words=("maple", "nectar", "orbit", "pepper", "quartz", "raven"),
    people=("Gus", "Hana", "Ivo"),
    numbers=range(40, 70),
)
EVAL_SIDE = Side(
    words=("saffron", "tundra", "umber", "violet", "willow", "yarrow", "zephyr", "acorn", "bramble", "cobalt"),
    people=("Jun", "Kai", "Lia", "Mo", "Nia"),
    numbers=range(70, 120),
)


@dataclass(frozen=True)
class Generated:
    files: dict[str, str]  # the repo's source files at base (tests/ is added by the family)
    path: str  # the file the fix changes
    edits: list[tuple[str, str, str]]  # (path, old line, new line): the fix, each old line unique in its file
    module: str  # dotted module the tests import from
    keep: dict[str, str]  # PASS_TO_PASS: test name -> body line
    add: dict[str, str]  # FAIL_TO_PASS: test name -> body line
    imports: list[str]  # names the tests import before the fix
    imports_after: list[str]  # ... and after
    statement: str
    symbol: str  # the identifier a careful agent searches for
    call: str = ""  # a Python expression that shows the bug (`print`ed to reproduce it)


def _layout(rng: random.Random, side: Side, topic: str) -> tuple[str, str, dict[str, str]]:
    """(path of the module the bug goes in, its dotted name, decoy files): flat, package or nested."""
    a, b, c = rng.sample(side.words, 3)
    decoy = (f'"""Small helpers."""\n\n\ndef clamp(value, low, high):\n    return max(low, min(value, high))\n\n\n'
             f"def label(name):\n    return name.strip().title()\n")
    other = (f'"""{topic.capitalize()} records."""\n\nDEFAULT_NAME = "{b}"\n\n\n'
             f"def names(rows):\n    return [row['name'] for row in rows]\n")
    kind = rng.choice(["flat", "package", "nested"])
    if kind == "flat":
        return f"{a}.py", a, {"helpers.py": decoy, f"{b}.py": other}
    if kind == "package":
        return f"{a}/{b}.py", f"{a}.{b}", {f"{a}/__init__.py": "", f"{a}/util.py": decoy, f"{a}/{c}.py": other}
    return (f"{a}/{b}/{c}.py", f"{a}.{b}.{c}",
            {f"{a}/__init__.py": "", f"{a}/core.py": decoy, f"{a}/{b}/__init__.py": "", f"{a}/{b}/records.py": other})


def _num(rng: random.Random, side: Side) -> int:
    return rng.choice(side.numbers)


def _constant(rng: random.Random, side: Side) -> Generated:
    path, module, decoys = _layout(rng, side, "limits")
    const = rng.choice(["LIMIT", "MAX_ITEMS", "BATCH_SIZE", "PAGE_SIZE", "RETRIES"])
    old = _num(rng, side)
    new = old + rng.randrange(1, 20)
    src = (f'"""Limits."""\n\n{const} = {old}\n\n\ndef capped(n):\n    return min(n, {const})\n\n\n'
           f"def count(values):\n    return len(values)\n")
    return Generated(
        {**decoys, path: src}, path, [(path, f"{const} = {old}", f"{const} = {new}")], module,
        keep={"test_count": "self.assertEqual(count([1, 2, 3]), 3)"},
        add={"test_value": f"self.assertEqual({const}, {new})",
             "test_capped": f"self.assertEqual(capped({new + 100}), {new})"},
        imports=["count"], imports_after=[const, "capped", "count"],
        statement=f"In `{path}`, `{const}` is {old} but it must be {new}: change `{const} = {old}` to `{const} = {new}`.",
        symbol=const, call=f"{const}",
    )


_RETURNS = [("total", "a - b", "a + b"), ("area", "a + b", "a * b"), ("ratio", "a * b", "a / b"),
            ("spread", "a + b", "a - b"), ("combined", "a * 2 + b", "a + b * 2")]


def _returns(rng: random.Random, side: Side) -> Generated:
    path, module, decoys = _layout(rng, side, "reports")
    func, wrong, right = rng.choice(_RETURNS)
    a, b = _num(rng, side), rng.randrange(1, 10)
    src = (f'"""Arithmetic for reports."""\n\n\ndef {func}(a, b):\n    return {wrong}\n\n\n'
           f"def double(x):\n    return x * 2\n")
    expect = eval(right, {"a": a, "b": b})  # noqa: S307 - fixed table above, not input
    return Generated(
        {**decoys, path: src}, path, [(path, f"    return {wrong}", f"    return {right}")], module,
        keep={"test_double": "self.assertEqual(double(4), 8)"},
        add={f"test_{func}": f"self.assertEqual({func}({a}, {b}), {expect!r})"},
        imports=["double"], imports_after=[func, "double"],
        statement=f"`{func}(a, b)` in `{path}` returns `{wrong}`; it must return `{right}`.",
        symbol=func, call=f"{func}({a}, {b})",
    )


_COMPARE = [("is_adult", "age", ">", ">="), ("fits", "size", "<", "<="), ("has_quorum", "votes", ">", ">="),
            ("within_budget", "cost", "<", "<="), ("is_full", "count", ">", ">=")]


def _compare(rng: random.Random, side: Side) -> Generated:
    path, module, decoys = _layout(rng, side, "checks")
    func, var, op, good = rng.choice(_COMPARE)
    limit = _num(rng, side)
    src = (f'"""Checks."""\n\nLIMIT = {limit}\n\n\ndef {func}({var}):\n    return {var} {op} LIMIT\n\n\n'
           f"def describe({var}):\n    return 'yes' if {func}({var}) else 'no'\n")
    far = limit + 10 if op == ">" else limit - 10
    return Generated(
        {**decoys, path: src}, path, [(path, f"    return {var} {op} LIMIT", f"    return {var} {good} LIMIT")],
        module, keep={"test_far": f"self.assertTrue({func}({far}))"},
        add={"test_boundary": f"self.assertTrue({func}({limit}))",
             "test_describe_boundary": f"self.assertEqual(describe({limit}), 'yes')"},
        imports=[func], imports_after=[func, "describe"],
        statement=f"`{func}({limit})` returns False, but the limit itself counts: it should return True.",
        symbol=func, call=f"{func}({limit})",
    )


_RENAMES = [("fetch", "load"), ("get", "read"), ("make", "build"), ("calc", "compute")]
_NOUNS = ("items", "orders", "points", "records", "tickets", "scores", "rows", "pages")


def _rename(rng: random.Random, side: Side) -> Generated:
    path, module, decoys = _layout(rng, side, "store")
    verb, better = rng.choice(_RENAMES)
    noun = rng.choice(_NOUNS)
    old, new = f"{verb}_{noun}", f"{better}_{noun}"
    src = f'"""{noun.capitalize()}."""\n\n\ndef {old}(n):\n    return list(range(n))\n\n\ndef first(n):\n    return {old}(n)[:1]\n'
    return Generated(
        {**decoys, path: src}, path, [(path, f"def {old}(n):", f"def {new}(n):"),
                                      (path, f"    return {old}(n)[:1]", f"    return {new}(n)[:1]")], module,
        keep={"test_first": "self.assertEqual(first(3), [0])"},
        # imported in the test, so the PASS_TO_PASS test still runs (and passes) before the rename
        add={f"test_{new}": f"from {module} import {new}; self.assertEqual({new}(3), [0, 1, 2])"},
        imports=["first"], imports_after=["first"],
        statement=f"Rename the function `{old}` in `{path}` to `{new}`, and update its callers.",
        symbol=old,
    )


_OPERATORS = [("area", "width, height", "width + height", "width * height", "the area of a {a} by {b} rectangle"),
              ("total_price", "price, count", "price - count", "price * count", "{b} items at {a} each cost"),
              ("average", "total, count", "total * count", "total / count", "the mean of {b} values summing to {a}"),
              ("remaining", "budget, spent", "budget + spent", "budget - spent", "{a} minus {b} spent leaves")]


def _operator(rng: random.Random, side: Side) -> Generated:
    path, module, decoys = _layout(rng, side, "math")
    func, params, wrong, right, meaning = rng.choice(_OPERATORS)
    a, b = _num(rng, side), rng.randrange(2, 9)
    names = [p.strip() for p in params.split(",")]
    env = dict(zip(names, (a, b)))
    got, want = eval(wrong, env), eval(right, env)  # noqa: S307 - fixed table above
    src = (f'"""Calculations."""\n\n\ndef {func}({params}):\n    return {wrong}\n\n\n'
           f"def rounded(value):\n    return round(value, 2)\n")
    return Generated(
        {**decoys, path: src}, path, [(path, f"    return {wrong}", f"    return {right}")], module,
        keep={"test_rounded": "self.assertEqual(rounded(1.234), 1.23)"},
        add={f"test_{func}": f"self.assertEqual({func}({a}, {b}), {want!r})"},
        imports=["rounded"], imports_after=[func, "rounded"],
        statement=f"`{func}({a}, {b})` returns {got!r}, but {meaning.format(a=a, b=b)} is {want!r}.",
        symbol=func, call=f"{func}({a}, {b})",
    )


_DEFAULTS = [("paginate", "items", "size", "pages of {old} items; by default a page should hold {new}",
              "[items[i:i + size] for i in range(0, len(items), size)]", "len({f}(list(range({n})))[0])"),
             ("repeat_word", "word", "times", "the word {old} times; by default it should repeat it {new} times",
              "' '.join([word] * times)", "len({f}('ok').split())"),
             ("indent", "text", "width", "{old} spaces of indent; the default indent is {new} spaces",
              "' ' * width + text", "len({f}('x')) - 1")]


def _default(rng: random.Random, side: Side) -> Generated:
    path, module, decoys = _layout(rng, side, "format")
    func, arg, param, meaning, body, probe = rng.choice(_DEFAULTS)
    old = rng.randrange(2, 9)
    new = rng.choice([n for n in side.numbers if n != old])
    src = (f'"""Formatting."""\n\n\ndef {func}({arg}, {param}={old}):\n    return {body}\n\n\n'
           f"def shout(text):\n    return text.upper()\n")
    check = probe.format(f=func, n=3 * new)  # the default in effect, as a number
    return Generated(
        {**decoys, path: src}, path, [(path, f"def {func}({arg}, {param}={old}):", f"def {func}({arg}, {param}={new}):")],
        module, keep={"test_shout": "self.assertEqual(shout('hi'), 'HI')"},
        add={f"test_{func}_default": f"self.assertEqual({check}, {new})"},
        imports=["shout"], imports_after=[func, "shout"],
        statement=f"Called without `{param}`, `{func}` gives {meaning.format(old=old, new=new)}.",
        symbol=func, call=check,
    )


_LITERALS = [("greet", "name", "f'{wrong}, {{name}}!'", "Hello", ["Helo", "Hallo", "Hullo"]),
             ("farewell", "name", "f'{wrong}, {{name}}.'", "Goodbye", ["Godbye", "Goodby", "Good bye"]),
             ("thank", "name", "f'{wrong}, {{name}}'", "Thank you", ["Thanks you", "Thank yu", "Thank"])]


def _literal(rng: random.Random, side: Side) -> Generated:
    path, module, decoys = _layout(rng, side, "messages")
    func, arg, template, right, typos = rng.choice(_LITERALS)
    wrong = rng.choice(typos)
    person = rng.choice(side.people)
    line_wrong, line_right = template.format(wrong=wrong), template.format(wrong=right)
    src = (f'"""Messages."""\n\n\ndef {func}({arg}):\n    return {line_wrong}\n\n\n'
           f"def quiet(text):\n    return text.lower()\n")
    shown = lambda text: eval(text, {arg: person})  # noqa: E731,S307 - fixed table above
    return Generated(
        {**decoys, path: src}, path, [(path, f"    return {line_wrong}", f"    return {line_right}")], module,
        keep={"test_quiet": "self.assertEqual(quiet('HI'), 'hi')"},
        add={f"test_{func}": f"self.assertEqual({func}({person!r}), {shown(line_right)!r})"},
        imports=["quiet"], imports_after=[func, "quiet"],
        statement=f"`{func}({person!r})` returns {shown(line_wrong)!r} but should return {shown(line_right)!r}.",
        symbol=func, call=f"{func}({person!r})",
    )


_INDEXES = [("last_item", "items", "items[-2]", "items[-1]", "the last element"),
            ("first_item", "items", "items[1]", "items[0]", "the first element"),
            ("tail", "items", "items[2:]", "items[1:]", "every element after the first")]


def _index(rng: random.Random, side: Side) -> Generated:
    path, module, decoys = _layout(rng, side, "lists")
    func, arg, wrong, right, meaning = rng.choice(_INDEXES)
    values = rng.sample(list(side.numbers), 4)
    src = f'"""List helpers."""\n\n\ndef {func}({arg}):\n    return {wrong}\n\n\ndef size(items):\n    return len(items)\n'
    got, want = eval(wrong, {arg: values}), eval(right, {arg: values})  # noqa: S307 - fixed table above
    return Generated(
        {**decoys, path: src}, path, [(path, f"    return {wrong}", f"    return {right}")], module,
        keep={"test_size": "self.assertEqual(size([1, 2]), 2)"},
        add={f"test_{func}": f"self.assertEqual({func}({values!r}), {want!r})"},
        imports=["size"], imports_after=[func, "size"],
        statement=f"`{func}({values!r})` returns {got!r}; it should return {meaning}, {want!r}.",
        symbol=func, call=f"{func}({values!r})",
    )


_SWAPS = [("divide", "a, b", "b / a", "a / b", "{a} divided by {b}"),
          ("modulo", "a, b", "b % a", "a % b", "the remainder of {a} divided by {b}"),
          ("minus", "a, b", "b - a", "a - b", "{a} minus {b}")]


def _swap(rng: random.Random, side: Side) -> Generated:
    path, module, decoys = _layout(rng, side, "ops")
    func, params, wrong, right, meaning = rng.choice(_SWAPS)
    names = [p.strip() for p in params.split(",")]
    a, b = _num(rng, side), rng.randrange(2, 4)
    env = dict(zip(names, (a, b)))
    got, want = eval(wrong, env), eval(right, env)  # noqa: S307 - fixed table above
    src = f'"""Operations."""\n\n\ndef {func}({params}):\n    return {wrong}\n\n\ndef negate(x):\n    return -x\n'
    return Generated(
        {**decoys, path: src}, path, [(path, f"    return {wrong}", f"    return {right}")], module,
        keep={"test_negate": "self.assertEqual(negate(2), -2)"},
        add={f"test_{func}": f"self.assertEqual({func}({a}, {b}), {want!r})"},
        imports=["negate"], imports_after=[func, "negate"],
        statement=f"`{func}({a}, {b})` returns {got!r} instead of {want!r} ({meaning.format(a=a, b=b)}).",
        symbol=func, call=f"{func}({a}, {b})",
    )


KINDS: dict[str, Callable[[random.Random, Side], Generated]] = {
    "constant": _constant, "returns": _returns, "compare": _compare, "rename": _rename,
    "operator": _operator, "default": _default, "literal": _literal, "index": _index, "swap": _swap,
}
TRANSFER_KINDS = ("index", "swap")  # never in demos, train or validation: the transfer split's own
