"""A CPU learner's freed activations go back to the OS (learner/host_memory.py): with glibc's
own mmap threshold, once a large block has been freed, later blocks of a few MiB come from the
heap and stay resident after they are freed; with the threshold fixed they do not."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from polar_fast.config import ConfigError, parse_config
from polar_fast.learner.host_memory import fix_mmap_threshold

# 16 MiB freed first raises glibc's dynamic threshold past the 1 MiB blocks that follow; the last
# block stays alive, so the heap's top is not free and trimming it cannot hide the holes
CHILD = textwrap.dedent("""
    import sys
    import torch
    from polar_fast.learner.host_memory import fix_mmap_threshold, release_free_memory

    applied = fix_mmap_threshold(int(sys.argv[1]))
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    big = torch.ones(16 * 2**20 // 4)
    del big
    before = rss()
    blocks = [torch.ones(2**20 // 4) for _ in range(300)]
    last = blocks[-1]
    del blocks
    kept = (rss() - before) // 2**20
    released = release_free_memory() if len(sys.argv) > 2 else False
    print(applied, kept, released, (rss() - before) // 2**20)
""")


def resident_mib_after_free(kib: int, *, release: bool = False) -> tuple[bool, int, bool, int]:
    """(threshold applied, MiB resident after the free, release ran, MiB resident after it)."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(kib), *(["release"] if release else [])],
                         capture_output=True, text=True, check=True)
    applied, kept, released, after = out.stdout.split()
    return applied == "True", int(kept), released == "True", int(after)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_leave_the_process_only_with_the_threshold_fixed():
    applied, kept, _, _ = resident_mib_after_free(128)
    assert applied and kept < 30, f"{kept} MiB of 300 freed MiB still resident with the threshold fixed"
    applied, kept, _, _ = resident_mib_after_free(0)  # glibc's own: the freed MiB stay in the heap
    assert not applied and kept > 200, f"only {kept} MiB resident: glibc's own threshold returned them too"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_gives_back_the_holes_a_free_left_in_the_heap():
    # glibc's own threshold: the 300 freed MiB are holes under a live block, which trimming the
    # heap's top alone cannot reach; release_free_memory hands them back
    _, kept, released, after = resident_mib_after_free(0, release=True)
    assert kept > 200, f"only {kept} MiB resident before the release: nothing for it to show"
    assert released and after < 30, f"{after} MiB of {kept} still resident after release_free_memory"


def test_a_negative_threshold_is_refused_in_the_config_and_the_call():
    with pytest.raises(ConfigError, match="malloc_mmap_threshold_kib"):
        parse_config({"learner": {"malloc_mmap_threshold_kib": -1}})
    with pytest.raises(ValueError, match="malloc_mmap_threshold_kib"):
        fix_mmap_threshold(-1)
