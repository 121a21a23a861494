#!/usr/bin/env bash
# Installs everything the tests need (Python deps, Rust toolchain checks, Docker Engine) and runs
# the whole suite: cargo tests of the merge crate, then pytest. Works on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install.sh test
.venv/bin/python -m polar_fast harnesses install --all  # harness CLI bundles, cached
bash scripts/docker_up.sh

cargo test -q --manifest-path rust/merge/Cargo.toml
# CI turns a skipped Docker test into a failure, so a broken engine never passes silently.
POLAR_REQUIRE_DOCKER="${POLAR_REQUIRE_DOCKER:-${CI:-}}" .venv/bin/python -m pytest -q "$@"
