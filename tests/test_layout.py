"""The package's layers only point down, nothing imports in a circle, and README.md's layout table
matches the tree.

Layers, bottom first (LAYERS): the shared core; the parts the stages are built from (capture/,
engines/, merge/); the proxy; what the pools run (rollouts/); the pools; what the learner uses
(learner/); the learner (grpo.py); the run (train, evaluate, serve, cli, ...). A module imports
only from its own layer or below: a stage's package never imports its entry module, and nothing
below the run imports the run. Within that, a module may import another stage's entry, or the
few modules a stage offers the rest of the program (PUBLIC), never the rest of another stage's
package; only the faces of the native extension import it. No import circle anywhere, counting
imports inside functions and under TYPE_CHECKING, except a family package's `__init__` importing
its own members for its name->class map (STYLE.md §5: engines/, harnesses/, dialects/), which
is the family's face: its members import what it defined before it imports them.
"""

from __future__ import annotations

import ast
import builtins
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "polar_fast"

CORE = {"polar_fast", "polar_fast.conversation", "polar_fast.records", "polar_fast.config", "polar_fast.errors",
        "polar_fast.model", "polar_fast.wire", "polar_fast.wire.reference", "polar_fast.signals"}
NATIVE = "polar_fast._native"
LAYERS = [  # bottom first: (name, the modules and packages in it); the run is everything else
    ("core", CORE | {NATIVE}),
    ("parts", {"polar_fast.capture", "polar_fast.engines", "polar_fast.merge"}),
    ("proxy", {"polar_fast.proxy"}),
    ("rollouts", {"polar_fast.rollouts"}),
    ("pools", {"polar_fast.pools"}),
    ("learner", {"polar_fast.learner"}),
    ("grpo", {"polar_fast.grpo"}),
    ("cluster", {"polar_fast.cluster"}),  # rollout nodes and engine replicas on Ray, beside the run
]
STAGES = {  # package -> its entry module
    "polar_fast.capture": "polar_fast.proxy",
    "polar_fast.rollouts": "polar_fast.pools",
    "polar_fast.learner": "polar_fast.grpo",
    "polar_fast.engines": "polar_fast.engines",
    "polar_fast.merge": "polar_fast.merge",
    "polar_fast.cluster": "polar_fast.cluster",
}
PUBLIC = {  # what a stage offers outside itself, besides its entry
    "polar_fast.rollouts.tasks", "polar_fast.rollouts.stack", "polar_fast.rollouts.harnesses",
    "polar_fast.rollouts.groups",  # the group record the pools hand on and the learner trains on
    "polar_fast.rollouts.stream",  # the training run's groups (guided, difficulty-filtered)
    "polar_fast.rollouts.service", "polar_fast.rollouts.validate", "polar_fast.rollouts.task_images",
    "polar_fast.learner.distributed", "polar_fast.learner.weight_sync", "polar_fast.learner.checkpoint",
    "polar_fast.learner.sft", "polar_fast.learner.sft_process", "polar_fast.learner.batches",
    "polar_fast.learner.memory",
    "polar_fast.engines.vllm_launch", "polar_fast.engines.scripted",
    "polar_fast.merge.arrays",  # the array contract the learner reads
    "polar_fast.cluster.check",  # what `check` asks a Ray cluster
}
DIALECTS = "polar_fast.capture.dialects"
FACES = {"polar_fast.merge", "polar_fast.capture.tokenizer", "polar_fast.wire"}
TEST_HELPERS = {"polar_fast.testing"}  # builds test set-ups from any stage's parts
MAX_TOP_LEVEL_MODULES = 18


def module_sources(root: Path = PACKAGE) -> dict[str, str]:
    out = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        if "tasks_builtin" in rel.parts:
            continue
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = path.read_text()
    return out


