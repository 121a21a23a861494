"""Harness adapters: how each coding-agent CLI is installed, configured and started.

An adapter knows three things about its CLI and nothing else: how to build a self-contained bundle
(`install`), which config files and environment variables point it at our proxy, and its
non-interactive command line (`command`). Running the command (sandbox, timeout, process-tree
kill) belongs to the pools and sandboxes.

Every command gets a private HOME, the session token as the API key, the served model name,
approvals off, telemetry and update checks off, and the served model's limits (`ModelLimits`) in
the harness's own settings, so it compacts its context when it would in production instead of
running into the engine's context error. `proxy_url` is `http://127.0.0.1:PORT/s/<token>`
(no `/v1`); each adapter appends what its client needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import msgspec

from polar_fast.config import HarnessConfig
from polar_fast.errors import ConfigError
from polar_fast.rollouts.harnesses.bundles import MANIFEST, BundleError, bundle_root, default_bundle_root


class ModelLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What the served model takes: the harness is told these through its own settings."""

    context_tokens: int  # prompt + completion, as the proxy enforces it (model.max_context_tokens)
    max_output_tokens: int  # per call (sampling.max_tokens)


class AgentCommand(msgspec.Struct, frozen=True, kw_only=True):
    argv: list[str]  # run with cwd = the task repo inside the sandbox
    env: dict[str, str]  # full environment additions (HOME, PATH, keys, ...)
    files: dict[str, str]  # path relative to HOME -> text content, written before running


class Harness(Protocol):
    name: str  # "mini-swe-agent" | "codex" | "claude-code" | "qwen-code" | "pi" | a configured one
    # optional attributes: format_error_markers (texts that mark a rejected reply), and for
    # `harnesses check` end_command (the shell command that ends its task) and
    # edit_reply(file, old, new) (a CLI without tools: one file edit in its reply format)

    def install(self, bundle_root: Path) -> Path:
        """Build (or find cached) this harness's bundle under bundle_root; returns the bundle dir."""
        ...

    def command(
        self, *, prompt: str, proxy_url: str, api_key: str, model: str, home: str, bundle: str, max_steps: int,
        limits: ModelLimits,
    ) -> AgentCommand:
        """The command line, env and HOME files for one run; `bundle` is the bundle dir as seen
        inside the sandbox (a read-only mount, or the host path for local sandboxes)."""
        ...

    def compaction_threshold(self, limits: ModelLimits) -> int | None:
        """The prompt size, in tokens, at which the harness compacts its history when told
        `limits` (its own formula, before the adapter clamps a setting into range: zero or
        less means it would compact on every call); None when it never compacts."""
        ...


def _build() -> dict[str, Harness]:
    from polar_fast.rollouts.harnesses.claude_code import ClaudeCode
    from polar_fast.rollouts.harnesses.codex import Codex
    from polar_fast.rollouts.harnesses.mini_swe_agent import MiniSweAgent
    from polar_fast.rollouts.harnesses.pi import Pi
    from polar_fast.rollouts.harnesses.qwen_code import QwenCode

    return {h.name: h for h in (MiniSweAgent(), Codex(), ClaudeCode(), QwenCode(), Pi())}


HARNESSES: dict[str, Harness] = _build()


def bundle_manifest(bundle: Path) -> dict:
    """What a built bundle holds (its pinned packages), as written when it was built."""
    import json

    path = Path(bundle) / MANIFEST
    return json.loads(path.read_text()) if path.exists() else {"bundle": Path(bundle).name}


def get_harness(name: str, config: HarnessConfig | None = None) -> Harness:
    """A built-in harness, or the one `config` (the run's [harness]) declares under that name."""
    from polar_fast.rollouts.harnesses.configured import ConfiguredHarness, load_definition

    defined = load_definition(config, reserved=tuple(HARNESSES)) if config is not None else None
    if defined is not None and defined.name == name:
        return ConfiguredHarness(defined)
    try:
        return HARNESSES[name]
    except KeyError:
        known = ", ".join(sorted(HARNESSES) + ([defined.name] if defined else []))
        raise ConfigError(f"key 'harness.name': unknown harness {name!r}; known harnesses: {known}"
                          + ("" if defined else " (or declare one: harness.file / harness.define)")) from None


def select(config: HarnessConfig, target: str) -> HarnessConfig:
    """`config` set to run `target`: a harness name, or a TOML file declaring one (by its path)."""
    if not (target.endswith(".toml") or "/" in target):
        return msgspec.structs.replace(config, name=target)
    from polar_fast.rollouts.harnesses.configured import definition_from_file

    name = definition_from_file(target, reserved=tuple(HARNESSES)).name
    return msgspec.structs.replace(config, name=name, file=target, define={})


def run_harness(config: HarnessConfig) -> Harness:
    """The harness a run uses (`harness.name`), its definition checked: call before anything boots."""
    return get_harness(config.name, config)


__all__ = ["AgentCommand", "BundleError", "HARNESSES", "Harness", "ModelLimits", "bundle_manifest",
           "bundle_root", "default_bundle_root", "get_harness", "run_harness", "select"]
