"""Learner checkpoints: model, optimizer, step, policy version and every RNG, in one file.

Full (unsharded) state dicts via torch.distributed.checkpoint.state_dict, which works the same
for a plain module and an FSDP2-sharded one; rank 0 writes `step_<N>.pt` atomically and
`latest` names the newest. Resume restores the RNGs, so a resumed run draws the same numbers
as an uninterrupted one.

A write that fails (disk full, permission) raises CheckpointError on every rank, with the file
and the error; its `.tmp` file is removed, and `latest` still names the previous checkpoint,
which stays whole: the run stops there and `--resume` continues from it.
"""

from __future__ import annotations

import contextlib
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from polar_fast.errors import PolarError

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class CheckpointError(PolarError):
    """A checkpoint could not be written; the previous one is untouched."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    directory: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, version: int
) -> Path:
    """Write step_<step>.pt (rank 0 only; every rank must call it) and point `latest` at it.
    CheckpointError on every rank when rank 0 could not."""
    directory = Path(directory)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_FULL)
    path = directory / f"step_{step}.pt"
    failed = [""]
    if _rank() == 0:
        payload = {"model": model_sd, "optimizer": optim_sd, "step": step, "version": version,
                   "rng": rng_state()}
        failed[0] = _write(directory, path, payload)
    if dist.is_initialized():
        dist.broadcast_object_list(failed, src=0)  # also the barrier: no rank runs ahead of the write
    if failed[0]:
        raise CheckpointError(failed[0])
    return path


def _write(directory: Path, path: Path, payload: dict[str, Any]) -> str:
    """Write `path` then `latest` through .tmp files renamed into place; "" or why it failed."""
    tmp, latest_tmp = path.with_name(path.name + ".tmp"), directory / "latest.tmp"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(payload, tmp)  # torch's zip writer fails with a RuntimeError, the file system with OSError
        tmp.replace(path)
        latest_tmp.write_text(path.name)
        latest_tmp.replace(directory / "latest")
        return ""
    except (OSError, RuntimeError) as e:
        for leftover in (tmp, latest_tmp):
            with contextlib.suppress(OSError):
                leftover.unlink(missing_ok=True)
        why = f"{type(e).__name__}: {str(e).strip()[-300:]}"
        with contextlib.suppress(OSError):  # torch's zip writer does not say ENOSPC: the free space does
            need, free = _tensor_bytes(payload), shutil.disk_usage(directory).free
            if free < need:
                why = f"No space left on device ({free >> 20} MiB free, the checkpoint needs about {need >> 20} MiB); {why}"
        previous = latest_checkpoint(directory) if (directory / "latest").is_file() else None
        kept = f"the previous checkpoint {previous} is whole" if previous else "there is no earlier checkpoint"
        return (f"cannot write checkpoint {path}: {why}. The run stops here; {kept}. Free space (or fix "
                f"permissions) under {directory} and continue with --resume")


def _tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def latest_checkpoint(directory: str | Path) -> Path | None:
    marker = Path(directory) / "latest"
    return Path(directory) / marker.read_text().strip() if marker.exists() else None


def lm_state_dict(payload: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A checkpoint's weights keyed as the HF model names them: the learner saves its PackedLM
    wrapper, whose parameters sit under `lm.`."""
    state = payload["model"]
    if state and all(k.startswith("lm.") for k in state):
        return {k[len("lm."):]: v for k, v in state.items()}
    return state


def load_checkpoint(
    path: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[int, int]:
    """Restore model, optimizer and RNGs in place; returns (step, version)."""
    payload = torch.load(path, map_location="cpu", weights_only=False)
    set_state_dict(model, optimizer, model_state_dict=payload["model"],
                   optim_state_dict=payload["optimizer"], options=StateDictOptions(full_state_dict=True))
    set_rng_state(payload["rng"])
    return int(payload["step"]), int(payload["version"])
