"""A harness declared in configuration: `[harness.define]` in run.toml, or a TOML file that
`harness.file` (or `harnesses check FILE`) names, with the same keys at its top level.

A definition is data for the three things an adapter knows (harnesses/__init__.py): the install
(pinned npm or PyPI packages built into a cached bundle as the built-in five's are, or a prebuilt
executable on the host, pinned by its sha256), the command line, environment and HOME files, and
the texts that mark a format error. Values are templates: `{{ name }}` is a placeholder
(PLACEHOLDERS), and `{{ expression }}` is integer arithmetic over the integer ones (`+ - * //`,
parentheses, `min`, `max`, unary minus), enough for compaction thresholds such as Pi's. A
`json_files` entry is written as JSON (its keys are templates too); a string in it that is one
integer placeholder or expression becomes a JSON number.

What that arithmetic can express: every value it yields is an integer, so a fraction is out of
reach (Claude Code's `CLAUDE_AUTOCOMPACT_PCT_OVERRIDE` wants two decimals: that harness stays
code). A switch on a threshold is not: `min(1, context_window // T)` is 1 when the window is at
least T and 0 below it, so `a + (b - a) * min(1, context_window // T)` picks a or b (for windows
of at least 1; `max(0, ...)` clamps the rest).

`[check]` tells `harnesses check` how a CLI without a shell tool acts (a text-edit agent such as
aider): `edit`, a reply that edits a file in the CLI's own text format, with its placeholders
`{{ file }}`, `{{ old }}` and `{{ new }}` (CHECK_PLACEHOLDERS; `old` is empty for a file to create).

`load_definition` checks everything before anything runs and raises ConfigError with one line
naming the key: unknown keys, an unknown placeholder, a bad expression, a missing command, an
unpinned package, a name that is a built-in harness's.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any, Literal

import msgspec

from polar_fast.config import HarnessConfig, explain_validation, read_toml
from polar_fast.errors import ConfigError
from polar_fast.rollouts.harnesses import AgentCommand, ModelLimits
from polar_fast.rollouts.harnesses.bundles import (
    PYTHON_VERSION,
    build_bundle,
    install_binary_harness,
    install_npm_harness,
    pip_install_target,
    python_module_wrapper,
    write_script,
)
from polar_fast.rollouts.harnesses.env import base_env

INT_PLACEHOLDERS = ("context_window", "max_output_tokens", "max_steps")
PLACEHOLDERS = ("proxy_url", "proxy_url_v1", "api_key", "model", "prompt", "bundle", "home", *INT_PLACEHOLDERS)
CHECK_PLACEHOLDERS = ("file", "old", "new")  # [check] edit: the file to edit, its text before and after
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_TEMPLATE = re.compile(r"\{\{(.*?)\}\}", re.S)
_NPM_VERSION = re.compile(r"^\d+\.\d+\.\d+(-[0-9A-Za-z.-]+)?$")  # exact: no ranges, tags or `latest`
_PIP_PIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]+\])?==[0-9][0-9A-Za-z.+!-]*$")
_CALLS = {"min": min, "max": max}
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.FloorDiv: lambda a, b: a // b}


class Install(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    npm: dict[str, str] = {}  # package -> exact version; the bundle gets Node unless `node = false`
    pip: list[str] = []  # "name==version" requirements, installed for the box's python3.11
    binary: str = ""  # a prebuilt executable on the host (absolute path), copied into the bundle as bin/<bin>
    sha256: str = ""  # binary: its sha256 (hex); the bundle is refused when the file differs
    bin: str = ""  # the entry point made at <bundle>/bin/<bin>: node_modules/.bin/<bin> (npm), `module` (pip), the binary
    module: str = ""  # pip: the module `bin/<bin>` runs (as `python -m`), e.g. "minisweagent.run.mini"
    node: bool = True  # npm: bundle Node (false for CLIs that ship a native binary)
    check: list[str] = msgspec.field(default_factory=lambda: ["--version"])  # arguments that must make `bin/<bin>` exit 0 on a new bundle


class CheckReplies(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """How `harnesses check`'s scripted model acts in a CLI that offers no shell tool."""

    edit: str = ""  # one file edit in the CLI's text format: {{ file }}, {{ old }} ("" = create it), {{ new }}


