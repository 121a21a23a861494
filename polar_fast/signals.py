"""Ctrl-C for long-running commands: the first SIGINT/SIGTERM asks for a graceful stop, a second
one cancels the task that owns the work (when one was given)."""

from __future__ import annotations

import asyncio
import contextlib
import signal


class StopSignal:
    """`with StopSignal(task) as stop: ... await stop.event.wait()`; handlers removed on exit."""

    def __init__(self, task: asyncio.Task | None = None) -> None:
        self.event = asyncio.Event()
        self.signal = ""  # the name of the first signal received, e.g. "SIGTERM"
        self._task = task
        self._loop = asyncio.get_running_loop()
        self._installed: list[int] = []

    def __enter__(self) -> StopSignal:
        for sig in (signal.SIGINT, signal.SIGTERM):
            # not on the main thread (tests) or not on this platform: the command just runs on
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                self._loop.add_signal_handler(sig, self._handle, sig)
                self._installed.append(sig)
        return self

    def _handle(self, sig: signal.Signals) -> None:
        if self.event.is_set() and self._task is not None:
            self._task.cancel()
        self.signal = self.signal or signal.Signals(sig).name
        self.event.set()

    def __exit__(self, *exc: object) -> None:
        for sig in self._installed:
            self._loop.remove_signal_handler(sig)
