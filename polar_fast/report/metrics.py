"""Per-step metrics: one JSON line per step in `metrics.jsonl`, and TensorBoard scalars; plus
`groups.jsonl`, one line per finished group saying which learner step took it or withheld it
(the view reads it to say whether a rollout's tokens were trained).

Both sinks take the same flat dict of numbers (nested dicts are flattened with "/"), so what a
user greps in the JSONL is what they plot in TensorBoard. Writes happen in a worker thread: file
I/O stays off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any


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


class MetricsWriter:
    def __init__(self, run_dir: Path, *, tensorboard: bool) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.groups_path = run_dir / "groups.jsonl"
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def write_sync(self, step: int, values: dict[str, Any]) -> dict[str, float]:
        flat = flatten(values)
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **flat}) + "\n")
        if self._tb is not None:
            for name, value in flat.items():
                self._tb.add_scalar(name, value, step)
            self._tb.flush()
        return flat

    async def write(self, step: int, values: dict[str, Any]) -> dict[str, float]:
        return await asyncio.to_thread(self.write_sync, step, values)

    def write_groups_sync(self, step: int, statuses: list[tuple[str, str]]) -> None:
        """(group_id, "trained" | "withheld") for the groups learner step `step` took or withheld."""
        with self.groups_path.open("a") as f:
            f.writelines(json.dumps({"step": step, "group_id": g, "status": s}) + "\n" for g, s in statuses)

    async def write_groups(self, step: int, statuses: list[tuple[str, str]]) -> None:
        await asyncio.to_thread(self.write_groups_sync, step, statuses)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
