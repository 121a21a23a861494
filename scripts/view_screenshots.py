"""Regenerate the screenshots of `python -m polar_fast view` in docs/images/ (shown by README.md).

    .venv/bin/python scripts/view_screenshots.py [--run runs/NAME] [--out docs/images]

Without --run it first makes a small run of its own, as the tests do: two GRPO steps of
mini-swe-agent in a local sandbox on a built-in task, with the model's replies scripted (one
rollout per group applies the known fix, after some reasoning; the other gives up) and every
prompt re-rendered, so the token view has a prefix break to show. Needs Debian's chromium and
chromium-driver (scripts/test.sh installs them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def bash_call(command: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "bash", "arguments": {"command": command}}) + "\n</tool_call>"


def make_run(out: Path) -> Path:
    from polar_fast.config import parse_config
    from polar_fast.rollouts.tasks import load_builtin
    from polar_fast.train import train

    task = load_builtin()[0]
    fix = bash_call(f"cat > /tmp/fix.patch <<'POLAR_EOF'\n{task.patch}POLAR_EOF\ngit apply /tmp/fix.patch")
    submit = bash_call("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
    group = ["<think>The quoted-field test fails; I will apply the fix.</think>\n" + fix, submit, bash_call("ls"), submit]
    steps = 2
    cfg = parse_config({
        "run": {"output_dir": str(out / "run"), "steps": steps, "groups_per_step": 1, "tensorboard": False},
        "engine": {"kind": "scripted", "scripted_replies": group * (steps + 1)},
        "sampling": {"max_tokens": 4096},
        "proxy": {"history": "template"},
        "sandbox": {"kind": "local"},
        "harness": {"name": "mini-swe-agent", "max_steps": 4, "timeout_s": 120},
        "tasks": {"source": "builtin", "limit": 1},
        "pools": {"group_size": 2, "boot_workers": 1, "agent_workers": 1, "eval_workers": 1, "prewarm": 0},
        "learner": {"lr": 1e-3},
    })
    asyncio.run(train(cfg))
    return out / "run"


def wait_ready(driver) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 300).until(lambda d: d.execute_script("return document.body.dataset.ready"))


def screenshots(run: Path, out: Path) -> list[Path]:
    from selenium.webdriver.common.by import By

    from polar_fast.report.view.browser import chromium, view_server

    out.mkdir(parents=True, exist_ok=True)
    shots = []
    with view_server(run) as url, chromium(width=1400, height=1000) as d:
        d.get(url)
        wait_ready(d)
        shots.append(out / "view-run.png")
        d.save_screenshot(str(shots[-1]))
        d.get(url + "rollouts")
        wait_ready(d)
        shots.append(out / "view-rollouts.png")
        d.save_screenshot(str(shots[-1]))
        rows = d.find_elements(By.CSS_SELECTOR, "tr[data-rollout-id]")
        rollout = rows[0].get_attribute("data-rollout-id")
        d.get(f"{url}rollouts/{rollout}?layout=tree")
        wait_ready(d)
        breaks = d.find_elements(By.CSS_SELECTOR, ".break")
        target = breaks[0] if breaks else d.find_element(By.ID, "tokens")
        d.execute_script("arguments[0].scrollIntoView({block: 'center'})", target)
        shots.append(out / "view-rollout.png")
        d.save_screenshot(str(shots[-1]))
    return shots


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, help="an existing run's output_dir (default: make a small one)")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = args.run or make_run(Path(tmp))
        for path in screenshots(run, args.out):
            print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
