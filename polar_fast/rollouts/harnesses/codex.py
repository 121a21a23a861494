"""OpenAI Codex CLI (`codex exec`), Responses API, streaming.

Config lives in `$CODEX_HOME/config.toml`: a custom `model_providers.polar` with
`wire_api = "responses"` pointing at the proxy, the key read from POLAR_API_KEY, approvals
"never" and sandbox "danger-full-access" (the container is the sandbox; Codex's own Landlock
sandbox would need privileges we do not grant). `--ephemeral` keeps no session files,
`--skip-git-repo-check` allows task dirs that are not git repos. Codex has no turn limit, so
`max_steps` is left to the pool's hard timeout. The npm package runs a native (static musl)
binary through a small Node launcher.

Limits: an unknown model gets Codex's fallback window (272k), so `model_context_window` names
the served context and `model_auto_compact_token_limit` the token count (the last call's usage)
at which Codex compacts before its next call: the context less one reply at the output cap, less
a tenth for the tool output that comes before the next call. Codex has no output-cap setting and
sends no `max_output_tokens`; the proxy's `sampling.max_tokens` caps its replies.
"""

from __future__ import annotations

import json
from pathlib import Path

from polar_fast.rollouts.harnesses import AgentCommand, ModelLimits
from polar_fast.rollouts.harnesses.bundles import install_npm_harness
from polar_fast.rollouts.harnesses.env import base_env

PACKAGES = {"@openai/codex": "0.171.0"}


def compaction_threshold(limits: ModelLimits) -> int:
    """The context less one reply at the output cap, less a tenth for the next tool output."""
    return limits.context_tokens * 9 // 10 - limits.max_output_tokens


def auto_compact_token_limit(limits: ModelLimits) -> int:
    return max(1, compaction_threshold(limits))


def _toml_str(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid TOML basic string


class Codex:
    name = "codex"

    def compaction_threshold(self, limits: ModelLimits) -> int:
        return compaction_threshold(limits)

    def install(self, bundle_root: Path) -> Path:
        return install_npm_harness(bundle_root, self.name, PACKAGES, "codex")

    def command(self, *, prompt: str, proxy_url: str, api_key: str, model: str, home: str,
                bundle: str, max_steps: int, limits: ModelLimits) -> AgentCommand:
        config = "\n".join([
            f"model = {_toml_str(model)}",
            'model_provider = "polar"',
            'approval_policy = "never"',
            'sandbox_mode = "danger-full-access"',
            f"model_context_window = {limits.context_tokens}",
            f"model_auto_compact_token_limit = {auto_compact_token_limit(limits)}",
            "check_for_update_on_startup = false",
            "",
            "[model_providers.polar]",
            'name = "polar"',
            f"base_url = {_toml_str(proxy_url + '/v1')}",
            'env_key = "POLAR_API_KEY"',
            'wire_api = "responses"',
            "",
            "[analytics]",
            "enabled = false",
            "",
            "[feedback]",
            "enabled = false",
            "",
        ])
        env = base_env(home=home, bundle=bundle) | {
            "CODEX_HOME": f"{home}/.codex",
            "POLAR_API_KEY": api_key,
        }
        argv = [f"{bundle}/bin/codex", "exec", "--skip-git-repo-check", "--ephemeral", prompt]
        return AgentCommand(argv=argv, env=env, files={".codex/config.toml": config})
