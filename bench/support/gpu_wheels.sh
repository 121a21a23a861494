#!/usr/bin/env bash
# The wheels bench/gpu_check.py needs on a lent device machine, fetched here (where PyPI is
# reachable; nothing can be fetched there) for `run`'s carry:
#
#   bash bench/support/gpu_wheels.sh [DIR]       # default .whl (ignored by .gitignore's *.whl)
#
# The device has Python 3.12 with torch, Triton, numpy and an older transformers, but no msgspec.
# It gets the project's own transformers (this venv's version: the learner's packed recurrence
# hooks the Gated DeltaNet kernels by their names in that version's modeling module) with the
# versions it needs of huggingface-hub (and httpx2, httpcore2, truststore, click, hf-xet),
# kernels (and tomlkit), msgspec, and flash-linear-attention with fla-core (pure Python + Triton:
# the Gated DeltaNet scan kernels). ~23 MB, under run's 64 MiB. Install there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.whl}
py=.venv/bin/python
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pins=()
for name in transformers huggingface-hub httpx2 httpcore2 truststore click hf-xet kernels tomlkit msgspec; do
    pins+=("$name==$(version "$name")")
done
pins+=(flash-linear-attention==0.6.0 fla-core==0.6.0)
mkdir -p "$out"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$out" "${pins[@]}"
ls -la "$out"