class HarnessDefinition(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    name: str  # what harness.name and eval.harnesses call it; not a built-in harness's name
    api: Literal["chat", "responses", "anthropic"]  # the dialect it speaks (for `harnesses check`)
    install: Install = Install()
    argv: list[str] = []  # the command line, run in the task repo; "{{ bundle }}/bin/<bin>" starts the install
    env: dict[str, str] = {}  # added to the base env (private HOME, PATH with the bundle's bin/ first)
    files: dict[str, str] = {}  # path under HOME -> text
    json_files: dict[str, Any] = {}  # path under HOME -> a table written as JSON
    format_error_markers: list[str] = []  # texts in its next request that mean it rejected a reply's format
    compaction_threshold: str = ""  # prompt tokens at which it compacts, as an expression; "" = never
    end_command: str = ""  # harnesses check: a shell command that ends its task (mini's submit); "" = a plain answer
    check: CheckReplies = CheckReplies()  # harnesses check: how the scripted model acts without a shell tool


def load_definition(hc: HarnessConfig, *, reserved: tuple[str, ...] = ()) -> HarnessDefinition | None:
    """The harness `hc` defines (`define` inline, or `file`), checked; None when it defines none."""
    if hc.define and hc.file:
        raise ConfigError("harness: set `define` or `file`, not both")
    if hc.file:
        return definition_from_file(hc.file, reserved=reserved)
    if hc.define:
        return parse_definition(hc.define, where="harness.define", reserved=reserved)
    return None


def definition_from_file(path: str | Path, *, reserved: tuple[str, ...] = ()) -> HarnessDefinition:
    return parse_definition(read_toml(path, "harness definition"), where=str(path), reserved=reserved)


def parse_definition(raw: dict[str, Any], *, where: str, reserved: tuple[str, ...] = ()) -> HarnessDefinition:
    """`raw` checked as a definition; `reserved`: names it may not take (the built-in harnesses')."""
    try:
        d = msgspec.convert(raw, HarnessDefinition)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{where}: {explain_validation(str(e))}") from None
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", d.name):
        raise ConfigError(f"{where}: key 'name': {d.name!r} is not a lower-case name (a-z, 0-9, . _ -)")
    if d.name in reserved:
        raise ConfigError(f"{where}: key 'name': {d.name!r} is a built-in harness; give the definition its own name")
    if not d.argv:
        raise ConfigError(f"{where}: key 'argv': missing: the command line that starts the harness")
    _check_install(d.install, where)
    templates = [(f"argv[{i}]", v) for i, v in enumerate(d.argv)] + [(f"env.{k}", v) for k, v in d.env.items()]
    templates += [(f"files.{k!r}", v) for k, v in d.files.items()] + list(_json_strings(d.json_files, "json_files"))
    for key, text in templates:
        try:
            _parts(text)
        except ValueError as e:
            raise ConfigError(f"{where}: key '{key}': {e}") from None
    if d.compaction_threshold:
        try:
            _expression(d.compaction_threshold)
        except ValueError as e:
            raise ConfigError(f"{where}: key 'compaction_threshold': {e}") from None
    if d.check.edit:
        try:
            parts = _parts(d.check.edit, names=CHECK_PLACEHOLDERS)
        except ValueError as e:
            raise ConfigError(f"{where}: key 'check.edit': {e}") from None
        used = {p.id for p in parts if isinstance(p, ast.Name)}
        if used != set(CHECK_PLACEHOLDERS):
            missing = ", ".join(f"{{{{ {n} }}}}" for n in CHECK_PLACEHOLDERS if n not in used)
            raise ConfigError(f"{where}: key 'check.edit': an edit needs {missing} too")
    return d


def _check_install(install: Install, where: str) -> None:
    for pkg, version in install.npm.items():
        if not _NPM_VERSION.match(version):
            raise ConfigError(f"{where}: key 'install.npm.{pkg}': {version!r} is not a pinned version (e.g. \"1.2.3\")")
    for i, req in enumerate(install.pip):
        if not _PIP_PIN.match(req):
            raise ConfigError(f"{where}: key 'install.pip[{i}]': {req!r} is not pinned (name==version)")
    if sum(map(bool, (install.npm, install.pip, install.binary))) > 1:
        raise ConfigError(f"{where}: key 'install': one of npm packages, pip packages or a binary")
    if install.binary and not Path(install.binary).is_absolute():
        raise ConfigError(f"{where}: key 'install.binary': {install.binary!r} is not an absolute path")
    if install.binary and not _SHA256.match(install.sha256):
        raise ConfigError(f"{where}: key 'install.sha256': the binary's sha256 (64 hex digits) is needed to pin it "
                          f"(sha256sum {install.binary})")
    if install.sha256 and not install.binary:
        raise ConfigError(f"{where}: key 'install.sha256': set only with install.binary")
    if (install.npm or install.pip) and not install.bin:
        raise ConfigError(f"{where}: key 'install.bin': missing: the entry point to put in the bundle's bin/")
    if install.pip and not install.module:
        raise ConfigError(f"{where}: key 'install.module': missing: the module `bin/{install.bin}` runs")


def _json_strings(value: Any, key: str):
    if isinstance(value, str):
        yield key, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield f"{key} (a key)", k  # keys are templates too (e.g. a model table named {{ model }})
            yield from _json_strings(v, f"{key}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _json_strings(v, f"{key}[{i}]")


# ------------------------------------------------------------------------------ templates


def _expression(text: str, names: tuple[str, ...] = PLACEHOLDERS) -> ast.expr:
    """The checked AST of one placeholder (one of `names`) or integer expression (ValueError
    names what is wrong)."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise ValueError(f"{{{{{text}}}}} is neither a placeholder nor an expression") from None
    if isinstance(tree, ast.Name):
        if tree.id not in names:
            raise ValueError(f"unknown placeholder {tree.id!r}; known: {', '.join(names)}")
        return tree
    if names is not PLACEHOLDERS:
        raise ValueError(f"{{{{{text}}}}}: only the placeholders {', '.join(names)} are allowed here")
    _check_arithmetic(tree, text)
    return tree


def _check_arithmetic(node: ast.AST, text: str) -> None:
    if isinstance(node, ast.Name):
        if node.id not in INT_PLACEHOLDERS:
            known = ", ".join(INT_PLACEHOLDERS)
            raise ValueError(f"{node.id!r} in {text.strip()!r}: arithmetic takes only {known}"
                             if node.id in PLACEHOLDERS else f"unknown placeholder {node.id!r}; known: {known}")
    elif isinstance(node, ast.Constant) and type(node.value) is int:
        pass
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        _check_arithmetic(node.left, text), _check_arithmetic(node.right, text)
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        _check_arithmetic(node.operand, text)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS
          and node.args and not node.keywords):
        for arg in node.args:
            _check_arithmetic(arg, text)
    else:
        raise ValueError(f"{text.strip()!r}: only integers, {', '.join(INT_PLACEHOLDERS)}, + - * //, "
                         "parentheses, min() and max() are allowed")


def _parts(text: str, names: tuple[str, ...] = PLACEHOLDERS) -> list[str | ast.expr]:
    parts: list[str | ast.expr] = []
    last = 0
    for m in _TEMPLATE.finditer(text):
        parts += [text[last:m.start()], _expression(m.group(1), names)]
        last = m.end()
    return [*parts, text[last:]]


def _evaluate(node: ast.expr, values: dict[str, Any]) -> Any:
    if isinstance(node, ast.Name):
        return values[node.id]
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.BinOp):
        return _OPS[type(node.op)](_evaluate(node.left, values), _evaluate(node.right, values))
    if isinstance(node, ast.UnaryOp):
        return -_evaluate(node.operand, values)
    assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    return _CALLS[node.func.id](*(_evaluate(a, values) for a in node.args))


def render(text: str, values: dict[str, Any], names: tuple[str, ...] = PLACEHOLDERS) -> str:
    return "".join(p if isinstance(p, str) else str(_evaluate(p, values)) for p in _parts(text, names))


def render_edit(template: str, *, file: str, old: str, new: str) -> str:
    """A [check] edit reply: `template` with the edit's file, old text and new text."""
    return render(template, {"file": file, "old": old, "new": new}, CHECK_PLACEHOLDERS)


def _render_json(value: Any, values: dict[str, Any]) -> Any:
    if isinstance(value, str):
        parts = _parts(value)
        if len(parts) == 3 and parts[0] == parts[2] == "":  # one placeholder: keep its type
            return _evaluate(parts[1], values)
        return render(value, values)
    if isinstance(value, dict):
        return {render(k, values): _render_json(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [_render_json(v, values) for v in value]
    return value


# ------------------------------------------------------------------------------ the harness


class ConfiguredHarness:
    """A `Harness` (harnesses/__init__.py) from a checked `HarnessDefinition`."""

    def __init__(self, definition: HarnessDefinition) -> None:
        self.definition = definition
        self.name = definition.name
        self.format_error_markers = tuple(definition.format_error_markers)
        self.end_command = definition.end_command
        if definition.check.edit:  # harnesses check: how its scripted model edits a file (else: by tools)
            self.edit_reply = self._edit_reply

    def _edit_reply(self, file: str, old: str, new: str) -> str:
        return render_edit(self.definition.check.edit, file=file, old=old, new=new)

    def compaction_threshold(self, limits: ModelLimits) -> int | None:
        if not self.definition.compaction_threshold:
            return None
        return _evaluate(_expression(self.definition.compaction_threshold), _limit_values(limits, max_steps=0))

    def install(self, bundle_root: Path) -> Path:
        spec = msgspec.to_builtins(self.definition.install)
        inst = self.definition.install
        if inst.npm:
            return install_npm_harness(bundle_root, self.name, dict(inst.npm), inst.bin, with_node=inst.node,
                                       check_args=list(inst.check))
        if inst.binary:
            return install_binary_harness(bundle_root, self.name, Path(inst.binary), inst.sha256,
                                          inst.bin or Path(inst.binary).name, check_args=list(inst.check))
        if inst.pip:
            def build(tmp: Path) -> None:
                pip_install_target(tmp / "site", list(inst.pip), what=f"{self.name} pip install")
                write_script(tmp / "bin" / inst.bin, python_module_wrapper(inst.module, inst.bin))

            return build_bundle(bundle_root, self.name, {**spec, "python": PYTHON_VERSION}, build,
                                [f"bin/{inst.bin}", *inst.check])

        def build_empty(tmp: Path) -> None:  # nothing to install: the command uses what the box has
            write_script(tmp / "bin" / ".polar-empty", "#!/bin/sh\nexit 0\n")

        return build_bundle(bundle_root, self.name, {}, build_empty, ["bin/.polar-empty"])

    def command(self, *, prompt: str, proxy_url: str, api_key: str, model: str, home: str, bundle: str,
                max_steps: int, limits: ModelLimits) -> AgentCommand:
        values = {"proxy_url": proxy_url, "proxy_url_v1": f"{proxy_url}/v1", "api_key": api_key, "model": model,
                  "prompt": prompt, "bundle": bundle, "home": home, **_limit_values(limits, max_steps=max_steps)}
        d = self.definition
        files = {rel: render(text, values) for rel, text in d.files.items()}
        files |= {rel: json.dumps(_render_json(table, values), indent=1) for rel, table in d.json_files.items()}
        env = base_env(home=home, bundle=bundle) | {k: render(v, values) for k, v in d.env.items()}
        return AgentCommand(argv=[render(a, values) for a in d.argv], env=env, files=files)


def _limit_values(limits: ModelLimits, *, max_steps: int) -> dict[str, int]:
    return {"context_window": limits.context_tokens, "max_output_tokens": limits.max_output_tokens,
            "max_steps": max_steps}
