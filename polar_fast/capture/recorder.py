"""The record writer: a bounded queue of call records drained into the run's `RecordLog`.

`put()` waits until the record is on disk (appended, and fsynced when the log says so), so the
proxy can finish a reply knowing its record survives a crash. A full queue makes `put()` wait:
backpressure instead of unbounded memory. Appends run in a worker thread (file writes block);
the writer takes everything queued at once and appends it in one thread hop and one write. A
put whose records could not be appended raises that error, and none of its records stays in the
log. `run()` is meant for the app's TaskGroup; `close()` lets it finish what is queued and return.
"""

from __future__ import annotations

import asyncio

import msgspec

from polar_fast.records import Record, RecordLog


class RecorderStatistics(msgspec.Struct, frozen=True):
    queued: int
    written: int
    batches: int


class Recorder:
    def __init__(self, log: RecordLog, *, queue_size: int = 1024) -> None:
        self.log = log
        # one (records, future) item per put(); None stops run()
        self._queue: asyncio.Queue[tuple[tuple[Record | bytes, ...], asyncio.Future[None]] | None] = asyncio.Queue(queue_size)
        self._written = 0
        self._batches = 0

    async def put(self, *records: Record | bytes) -> None:
        """Hand records (or frames encoded already) to the writer and wait until they are
        appended to the log, in order and in one batch (a call record and its exchange record
        land together)."""
        done = asyncio.get_running_loop().create_future()
        await self._queue.put((records, done))
        await done

    def close(self) -> None:
        """Ask `run()` to return once everything queued so far is written."""
        self._queue.put_nowait(None)

    async def run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty() and batch[-1] is not None:
                batch.append(self._queue.get_nowait())
            items = [item for item in batch if item is not None]
            if items:
                outcomes = await asyncio.to_thread(self._write, [records for records, _ in items])
                for (records, done), error in zip(items, outcomes):
                    if error is None:
                        self._written += len(records)
                    if done.done():  # its caller went away
                        continue
                    if error is None:
                        done.set_result(None)
                    else:
                        done.set_exception(error)
                self._batches += 1
            if batch[-1] is None:
                return

    def _write(self, puts: list[tuple[Record | bytes, ...]]) -> list[Exception | None]:
        """Append a batch in one write; when that fails, each put's records on their own, so a
        failure (disk full, log removed, a record that will not encode) fails only the puts it
        reaches, each loudly and with nothing of it left in the log. The proxy stays up."""
        try:
            self.log.append_all([record for records in puts for record in records])
            return [None] * len(puts)
        except Exception:
            pass
        outcomes: list[Exception | None] = []
        for records in puts:
            try:
                self.log.append_all(records)
                outcomes.append(None)
            except Exception as e:
                outcomes.append(e)
        return outcomes

    def statistics(self) -> RecorderStatistics:
        return RecorderStatistics(queued=self._queue.qsize(), written=self._written, batches=self._batches)
