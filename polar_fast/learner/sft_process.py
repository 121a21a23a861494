"""run_sft in a process of its own, so that what a fine-tune held leaves with it.

A warm start fine-tunes the model just before the run builds its own learner and engine in the
same process. Freed, the sft learner's memory only partly goes back: its weights, gradients and
AdamW state are large blocks returned at once, but allocator caches and heap holes remain even
after gc and malloc_trim. Measured with bench/support/rss_tree.py, the default run's own process
peaked at 5.15 GiB after building its warm start in-process, and at 4.53 GiB on the same warm
start cached. In a child process the run's peak is the cached run's.

The child is spawned, not forked (the parent has an event loop and threads running), so it
imports torch and polar_fast afresh (a few seconds); each progress event comes back through a
pipe, then the report or the error. (A pipe, not a multiprocessing.Queue: a queue's semaphore
outlives a run that ends with os._exit, and the resource tracker then warns of a leak.) The child
dies with its parent (PR_SET_PDEATHSIG on Linux), so a run killed mid-build leaves no fine-tune
running.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import signal
import sys
from pathlib import Path
from typing import Callable

import msgspec

from polar_fast.config import Config
from polar_fast.learner.sft import SftError, SftLearner, SftReport

PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h)
POLL_S = 1.0  # how often the parent checks that the child still lives


async def run_sft_in_process(cfg: Config, data: str | Path, build_learner: Callable[[Config], SftLearner], *,
                             out_dir: str | Path, epochs: int | None = None, lr: float | None = None,
                             emit: Callable[[str, dict], None] | None = None, measure: bool = True) -> SftReport:
    """run_sft(cfg, data, build_learner, ...) in a spawned child process. `build_learner` goes there
    by reference, so it must be importable by name (grpo.Learner.from_config is). Its SftError
    comes back as SftError with the same message; any other failure, or a child that dies
    without a report (killed for memory, say), as SftError naming what happened."""
    emit = emit or (lambda kind, data: None)
    context = multiprocessing.get_context("spawn")
    events, child_end = context.Pipe(duplex=False)
    args = (msgspec.msgpack.encode(cfg), str(data), build_learner, str(out_dir), epochs, lr, measure, child_end)
    child = context.Process(target=_child, args=args, name="polar_fast-sft", daemon=True)
    await asyncio.to_thread(child.start)  # spawning reads the cwd and execs: not on the event loop
    child_end.close()  # the child's copy is the only writer left: its exit ends the pipe
    try:
        while True:
            message = await asyncio.to_thread(_next_event, events, child)
            if message[0] == "event":
                emit(message[1], message[2])
            elif message[0] == "report":
                return msgspec.msgpack.decode(message[1], type=SftReport)
            else:
                raise SftError(message[1])
    finally:
        if child.is_alive():  # cancelled, or an error above: the fine-tune stops with us
            child.terminate()
        await asyncio.to_thread(child.join, 30)
        events.close()


def _next_event(events, child) -> tuple:
    while True:
        if events.poll(POLL_S):
            try:
                return events.recv()
            except EOFError:  # the child ended (closed its end) without a last message
                break
        elif not child.is_alive():
            break
    child.join(POLL_S)
    return ("error", f"sft: its process ended with exit code {child.exitcode} before its report "
                     f"(a negative code is the signal that killed it: -9 is often the OOM killer)")


def _child(cfg_bytes: bytes, data: str, build_learner: Callable[[Config], SftLearner], out_dir: str,
           epochs: int | None, lr: float | None, measure: bool, events) -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):
            pass
    from polar_fast.learner.sft import run_sft

    try:
        cfg = msgspec.msgpack.decode(cfg_bytes, type=Config)
        report = run_sft(cfg, data, build_learner, out_dir=out_dir, epochs=epochs, lr=lr, measure=measure,
                         emit=lambda kind, payload: events.send(("event", kind, payload)))
        events.send(("report", msgspec.msgpack.encode(report)))
        code = 0
    except SftError as e:
        events.send(("error", str(e)))
        code = 1
    except BaseException as e:  # anything else: the parent raises it as SftError, named
        events.send(("error", f"sft failed in its process: {type(e).__name__}: {e}"))
        code = 1
    events.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: it would print triton's nanobind "leaked functions" report (see __main__)
    os._exit(code)
