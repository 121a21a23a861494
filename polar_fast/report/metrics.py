"""Per-step metrics: one JSON line per step in `metrics.jsonl`, and TensorBoard scalars; plus
`groups.jsonl`, one line per finished group saying which learner step took it or withheld it
(the view reads it to say whether a rollout's tokens were trained).

Every sink takes the same flat dict of numbers (nested dicts are flattened with "/"), so what a
user greps in the JSONL is what they plot in TensorBoard or, with `run.wandb` on (the optional
`wandb` extra), in Weights & Biases: one W&B run per output dir, its id derived from the dir so a
resumed run continues it, files under `<output_dir>/wandb`. Writes happen in a worker thread:
file I/O stays off the event loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
from pathlib import Path
from typing import Any

from polar_fast.errors import ConfigError

WANDB_HINT = 'uv pip install -p .venv -e ".[wandb]"'


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, bool):
            out[name] = float(value)
        elif isinstance(value, (int, float)) and math.isfinite(value):
            out[name] = value
    return out


def open_wandb(run_dir: Path, *, mode: str, project: str, config: dict | None = None):
    """A W&B run for this output dir (mode "online" or "offline"), resumed if it exists."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(f"run.wandb = {mode!r} needs the optional wandb package: {WANDB_HINT}") from None
    run_id = hashlib.sha256(str(run_dir.resolve()).encode()).hexdigest()[:16]
    return wandb.init(project=project, name=run_dir.name, id=run_id, resume="allow", dir=str(run_dir),
                      mode=mode, config=config or {})


class MetricsWriter:
    def __init__(self, run_dir: Path, *, tensorboard: bool, wandb: str = "off", wandb_project: str = "polar_fast",
                 config: dict | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.groups_path = run_dir / "groups.jsonl"
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        self._wandb = None
        if wandb != "off":
            self._wandb = open_wandb(run_dir, mode=wandb, project=wandb_project, config=config)

    def write_sync(self, step: int, values: dict[str, Any]) -> dict[str, float]:
        flat = flatten(values)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **flat}) + "\n")
        if self._tb is not None:
            for name, value in flat.items():
                self._tb.add_scalar(name, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(flat, step=step)
        return flat

    async def write(self, step: int, values: dict[str, Any]) -> dict[str, float]:
        return await asyncio.to_thread(self.write_sync, step, values)

    def write_groups_sync(self, step: int, statuses: list[tuple[str, str]]) -> None:
        """(group_id, "trained" | "withheld" | "skipped" | "interrupted") for the groups learner step
        `step` took, withheld, skipped, or had when a stop request interrupted it."""
        with self.groups_path.open("a") as f:
            f.writelines(json.dumps({"step": step, "group_id": g, "status": s}) + "\n" for g, s in statuses)

    async def write_groups(self, step: int, statuses: list[tuple[str, str]]) -> None:
        await asyncio.to_thread(self.write_groups_sync, step, statuses)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
