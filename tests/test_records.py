"""Call/rollout records and the crash-safe record log."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import zlib
from array import array

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_fast.conversation import Message
from polar_fast.records import (
    CallRecord,
    ExchangeRecord,
    Outcome,
    RecordLog,
    LogInUse,
    RolloutRecord,
    RunEndRecord,
    Timings,
    attempt_id,
    attempt_of,
    decode_frame,
    encode_frame,
    packed_ids,
    log_in_use,
    read_log,
    whole_calls,
    whole_exchanges,
)
from polar_fast.wire import crc32


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
    end = RunEndRecord(reason="finished: 2 of 2 steps done", step=2, abandoned=1, ended_at=1.5)
    with RecordLog(path) as log:
        log.append(make_call(0))
        log.append(rollout)
        log.append(make_call(1))
        log.append(end)
    contents = read_log(path)
    assert contents.records == [make_call(0), rollout, make_call(1), end]
    assert contents.calls == [make_call(0), make_call(1)]
    assert contents.rollouts[0].reward is None
    assert contents.torn_bytes == 0 and contents.valid_bytes == path.stat().st_size


# ids at every msgpack width boundary (fixint, uint8/16/32), lists across the fixarray/array16/32 sizes
_ids = st.lists(st.sampled_from([0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1]) | st.integers(0, 2**32 - 1))


@settings(max_examples=200, deadline=None)
@given(turns=st.lists(st.tuples(_ids, _ids, st.booleans()), min_size=1, max_size=6), lost=st.integers(-1, 6))
def test_call_deltas_read_back_whole(tmp_path_factory, turns, lost):
    # A session's calls as the proxy stores them: each prompt extends the previous call's
    # prompt + completion (cut anywhere inside them, `cut`) by new ids, and the record holds only
    # those. Read back, every call is whole again; with one record lost, exactly the calls that
    # depend on it are left out and counted, never completed wrongly.
    path = tmp_path_factory.mktemp("log") / "records.log"
    wanted, previous = [], None
    with RecordLog(path) as log:
        for i, (new, completion, cut) in enumerate(turns):
            n_prefix = 0
            if previous is not None:
                joined = previous.prompt_ids + previous.completion_ids
                n_prefix = len(joined) if cut else len(joined) // 2
            prompt = (previous.prompt_ids + previous.completion_ids)[:n_prefix] + new if previous else new
            whole = msgspec.structs.replace(make_call(i), prompt_ids=prompt, completion_ids=completion,
                                            completion_logprobs=[-0.5] * len(completion))
            wanted.append(whole)
            if i != lost:
                log.append(msgspec.structs.replace(whole, prompt_ids=new, prefix_call=i - 1 if previous else -1,
                                                   n_prefix=n_prefix))
            previous = whole
    contents = read_log(path)
    got = {c.call_index: c for c in contents.calls}
    assert all(got[i] == wanted[i] for i in got)
    _, missing = whole_calls(r for r in contents.records if isinstance(r, CallRecord))
    assert len(got) + missing + (0 <= lost < len(turns)) == len(turns)
    assert missing == (len(turns) - lost - 1 if 0 <= lost < len(turns) else 0)


_texts = st.sampled_from(["", "ls", "done", "x" * 40])
_message = st.builds(Message, role=st.sampled_from(["system", "user", "assistant", "tool"]), content=_texts)


def _exchange(call_index: int, messages: list, prefix_call: int = -1, n_prefix: int = 0) -> ExchangeRecord:
    return ExchangeRecord(session_id="s", rollout_id="r", group_id="g", call_index=call_index, model="m", dialect="chat",
                          messages=messages, reply=Message(role="assistant", content="ok"),
                          prefix_call=prefix_call, n_prefix=n_prefix)


@settings(max_examples=200, deadline=None)
@given(start=st.lists(_message, max_size=20), edits=st.lists(st.tuples(st.integers(0, 25), st.lists(_message, max_size=4)), max_size=6),
       lost=st.integers(-1, 6))
def test_exchange_deltas_read_back_whole(tmp_path_factory, start, edits, lost):
    # A session's conversations: each call keeps a prefix of the last one (cut at `keep`:
    # growth, compaction, edits) and appends new turns, stored as a delta against the call
    # before. Read back, every exchange is whole again; one call's record lost (`lost`) loses
    # exactly the ones that cannot be completed without it, never completes one wrongly.
    path = tmp_path_factory.mktemp("log") / "records.log"
    wanted, previous = [], []
    with RecordLog(path) as log:
        for call_index, (keep, new) in enumerate([(len(start), [])] + edits):
            messages = (previous or start)[:keep] + new if call_index else start
            n = next((i for i, (a, b) in enumerate(zip(messages, previous)) if a != b), min(len(messages), len(previous)))
            delta = _exchange(call_index, messages[n:], call_index - 1, n) if n else _exchange(call_index, messages)
            wanted.append(_exchange(call_index, messages))
            if call_index != lost:
                log.append(delta)
            previous = messages
    contents = read_log(path)
    got = {e.call_index: e for e in contents.exchanges}
    assert all(got[i] == wanted[i] for i in got)  # whole, and right
    _, missing = whole_exchanges(r for r in contents.records if isinstance(r, ExchangeRecord))
    assert len(got) + missing + (0 <= lost < len(wanted)) == len(wanted)
    if lost < 0:
        assert missing == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096), st.integers(0, 4096))
def test_frame_checksum_is_zlibs_crc32(data, cut):
    # the Rust crc32 (crc32fast) and zlib must agree: logs written by either read with both
    assert crc32(data) == zlib.crc32(data)
    assert crc32(data[cut:]) == zlib.crc32(data[cut:])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=70000) | st.lists(st.integers(0, 70000), max_size=20))
def test_packed_ids_are_what_msgspec_writes(ids):
    packed = packed_ids(array("i", ids))
    assert bytes(packed) == msgspec.msgpack.encode(ids) == bytes(packed_ids(ids))
    record = CallRecord(session_id="s", rollout_id="r", group_id="", call_index=0, prompt_ids=packed, completion_ids=[1],
                        completion_logprobs=[-0.5], policy_version=0, finish_reason="stop", dialect="chat")
    assert decode_frame(encode_frame(record)).prompt_ids == ids


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
        assert log_in_use(path)  # a live writer holds it: view calls its rollouts running
        with pytest.raises(LogInUse, match="one writer at a time"):
            RecordLog(path)
        os.kill(proc.pid, 9)
        proc.wait()
    assert not log_in_use(path)  # the kernel dropped the lock with the process
    contents = read_log(path)
    indices = [c.call_index for c in contents.calls]
    assert len(indices) >= 200 and indices == list(range(len(indices)))
    with RecordLog(path) as log:  # a resumed run takes it over (cutting the torn tail, if any)
        assert log_in_use(path)
    assert not log_in_use(path)


def test_attempt_ids_round_trip():
    assert attempt_id("g-r1", 0) == "g-r1" and attempt_of("g-r1") == ("g-r1", 0)
    assert attempt_id("g-r1", 2) == "g-r1.a2" and attempt_of("g-r1.a2") == ("g-r1", 2)
    assert attempt_of("task.alpha-g0-r1") == ("task.alpha-g0-r1", 0)  # ".a" not followed by digits


def test_a_failed_put_fails_alone_and_leaves_nothing_in_the_log(tmp_path):
    """Three puts in one writer batch, the middle one unwritable: the batch's one write fails,
    each put is then written on its own, and only the middle one raises."""
    import asyncio

    from polar_fast.capture.recorder import Recorder

    bad = msgspec.structs.replace(make_call(1), dialect=object())  # msgpack cannot encode it

    async def main() -> list:
        with RecordLog(tmp_path / "calls.log") as log:
            recorder = Recorder(log)
            puts = [asyncio.ensure_future(recorder.put(r)) for r in (make_call(0), bad, make_call(2))]
            await asyncio.sleep(0)  # all three queued before the writer starts: one batch
            recorder.close()
            await recorder.run()
            assert recorder.statistics().batches == 1 and recorder.statistics().written == 2
            return await asyncio.gather(*puts, return_exceptions=True)

    outcomes = asyncio.run(main())
    assert outcomes[0] is None and outcomes[2] is None and isinstance(outcomes[1], TypeError)
    contents = read_log(tmp_path / "calls.log")
    assert contents.calls == [make_call(0), make_call(2)] and contents.torn_bytes == 0
