"""mini-swe-agent (`mini`), non-streaming Chat Completions through litellm.

The bundle is `pip install --target site/` for python3.11 (the container's Debian python3) and a
`bin/mini` wrapper that runs `python3.11 -I -B` with `site/` put on sys.path by the wrapper
itself, not by PYTHONPATH: the agent's own shell commands then see the task's Python untouched.
Model `openai/<served name>` with `model.model_kwargs.api_base` = `<proxy>/v1` and the session
token as OPENAI_API_KEY; `-y` (yolo), `--exit-immediately` on submit, `agent.step_limit`,
cost limit off (an unknown model has no price), litellm's bundled cost map instead of a download.
Limits: `model.model_kwargs.max_tokens` caps each reply at the served output cap. mini-swe-agent
never compacts (its prompt only grows), so the context window has no knob; a run that outgrows it
ends on the proxy's context-length error.
"""

from __future__ import annotations

from pathlib import Path

from polar_fast.rollouts.harnesses import AgentCommand, ModelLimits
from polar_fast.rollouts.harnesses.bundles import (
    PYTHON_VERSION,
    build_bundle,
    pip_install_target,
    write_script,
)
from polar_fast.rollouts.harnesses.env import base_env

REQUIREMENT = "mini-swe-agent==2.4.6"

_WRAPPER = f"""#!/bin/sh
d=$(cd "$(dirname "$0")/.." && pwd)
exec python{PYTHON_VERSION} -I -B -c '
import runpy, sys
sys.path.insert(0, sys.argv.pop(1))
sys.argv[0] = "mini"
runpy.run_module("minisweagent.run.mini", run_name="__main__", alter_sys=True)
' "$d/site" "$@"
"""


class MiniSweAgent:
    name = "mini-swe-agent"
    # mini.yaml's format_error_template, which it sends back after a reply it cannot use
    format_error_markers = ("Tool call error:", "reached the output token limit")

    def compaction_threshold(self, limits: ModelLimits) -> None:
        return None  # its prompt only grows: the context caps the run

    def install(self, bundle_root: Path) -> Path:
        def build(tmp: Path) -> None:
            pip_install_target(tmp / "site", [REQUIREMENT], what="mini-swe-agent pip install")
            write_script(tmp / "bin" / "mini", _WRAPPER)

        spec = {"pip": [REQUIREMENT], "python": PYTHON_VERSION}
        return build_bundle(bundle_root, self.name, spec, build, ["bin/mini", "--help"])

    def command(self, *, prompt: str, proxy_url: str, api_key: str, model: str, home: str,
                bundle: str, max_steps: int, limits: ModelLimits) -> AgentCommand:
        env = base_env(home=home, bundle=bundle) | {
            "OPENAI_API_KEY": api_key,
            "MSWEA_CONFIGURED": "true",
            "MSWEA_COST_TRACKING": "ignore_errors",
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
            "HF_HUB_OFFLINE": "1",
            "PAGER": "cat",
        }
        argv = [f"{bundle}/bin/mini", "-m", f"openai/{model}", "-t", prompt, "-y", "--exit-immediately",
                "-c", "mini.yaml",
                "-c", f"model.model_kwargs.api_base={proxy_url}/v1",
                "-c", f"model.model_kwargs.max_tokens={limits.max_output_tokens}",
                "-c", f"agent.step_limit={max_steps}",
                "-c", "agent.cost_limit=0",
                "-o", f"{home}/mini-trajectory.json"]
        return AgentCommand(argv=argv, env=env, files={})
