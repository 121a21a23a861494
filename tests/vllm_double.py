"""An HTTP test double of `vllm serve`: the routes polar_fast calls, with no model behind them.

- POST /inference/v1/generate answers `[len(prompt), 7, 8]`, each with logprob -0.5, labelled
  (`weight_versions`) by the version /update_weight_version last set; none before the first.
  vLLM never sees session ids, so the double records each prompt's first token as the caller's
  session: tests put a session number there. While paused, calls wait for /resume (mode keep).
- /pause, /resume, /reset_prefix_cache, /update_weight_version and /collective_rpc are logged in
  order; reload_weights reads `<served dir>/model.safetensors` and records its sha256, so a test
  sees which weights each replica loaded.
- GET /health, /v1/models (the served name), /version, /openapi.json (its routes), and
  /double/state: what it saw (test-only route).

In process: `await VllmDouble().start()` on 127.0.0.1. As a process: `main(argv)` takes the
launcher's command line (`vllm serve <dir> ...` or `-m vllm.entrypoints.openai.api_server
--model <dir> ...`), so tests start it through the real launch path: `fake_vllm_python(dir)`
writes a Python wrapper (for `engine.launch_python`) whose `vllm` package is this double.
`tiny_hf_dir` makes a model directory the launcher accepts.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import sys
from pathlib import Path

from aiohttp import web

TESTS = Path(__file__).resolve().parent


class VllmDouble:
    def __init__(self, *, name: str = "m", model_dir: str = "") -> None:
        self.name = name
        self.model_dir = model_dir
        self.version = ""  # the label /update_weight_version set
        self.loaded = ""  # sha256 of the model.safetensors the last reload read
        self.sessions: set[int] = set()  # first prompt token of every generate call
        self.calls = 0
        self.control: list[str] = []  # dev-mode routes, in order (path with query)
        self._running = asyncio.Event()
        self._running.set()
        self._runner: web.AppRunner | None = None
        self.url = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/inference/v1/generate", self._generate)
        for path in ("/pause", "/resume", "/reset_prefix_cache", "/update_weight_version", "/collective_rpc"):
            app.router.add_post(path, self._control)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        app.router.add_get("/openapi.json", self._openapi)
        app.router.add_get("/double/state", self._state)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.name, "object": "model"}]})

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    async def _openapi(self, request: web.Request) -> web.Response:  # the routes, as preflight reads them
        paths = {r.resource.canonical: {} for r in request.app.router.routes() if r.resource is not None}
        return web.json_response({"paths": paths})

    async def _generate(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body["token_ids"]
        self.sessions.add(prompt[0] if prompt else -1)
        self.calls += 1
        await self._running.wait()  # paused in mode keep: frozen until /resume
        ids = [len(prompt), 7, 8]
        spans = [{"version": self.version, "start": 0, "end": len(ids)}] if self.version else None
        return web.json_response({"request_id": "r", "choices": [{
            "index": 0, "token_ids": ids, "finish_reason": "stop", "weight_versions": spans,
            "logprobs": {"content": [{"token_id": i, "logprob": -0.5} for i in ids]}}]})

    async def _control(self, request: web.Request) -> web.Response:
        text = await request.text()
        body = json.loads(text) if text else {}
        self.control.append(request.path_qs)
        if request.path == "/pause":
            self._running.clear()
        elif request.path == "/resume":
            self._running.set()
        elif request.path == "/update_weight_version":
            self.version = str(body["new_version"])
        elif request.path == "/collective_rpc" and body.get("method") == "reload_weights" and self.model_dir:
            self.loaded = await asyncio.to_thread(sha256, Path(self.model_dir) / "model.safetensors")
        return web.json_response({"success": True})

    async def _state(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.version, "loaded": self.loaded, "sessions": sorted(self.sessions),
                                  "calls": self.calls, "control": self.control, "pid": os.getpid()})

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        self._runner = web.AppRunner(self.app())
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.url = f"http://{host}:{site._server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        """Stops answering: connections are refused from now on."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str], *, handle_signals: bool = True) -> None:
    """Serve the double as the launcher's command line asks (module docstring)."""

    def value(flag: str) -> str:
        return argv[argv.index(flag) + 1]

    model_dir = value("--model") if "--model" in argv else argv[argv.index("serve") + 1]
    double = VllmDouble(name=value("--served-model-name"), model_dir=model_dir)
    web.run_app(double.app(), host=value("--host"), port=int(value("--port")), print=None,
                handle_signals=handle_signals)


def fake_vllm_python(directory: Path) -> Path:
    """A `python` wrapper whose `vllm.entrypoints.openai.api_server` serves this double: what
    `engine.launch_python` runs as `<python> -m vllm.entrypoints.openai.api_server ...`."""
    server = directory / "pkg" / "vllm" / "entrypoints" / "openai"
    server.mkdir(parents=True)
    for package in (server.parents[1], server.parent, server):
        (package / "__init__.py").write_text("")
    (server / "api_server.py").write_text("import sys\nfrom vllm_double import main\nmain(sys.argv[1:])\n")
    wrapper = directory / "python"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH="{directory / "pkg"}:{TESTS}" exec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def tiny_hf_dir(path: Path, *, shards: int = 1) -> Path:
    """config.json, a tokenizer file and safetensors weights: enough for prepare_model_dir."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "tokenizer.json").write_text("{}")
    (path / "generation_config.json").write_text('{"top_k": 20}')
    for i in range(shards):
        name = "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({f"layer{i}.weight": torch.full((2, 2), float(i))}, str(path / name))
    if shards > 1:
        (path / "model.safetensors.index.json").write_text("{}")
    return path
