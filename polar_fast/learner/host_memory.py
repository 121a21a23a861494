"""Freed activation memory goes back to the OS at once on a CPU learner (glibc's mmap threshold).

A CPU learner step allocates and frees many activation tensors of a few hundred KiB to a few
MiB, of shapes that change from layer to layer and between forward, recompute and backward.
glibc serves a block above its mmap threshold with its own mapping, unmapped when freed, but it
raises that threshold to the size of each mapped block freed (up to 32 MiB). After the first few
frees every activation is carved from the heap instead, whose freed holes stay resident and
rarely fit the next shapes. Measured with bench/learner_rss_bench.py --malloc-kib on 2 cores, a
bf16 step of SmolLM2-135M at 4,096 tokens with checkpointing:

    threshold   glibc's own   128 KiB   1 MiB   4 MiB (default)
    peak GiB    4.73          3.63      3.65    3.83
    step s      33.6          49.0      43.6    37.5

A mapped block costs a page fault per fresh page, so the lower the threshold the slower the
step; 4 MiB keeps most of the saving for 12% of step time. Fixing the threshold (mallopt) also
stops glibc adjusting it, and the trim threshold returns the heap's free top likewise. The
setting is per process, so it also holds for the embedded engine beside the learner.

Blocks under the threshold still leave holes inside the heap when freed, and only the heap's
free top is trimmed by itself. `release_free_memory` hands every free page back (malloc_trim(0)
madvises the holes away). sft calls it after every step: measured without gradient
checkpointing, the warm start's steps left holes that grew its process from 3.4 to 5.1 GiB
resident between steps over 8 steps (peak 5.75 GB, 6.1 GiB of Pss by the 28th step); released
after each, 2.3 to 2.5 GiB between steps and a peak of 5.39 GB over the same 8 steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys
from functools import cache

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3


@cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") else None  # musl has no mallopt
    except OSError:
        return None


def fix_mmap_threshold(kib: int) -> bool:
    """Serve blocks above `kib` KiB from their own mappings, returned to the OS when freed, and
    trim the heap's free top above it. True when applied. 0 changes nothing: glibc's dynamic
    threshold stays, unless an earlier call in this process fixed one (mallopt cannot undo that)."""
    if kib < 0:
        raise ValueError(f"learner.malloc_mmap_threshold_kib must be >= 0, got {kib}")
    libc = _libc()
    if kib == 0 or libc is None:
        return False
    size = kib * 1024
    return bool(libc.mallopt(M_MMAP_THRESHOLD, size)) and bool(libc.mallopt(M_TRIM_THRESHOLD, size))


def release_free_memory(*, collect: bool = True) -> bool:
    """Collect unreachable cycles (collect=True), then return every free page of the heap to the
    OS. True when malloc_trim ran and released something; False elsewhere (not glibc)."""
    if collect:
        gc.collect()
    libc = _libc()
    return bool(libc is not None and hasattr(libc, "malloc_trim") and libc.malloc_trim(0))
