"""The learner's peak resident memory on CPU, per setting: what merge.max_tokens, learner.dtype
and learner.gradient_checkpointing cost one step of SmolLM2-135M, and what they save.

Each setting runs in a process of its own, because a process's peak RSS (ru_maxrss) only grows.
There the run's Learner, on SmolLM2-135M's real weights, takes two GRPO steps (the first creates
AdamW's state) on one group whose `tree` fills one micro-batch of merge.max_tokens tokens: the
unit a step's peak is made of, since micro-batches run one after another and gradients and
optimizer state do not grow with the step. Printed per setting: the RSS once the learner is built
(weights, imports), the peak over the two steps, the second step's time, and learner/memory.py's
estimate of the learner's own part beside it.

    .venv/bin/python bench/learner_rss_bench.py --quick    # two settings at 1024 tokens (~1 min)
    .venv/bin/python bench/learner_rss_bench.py            # seven settings at 8192 and 4096 tokens
    .venv/bin/python bench/learner_rss_bench.py --settings "bfloat16,1,8192;float32,0,2048"
    .venv/bin/python bench/learner_rss_bench.py --malloc-kib 0   # glibc's own mmap threshold

Last line: `RESULT peak_gib_<dtype>_<gc|nogc>_<tokens>=.. ...`.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GIB = 2**30
SHORT = {"float32": "fp32", "bfloat16": "bf16"}
SETTINGS = [  # (learner.dtype, learner.gradient_checkpointing, merge.max_tokens)
    ("float32", False, 8192), ("bfloat16", False, 8192), ("float32", True, 8192), ("bfloat16", True, 8192),
    ("float32", False, 4096), ("bfloat16", False, 4096), ("bfloat16", True, 4096),
]
QUICK = [("float32", False, 1024), ("bfloat16", True, 1024)]


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def one_setting(dtype: str, checkpointing: bool, tokens: int, malloc_kib: int | None = None) -> dict:
    """Runs in the child: build, two steps, measure."""
    from memory_bench import groups

    from polar_fast.config import parse_config
    from polar_fast.grpo import Learner
    from polar_fast.learner.memory import estimate_memory
    from polar_fast.model import load_model

    raw = {"merge": {"max_tokens": tokens},
           "learner": {"dtype": dtype, "gradient_checkpointing": checkpointing, "logprob_chunk_tokens": 1024}}
    if malloc_kib is not None:  # else the config's default
        raw["learner"]["malloc_mmap_threshold_kib"] = malloc_kib
    cfg = parse_config(raw)
    learner = Learner(cfg.learner, load_model(""), layout="tree", max_tokens=tokens)
    built = current_rss_bytes()
    batch = groups(tokens, learner.policy.lm.config.vocab_size)
    learner.step(batch)  # creates the optimizer state
    started = time.perf_counter()
    learner.step(batch)
    step_s = time.perf_counter() - started
    estimate = estimate_memory(cfg).total_bytes(checkpointing=checkpointing)
    return {"dtype": dtype, "gc": checkpointing, "tokens": tokens, "built_gib": built / GIB,
            "peak_gib": peak_rss_bytes() / GIB, "step_s": step_s, "estimate_gib": estimate / GIB}


def run_child(setting: tuple[str, bool, int], malloc_kib: int | None) -> dict:
    dtype, checkpointing, tokens = setting
    kib = "" if malloc_kib is None else malloc_kib
    done = subprocess.run([sys.executable, __file__, "--child", f"{dtype},{int(checkpointing)},{tokens},{kib}"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"learner_rss_bench: {setting} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="two settings at 1024 tokens")
    p.add_argument("--settings", help='"dtype,gc,tokens;..." instead of the table\'s (gc: 0 or 1)')
    p.add_argument("--malloc-kib", type=int, help="learner.malloc_mmap_threshold_kib for every setting "
                   "(0: glibc's own threshold; default: the config's)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        dtype, checkpointing, tokens, kib = args.child.split(",")
        print(json.dumps(one_setting(dtype, bool(int(checkpointing)), int(tokens), int(kib) if kib else None)))
        return 0
    print("| learner.dtype | gradient_checkpointing | merge.max_tokens | RSS built GiB | peak RSS GiB | step s "
          "| estimate GiB |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    result = []
    settings = QUICK if args.quick else SETTINGS
    if args.settings:
        settings = [(d, bool(int(g)), int(t)) for d, g, t in (item.split(",") for item in args.settings.split(";"))]
    for setting in settings:
        r = run_child(setting, args.malloc_kib)
        print(f"| {r['dtype']} | {str(r['gc']).lower()} | {r['tokens']} | {r['built_gib']:.2f} | {r['peak_gib']:.2f} "
              f"| {r['step_s']:.1f} | {r['estimate_gib']:.2f} |", flush=True)
        result.append(f"peak_gib_{SHORT[r['dtype']]}_{'gc' if r['gc'] else 'nogc'}_{r['tokens']}={r['peak_gib']:.2f}")
    print("RESULT " + " ".join(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