def imports_of(module: str, source: str) -> set[str]:
    """Every polar_fast module `source` imports, at any depth (functions, TYPE_CHECKING too)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}  # `from pkg import module`
    return {name for name in found if name.split(".")[0] == "polar_fast"}


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """module -> the polar_fast modules it imports (`from pkg import name` of a non-module: pkg)."""
    known = set(sources) | {NATIVE}
    return {m: {t for t in imports_of(m, s) if t in known and t != m} for m, s in sources.items()}


def stage_of(module: str) -> str | None:
    for package, entry in STAGES.items():
        if module == entry or module == package or module.startswith(package + "."):
            return package
    return None


def layer_of(module: str) -> int:
    for i, (_, members) in enumerate(LAYERS):
        if any(module == m or (m != "polar_fast" and module.startswith(m + ".")) for m in members):
            return i
    return len(LAYERS)  # the run


def layer_name(i: int) -> str:
    return LAYERS[i][0] if i < len(LAYERS) else "run"


def violations(sources: dict[str, str]) -> list[str]:
    bad = []
    for module, targets in import_graph(sources).items():
        for target in targets:
            if layer_of(target) > layer_of(module):
                bad.append(f"{module} ({layer_name(layer_of(module))}) imports upward: {target} "
                           f"({layer_name(layer_of(target))})")
                continue
            if target == NATIVE:
                if module not in FACES:
                    bad.append(f"{module} imports the native extension; use its face ({', '.join(sorted(FACES))})")
                continue
            if module in CORE or module.startswith(DIALECTS):
                if not (target in CORE or target.startswith(DIALECTS)):
                    bad.append(f"{module} is shared by every stage and must not import {target}")
                continue
            if module in TEST_HELPERS:
                continue
            mine, theirs = stage_of(module), stage_of(target)
            if theirs is None or theirs == mine or target in (theirs, STAGES[theirs]) or target in PUBLIC:
                continue
            bad.append(f"{module} reaches into another stage's internals: {target}")
    return bad


def circles(sources: dict[str, str]) -> list[list[str]]:
    """The import circles (strongly connected components of two or more modules), leaving out a
    package's imports of its own members (the family face, see the module docstring)."""
    graph = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in import_graph(sources).items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graph has a few hundred nodes, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_only_point_down():
    assert violations(module_sources()) == []


def test_no_import_circles():
    assert circles(module_sources()) == []


@pytest.mark.parametrize("module, line", [
    ("polar_fast.records", "from polar_fast.proxy import Proxy"),
    ("polar_fast.conversation", "import polar_fast.pools"),
    ("polar_fast.capture.dialects.anthropic", "from polar_fast.grpo import Learner"),
    ("polar_fast.learner.losses", "from polar_fast._native import merge"),
    ("polar_fast.rollouts.reward", "from polar_fast.capture.render import Renderer"),
    ("polar_fast.train", "from polar_fast.capture.history import History"),
    ("polar_fast.export", "from polar_fast.merge import reference"),
    ("polar_fast.proxy", "def f():\n    from polar_fast.learner.packed_forward import PackedLM"),
    # upward: a stage's package importing its entry, a lower layer a higher one, anything the run
    ("polar_fast.rollouts.stack", "from polar_fast.pools import Pools"),
    ("polar_fast.learner.sft", "def f():\n    from polar_fast.grpo import Learner"),
    ("polar_fast.capture.history", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from polar_fast.proxy import Session"),
    ("polar_fast.pools", "from polar_fast.grpo import trains_on"),
    ("polar_fast.grpo", "from polar_fast.train import RunError"),
])
def test_a_layering_break_is_caught(module, line):
    sources = module_sources()
    sources[module] = sources[module] + "\n" + line + "\n"
    found = violations(sources)
    assert len(found) == 1 and found[0].startswith(module), found


@pytest.mark.parametrize("module, line", [
    ("polar_fast.capture.skeleton", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from polar_fast.capture.render import Renderer"),
    ("polar_fast.rollouts.task_rows", "def f():\n    from polar_fast.rollouts.families import family_tasks"),
    ("polar_fast.rollouts.log_parsers", "from polar_fast.rollouts.reward import score"),
    ("polar_fast.engines.http1", "from polar_fast.engines.vllm import VllmEngine"),
])
def test_a_circle_is_caught(module, line):
    """The three circles this package once had, and one through a family's member."""
    sources = module_sources()
    sources[module] = sources[module] + "\n" + line + "\n"
    found = circles(sources)
    assert len(found) == 1 and module in found[0], found


def test_only_one_of_a_kind_modules_sit_at_the_top_level():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    for entry in ("proxy.py", "pools.py", "grpo.py"):  # the design card's fixed entry points
        assert entry in top


def _readme_layout_paths() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    paths = []
    for cell in re.findall(r"^\| (.+?) \|", section, re.M):
        names = re.findall(r"`([^`]+)`", cell)
        if not names:
            continue
        base = names[0].rsplit("/", 1)[0] + "/" if "/" in names[0].rstrip("/") else ""
        paths.append(names[0])
        paths += [n if "/" in n else base + n for n in names[1:]]
    return paths


def test_readme_layout_names_exactly_the_packages_that_exist():
    paths = _readme_layout_paths()
    for path in paths:
        assert (ROOT / path).exists(), f"README.md's layout names {path}, which does not exist"
    named = {p.rstrip("/") for p in paths if p.startswith("polar_fast/") and p.endswith("/")}
    packages = {str(p.parent.relative_to(ROOT)) for p in PACKAGE.rglob("__init__.py")
                if "tasks_builtin" not in p.parts and p.parent != PACKAGE}
    assert named == packages, f"missing from README: {packages - named}; not packages: {named - packages}"
    top = {f"polar_fast/{p.name}" for p in PACKAGE.glob("*.py")} - {"polar_fast/__init__.py", "polar_fast/__main__.py"}
    assert top <= set(paths), f"top-level modules missing from README's layout: {top - set(paths)}"


def test_user_docs_stand_alone():
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        assert "../shared" not in doc.read_text(), f"{doc.name} points at ../shared, which users do not have"


BUILTIN_EXCEPTIONS = {name for name, value in vars(builtins).items()
                      if isinstance(value, type) and issubclass(value, BaseException)}


def exception_classes(sources: dict[str, str]) -> dict[str, list[str]]:
    """Every class polar_fast defines -> its base names, for the exception check below."""
    classes: dict[str, list[str]] = {}
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                bases = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, (ast.Name, ast.Attribute))]
                classes[f"{module}.{node.name}"] = bases
    return classes


