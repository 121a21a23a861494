"""Learner checkpoints: model, optimizer, step, policy version and every RNG, in one file.

Full (unsharded) state dicts via torch.distributed.checkpoint.state_dict, which works the same
for a plain module and an FSDP2-sharded one; rank 0 writes `step_<N>.pt` atomically and
`latest` names the newest. Resume restores the RNGs, so a resumed run draws the same numbers
as an uninterrupted one. `prune_checkpoints` keeps the newest N (run.keep_checkpoints), never the
one `latest` names; `export_hf` writes a checkpoint's weights as an HF model directory.

A write that fails (disk full, permission) raises CheckpointError on every rank, with the file
and the error; its `.tmp` file is removed, and `latest` still names the previous checkpoint,
which stays whole: the run stops there and `--resume` continues from it.
"""

from __future__ import annotations

import contextlib
import random
import re
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


class CheckpointError(PolarError, ValueError):
    """A checkpoint cannot be written, read or exported; the message names the file and why
    (a write that failed leaves the previous checkpoint untouched)."""


_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


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


def prune_checkpoints(directory: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (by step) under `directory`, with the `.hf`
    model dirs exported from them; the one `latest` names always stays. keep = 0 keeps all.
    Returns what was deleted."""
    if keep <= 0:
        return []
    directory = Path(directory)
    steps = sorted((int(m.group(1)), p) for p in directory.glob("step_*.pt")
                   if (m := re.fullmatch(r"step_(\d+)\.pt", p.name)))
    latest = latest_checkpoint(directory)
    removed = []
    for _, path in steps[:-keep]:
        if latest is not None and path.name == latest.name:
            continue
        path.unlink(missing_ok=True)
        shutil.rmtree(path.with_name(path.name + ".hf"), ignore_errors=True)
        removed.append(path)
    return removed


def export_hf(checkpoint: str | Path, base_path: str, out: str | Path) -> Path:
    """The weights of learner checkpoint `checkpoint` (step_N.pt, or the newest in its directory)
    as an HF model directory `out` (config and tokenizer of the base model `base_path`, whose
    architecture the checkpoint must have): loadable by transformers, vLLM, `eval --checkpoint`
    or `model.path`. Raises CheckpointError naming what is wrong."""
    from polar_fast.model import load_model, load_tokenizer

    path = Path(checkpoint)
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"{checkpoint}: a directory without a `latest` file holds no learner checkpoint")
        path = found
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
        model = load_model(base_path, dtype="float32", device="cpu")
        model.load_state_dict(lm_state_dict(payload))
    except (KeyError, RuntimeError, OSError, EOFError) as e:
        raise CheckpointError(f"checkpoint {path}: cannot load it into model {base_path or 'default'}: {e}") from None
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    load_tokenizer(base_path).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out


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
