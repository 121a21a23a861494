"""Learner items: memory per GPU (learner/memory.py) against the device, and disk for checkpoints.

Memory: the estimate for the run's learner ranks (--nproc-per-node, else the GPUs in
CUDA_VISIBLE_DEVICES for a CUDA learner, else 1) must fit in DEVICE_SHARE of one device's
memory (a GPU's, or the host's for a CPU learner); the rest is for the CUDA context and the
allocator. Disk: each checkpoint holds the full fp32 weights and AdamW state (12 bytes per
parameter), kept as run.keep_checkpoints says, plus the serving copy of the weights a vLLM
run writes (weights/, in engine.dtype), against the free space where run.output_dir lives.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from polar_fast.config import Config
from polar_fast.errors import PolarError
from polar_fast.learner.memory import MemoryEstimate, estimate_memory
from polar_fast.preflight import Item, failed, passed

DEVICE_SHARE = 0.95
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights + AdamW exp_avg and exp_avg_sq
GIB = 2**30


def learner_ranks(cfg: Config, nproc_per_node: int = 0, env: str | None = None) -> int:
    if nproc_per_node:
        return nproc_per_node
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "") if env is None else env
    if cfg.learner.device.startswith("cuda") and visible:
        return max(1, len([g for g in visible.split(",") if g.strip()]))
    return 1


def check_learner(cfg: Config, nproc_per_node: int = 0, *, device_bytes: int | None = None) -> list[Item]:
    world = learner_ranks(cfg, nproc_per_node)
    try:
        estimate = estimate_memory(cfg, world=world)
    except (PolarError, OSError, ValueError) as e:
        return [failed("learner", "memory", f"cannot read the model's config: {e}", "point model.path at the "
                       "model's HF directory (config.json is enough for the estimate)"),
                failed("disk", "checkpoints", "needs the model's size", "see learner: memory")]
    return [check_memory(cfg, estimate, device_bytes), check_disk(cfg, estimate)]


def device_memory(device: str) -> tuple[int, str]:
    """(bytes, name) of one device: a GPU, or the host for a CPU learner; (0, why) when unknown."""
    if not device.startswith("cuda"):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host memory (CPU learner)"
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.total,name", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
        mib, name = done.stdout.splitlines()[0].split(",", 1)
        return int(float(mib)) * 2**20, name.strip()
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return 0, "no GPU visible (nvidia-smi)"


def _parts(e: MemoryEstimate, checkpointing: bool) -> str:
    acts = e.activations_checkpointed if checkpointing else e.activations
    parts = [("weights", e.weights), ("gradients", e.gradients), ("AdamW", e.optimizer), ("KL reference", e.reference),
             ("FSDP2 gathered", e.gathered), ("bf16 casts", e.casts), (f"activations at {e.tokens:,} tokens", acts),
             ("logits", e.logits)]
    return ", ".join(f"{name} {value / GIB:.1f}" for name, value in parts if value)


def check_memory(cfg: Config, e: MemoryEstimate, device_bytes: int | None = None) -> Item:
    gc = cfg.learner.gradient_checkpointing
    total = e.total_bytes(checkpointing=gc)
    other = e.total_bytes(checkpointing=not gc)
    size, device = (device_bytes, "the device") if device_bytes is not None else device_memory(cfg.learner.device)
    ranks = f"{e.world} rank{'s' if e.world > 1 else ''}"
    evidence = (f"{total / GIB:.1f} GiB per rank ({ranks}, {e.params / 1e9:.2f}B parameters; GiB: {_parts(e, gc)}; "
                f"gradient checkpointing {'on' if gc else 'off'}, {'off' if gc else 'on'}: {other / GIB:.1f})")
    if not size:
        return failed("learner", "memory", f"{evidence}; {device}", "run check on the GPU node")
    budget = int(size * DEVICE_SHARE)
    evidence += f" against {size / GIB:.1f} GiB of {device}"
    if total <= budget:
        return passed("learner", "memory", evidence)
    if not gc and other <= budget:
        fix = f"set learner.gradient_checkpointing = true ({other / GIB:.1f} GiB)"
    else:
        per_token = (e.activations_checkpointed if gc else e.activations) / max(e.tokens, 1)
        fix = (f"lower merge.max_tokens (about {per_token / 2**20:.2f} MiB per token) or learner.logprob_chunk_tokens, "
               "or shard over more learner ranks (torchrun --nproc_per_node)")
    return failed("learner", "memory", evidence + f": over {DEVICE_SHARE:.0%} of it", fix)


def checkpoints_kept(cfg: Config) -> int:
    run = cfg.run
    written = run.steps // max(run.checkpoint_every, 1) + (run.steps % max(run.checkpoint_every, 1) != 0)
    return min(written, run.keep_checkpoints) if run.keep_checkpoints else written


def check_disk(cfg: Config, e: MemoryEstimate) -> Item:
    kept = checkpoints_kept(cfg)
    one = e.params * CHECKPOINT_BYTES_PER_PARAM
    serving = e.params * (2 if cfg.engine.dtype != "float32" else 4) if cfg.engine.kind == "vllm" else 0
    need = kept * one + serving
    where = Path(cfg.run.output_dir).absolute()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    keep = f"run.keep_checkpoints = {cfg.run.keep_checkpoints}" if cfg.run.keep_checkpoints else "all kept"
    evidence = (f"{kept} checkpoint{'' if kept == 1 else 's'} of {one / GIB:.1f} GiB ({keep}; {cfg.run.steps} steps, one every "
                f"{cfg.run.checkpoint_every})" + (f" + {serving / GIB:.1f} GiB of served weights" if serving else "")
                + f" = {need / GIB:.1f} GiB; {free / GIB:.1f} GiB free at {where}")
    if need > free:
        return failed("disk", "checkpoints", evidence, "set run.keep_checkpoints (the newest are kept), raise "
                      "run.checkpoint_every, or point run.output_dir at a larger disk")
    return passed("disk", "checkpoints", evidence)
