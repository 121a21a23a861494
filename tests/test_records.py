"""Call/rollout records and the crash-safe record log."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import msgspec
import pytest

from polar_fast.records import (
    CallRecord,
    Outcome,
    RecordLog,
    RolloutRecord,
    Timings,
    encode_frame,
    read_log,
)


def make_call(i: int) -> CallRecord:
    return CallRecord(
        session_id="s", rollout_id="r", group_id="g", call_index=i,
        prompt_ids=list(range(i + 3)), completion_ids=[7, 8], completion_logprobs=[-0.5, -1.25],
        policy_version=2, finish_reason="tool_calls", dialect="responses",
        timings=Timings(started_at=1.0, render_s=0.01, engine_s=0.2, total_s=0.25),
    )


def test_round_trip_of_both_record_kinds(tmp_path):
    path = tmp_path / "calls.log"
    rollout = RolloutRecord(rollout_id="r", group_id="g", task_id="t", harness="codex",
                            outcome=Outcome.INFRA_ERROR, error="container exited 137")
    with RecordLog(path) as log:
        log.append(make_call(0))
        log.append(rollout)
        log.append(make_call(1))
    contents = read_log(path)
    assert contents.records == [make_call(0), rollout, make_call(1)]
    assert contents.calls == [make_call(0), make_call(1)]
    assert contents.rollouts[0].reward is None
    assert contents.torn_bytes == 0 and contents.valid_bytes == path.stat().st_size


def test_mismatched_logprobs_are_rejected():
    with pytest.raises(ValueError, match="2 completion ids but 1 logprobs"):
        make_call(0).__class__(**{**msgspec.structs.asdict(make_call(0)), "completion_logprobs": [0.0]})


@pytest.mark.parametrize("cut", [1, 5, 8, 12, -1])
def test_torn_tail_keeps_every_complete_record(tmp_path, cut):
    path = tmp_path / "calls.log"
    with RecordLog(path) as log:
        for i in range(3):
            log.append(make_call(i))
    whole = path.read_bytes()
    last = len(encode_frame(make_call(2)))
    keep = len(whole) - last + (cut if cut > 0 else last - 1)
    path.write_bytes(whole[:keep])
    contents = read_log(path)
    assert contents.calls == [make_call(0), make_call(1)]
    assert contents.torn_bytes == keep - (len(whole) - last)
    assert contents.torn_reason


def test_corrupted_payload_is_reported_not_decoded(tmp_path):
    path = tmp_path / "calls.log"
    with RecordLog(path) as log:
        log.append(make_call(0))
        log.append(make_call(1))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    contents = read_log(path)
    assert contents.calls == [make_call(0)]
    assert "checksum" in contents.torn_reason


def test_appends_after_a_crash_are_recovered_up_to_the_tear(tmp_path):
    """A process killed mid-write leaves a torn frame; a new writer appends after it. The reader
    keeps everything before the tear (what was captured before the crash is never lost)."""
    path = tmp_path / "calls.log"
    with RecordLog(path) as log:
        log.append(make_call(0))
    with open(path, "ab") as f:
        f.write(encode_frame(make_call(1))[:10])
    contents = read_log(path)
    assert contents.calls == [make_call(0)] and contents.torn_bytes == 10


def test_reopening_cuts_a_torn_tail_so_new_appends_stay_readable(tmp_path):
    path = tmp_path / "calls.log"
    with RecordLog(path) as log:
        log.append(make_call(0))
    with open(path, "ab") as f:
        f.write(encode_frame(make_call(1))[:10])
    with RecordLog(path) as log:  # a resumed run
        assert log.repaired_bytes == 10
        log.append(make_call(2))
    contents = read_log(path)
    assert contents.calls == [make_call(0), make_call(2)] and contents.torn_bytes == 0


def test_kill_9_mid_stream_loses_nothing_written(tmp_path):
    path = tmp_path / "calls.log"
    script = textwrap.dedent(
        f"""
        import os, sys
        from polar_fast.records import RecordLog, CallRecord
        log = RecordLog({str(path)!r})
        i = 0
        while True:
            log.append(CallRecord(session_id="s", rollout_id="r", group_id="g", call_index=i,
                prompt_ids=list(range(2000)), completion_ids=[1], completion_logprobs=[0.0],
                policy_version=0, finish_reason="stop", dialect="chat"))
            i += 1
            if i == 200:
                print("ready", flush=True)
        """
    )
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout.readline().strip() == "ready"
        os.kill(proc.pid, 9)
        proc.wait()
    contents = read_log(path)
    indices = [c.call_index for c in contents.calls]
    assert len(indices) >= 200 and indices == list(range(len(indices)))
