"""Qwen Code (`qwen -p`), OpenAI Chat Completions, streaming.

Auth type "openai" with OPENAI_BASE_URL (`<proxy>/v1`), the session token as OPENAI_API_KEY and
OPENAI_MODEL, in env and in `~/.qwen/settings.json`, which also turns off usage statistics and
auto-update and bounds session turns. `--approval-mode yolo` runs tools without asking.

Qwen Code 0.24.4 settles a non-streaming shell call on the child's "exit" event, which can come
before it has read the child's stdout pipe. Under CPU load (many rollouts on a node) a command
that exits straight after printing then shows the model "Output: (empty)": about half the time in
a 150-call test on this 2-core machine with the cores kept busy. The shell tool runs `bash -c`,
so BASH_ENV points it at a file that makes that bash wait 0.1 s before exiting (the exit status is
kept), which gives Node time to read the pipe. The file unsets BASH_ENV first, so only the tool's
own bash waits and the scripts it starts do not.

Limits: `model.generationConfig.contextWindowSize` (an unknown model otherwise gets Qwen Code's
default window) and `samplingParams.max_tokens`, its per-call output cap. Qwen Code compacts when
the prompt passes `min(context.autoCompactThreshold * window, window - 20k - 13k)`; for windows
under ~33k the second term is negative and the fraction alone decides, so it is set to leave
one reply at the output cap plus a tenth of the window. `model.sessionTokenLimit` is not a
window: past it Qwen Code ends the session, so it stays unset.
"""

from __future__ import annotations

import json
from pathlib import Path

from polar_fast.rollouts.harnesses import AgentCommand, ModelLimits
from polar_fast.rollouts.harnesses.bundles import install_npm_harness
from polar_fast.rollouts.harnesses.env import base_env

PACKAGES = {"@qwen-code/qwen-code": "0.24.4"}
EXIT_WAIT_FILE = ".qwen/shell_exit_wait.sh"  # relative to HOME
EXIT_WAIT = 'unset BASH_ENV\ntrap "sleep 0.1" EXIT\n'
DEFAULT_AUTO_COMPACT_FRACTION = 0.85  # Qwen Code's own default
QWEN_SUMMARY_RESERVE, QWEN_COMPACT_BUFFER = 20_000, 13_000  # its second bound: window - 20k - 13k


def compaction_threshold(limits: ModelLimits) -> int:
    """One reply at the output cap and a tenth of the window below the window (at most Qwen
    Code's own 85%), and below `window - 33k` where that is positive."""
    window = limits.context_tokens
    threshold = min(int(DEFAULT_AUTO_COMPACT_FRACTION * window), window - limits.max_output_tokens - window // 10)
    native = window - QWEN_SUMMARY_RESERVE - QWEN_COMPACT_BUFFER
    return min(threshold, native) if native > 0 else threshold


def auto_compact_fraction(limits: ModelLimits) -> float:
    window = limits.context_tokens
    room = (window - limits.max_output_tokens - window // 10) / window
    return round(min(DEFAULT_AUTO_COMPACT_FRACTION, max(room, 0.05)), 4)


class QwenCode:
    name = "qwen-code"

    def compaction_threshold(self, limits: ModelLimits) -> int:
        return compaction_threshold(limits)

    def install(self, bundle_root: Path) -> Path:
        return install_npm_harness(bundle_root, self.name, PACKAGES, "qwen")

    def command(self, *, prompt: str, proxy_url: str, api_key: str, model: str, home: str,
                bundle: str, max_steps: int, limits: ModelLimits) -> AgentCommand:
        settings = {
            "security": {"auth": {"selectedType": "openai"}},
            "model": {"name": model, "maxSessionTurns": max_steps, "generationConfig": {
                "contextWindowSize": limits.context_tokens,
                "samplingParams": {"max_tokens": limits.max_output_tokens}}},
            "context": {"autoCompactThreshold": auto_compact_fraction(limits)},
            "general": {"enableAutoUpdate": False},
            "privacy": {"usageStatisticsEnabled": False},
        }
        env = base_env(home=home, bundle=bundle) | {
            "BASH_ENV": f"{home}/{EXIT_WAIT_FILE}",
            "OPENAI_BASE_URL": proxy_url + "/v1",
            "OPENAI_API_KEY": api_key,
            "OPENAI_MODEL": model,
            "QWEN_USAGE_STATISTICS_ENABLED": "false",
        }
        argv = [f"{bundle}/bin/qwen", "-p", prompt, "--auth-type", "openai", "--model", model,
                "--approval-mode", "yolo"]
        files = {".qwen/settings.json": json.dumps(settings, indent=1), EXIT_WAIT_FILE: EXIT_WAIT}
        return AgentCommand(argv=argv, env=env, files=files)
