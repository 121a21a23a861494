"""Watching and stopping a learner step from outside the thread that runs it.

A step on long sequences runs for minutes on a CPU (a micro-batch of 8192 tokens takes about a
minute), so Ctrl-C cannot wait for its end, and a person watching needs to see it move.
`StepControl` is shared by the thread running `Learner.step` and the event loop: the loop sets
`stop` (a threading.Event) and reads the progress fields; the step checks `stop` between
micro-batches, between decoder layers (forward, and backward through a hook on each layer's
output: packed_forward.PackedLM) and between logprob chunks, and leaves by StepInterrupted
before its optimizer update, so the weights stay those of the last finished step.

Under torchrun rank 0 alone cannot leave a collective call the other ranks are in, so a
multi-rank step is not interruptible (`interruptible = False`): a stop waits for its end.
"""

from __future__ import annotations

import threading
import time

from polar_fast.errors import PolarError


class StepInterrupted(PolarError):
    """A stop request ended a learner step before its update; nothing of it was applied."""


class StepControl:
    def __init__(self) -> None:
        self.stop = threading.Event()
        self.interruptible = True
        self.started = time.monotonic()
        self.micro_batch = 0  # 1-based: the one running; 0 before the first
        self.n_micro_batches = 0
        self.tokens_done = 0  # tokens of the micro-batches finished
        self.tokens_total = 0
        self.phase = "preparing"  # then "forward layer", "backward layer", "logprob chunk"
        self.index = 0  # 1-based: which layer or chunk of the phase
        self.count = 0

    def check(self) -> None:
        if self.interruptible and self.stop.is_set():
            raise StepInterrupted(f"stopped at {self.describe()}")

    def begin(self, tokens: list[int]) -> None:
        """The micro-batches this step will forward (their token counts), in order."""
        self.n_micro_batches, self.tokens_total = len(tokens), sum(tokens)

    def at(self, phase: str, index: int, count: int) -> None:
        """Part `index` (0-based) of `count` of `phase` is due; stops the step when asked."""
        self.phase, self.index, self.count = phase, index + 1, count
        self.check()

    def describe(self) -> str:
        """'micro-batch 2 of 5 (8,192 of 30,721 tokens done), backward layer 3 of 30, 95 s'"""
        where = f", {self.phase} {self.index} of {self.count}" if self.count else f", {self.phase}"
        return (f"micro-batch {self.micro_batch} of {self.n_micro_batches} ({self.tokens_done:,} of "
                f"{self.tokens_total:,} tokens done){where}, {time.monotonic() - self.started:.0f} s")
