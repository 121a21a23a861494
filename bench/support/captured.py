"""The real captured sessions in bench/data/captured/ (written by capture_sessions.py), read back.

Each `<harness>.log.gz` is a gzipped proxy record log holding one group's CallRecords in capture
order, prompt deltas included; polar_fast.records completes them. meta.json carries the
tokenizer's end-of-turn id (Polar's chain needs it) and what each rollout did.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from polar_fast.records import CallRecord, iter_frames, whole_calls

CAPTURED = Path(__file__).resolve().parents[1] / "data" / "captured"


def read_meta(root: Path = CAPTURED) -> dict:
    return json.loads((root / "meta.json").read_text())


def group_calls(harness: str, root: Path = CAPTURED) -> list[CallRecord]:
    """One harness's group: every call with its whole prompt, in capture order."""
    data = gzip.decompress((root / read_meta(root)["harnesses"][harness]["file"]).read_bytes())
    calls, missing = whole_calls(r for _, r in iter_frames(data) if isinstance(r, CallRecord))
    if missing:
        raise ValueError(f"{harness}: {missing} calls extend a record the file lacks")
    return calls