def test_every_exception_derives_from_polar_error():
    classes = exception_classes(module_sources())
    by_name = {qualified.rsplit(".", 1)[1]: bases for qualified, bases in classes.items()}

    def ancestors(name: str, seen: frozenset = frozenset()) -> set[str]:
        out = {name}
        for base in by_name.get(name, []):
            if base not in seen:
                out |= ancestors(base, seen | {name})
        return out

    strays = []
    for qualified, bases in classes.items():
        found = ancestors(qualified.rsplit(".", 1)[1])
        if found & BUILTIN_EXCEPTIONS and "PolarError" not in found and not qualified.endswith(".PolarError"):
            strays.append(qualified)
    assert strays == [], f"exceptions that do not derive from errors.PolarError: {strays}"


def ray_importers(sources: dict[str, str]) -> set[str]:
    """Modules that import Ray anywhere in them (functions too)."""
    out = set()
    for module, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n.split(".")[0] == "ray" for n in names):
                out.add(module)
    return out


def test_only_the_cluster_package_imports_ray():
    """Ray is the `ray` extra: the local path (train, eval, serve, the CPU default) never needs
    it, so only polar_fast/cluster/ may import it. Outside the package, its entry (`rollout_side`,
    which imports the driver only for `cluster.kind = "ray"`) is the door, and check's cluster
    items the one other user, under the same condition (test below)."""
    sources = module_sources()
    assert {m for m in ray_importers(sources) if not m.startswith("polar_fast.cluster")} == set()
    assert ray_importers({"m": "def f():\n    from ray.util import placement_group\n"}) == {"m"}  # the check bites
    users = {m for m, targets in import_graph(sources).items()
             if any(t.startswith("polar_fast.cluster.") for t in targets) and not m.startswith("polar_fast.cluster")}
    assert users == {"polar_fast.preflight.cluster"}


def test_the_local_path_loads_no_ray():
    code = ("import sys, polar_fast.train, polar_fast.cli, polar_fast.evaluate, polar_fast.serve\n"
            "from polar_fast.preflight.cluster import check_cluster\n"
            "from polar_fast.config import parse_config\n"
            "assert parse_config({}).cluster.kind == 'local'\n"
            "assert check_cluster(parse_config({}))[0].status == 'n/a'\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith(('ray.', 'polar_fast.cluster.'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
