"""Qwen Code (`qwen -p`), OpenAI Chat Completions, streaming.

Auth type "openai" with OPENAI_BASE_URL (`<proxy>/v1`), the session token as OPENAI_API_KEY and
OPENAI_MODEL, in env and in `~/.qwen/settings.json`, which also turns off usage statistics and
auto-update and bounds session turns. `--approval-mode yolo` runs tools without asking.
"""

from __future__ import annotations

import json
from pathlib import Path

from polar_fast.harnesses import AgentCommand
from polar_fast.harnesses.bundles import install_npm_harness
from polar_fast.harnesses.env import base_env

PACKAGES = {"@qwen-code/qwen-code": "0.24.4"}


class QwenCode:
    name = "qwen-code"

    def install(self, bundle_root: Path) -> Path:
        return install_npm_harness(bundle_root, self.name, PACKAGES, "qwen")

    def command(self, *, prompt: str, proxy_url: str, api_key: str, model: str, home: str,
                bundle: str, max_steps: int) -> AgentCommand:
        settings = {
            "security": {"auth": {"selectedType": "openai"}},
            "model": {"name": model, "maxSessionTurns": max_steps},
            "general": {"enableAutoUpdate": False},
            "privacy": {"usageStatisticsEnabled": False},
        }
        env = base_env(home=home, bundle=bundle) | {
            "OPENAI_BASE_URL": proxy_url + "/v1",
            "OPENAI_API_KEY": api_key,
            "OPENAI_MODEL": model,
            "QWEN_USAGE_STATISTICS_ENABLED": "false",
        }
        argv = [f"{bundle}/bin/qwen", "-p", prompt, "--auth-type", "openai", "--model", model,
                "--approval-mode", "yolo"]
        return AgentCommand(argv=argv, env=env, files={".qwen/settings.json": json.dumps(settings, indent=1)})
