"""The host's disk reserve: a new box boots only while the disks it could fill have room.

    reserve = DiskReserve({"Docker's data root": "/var/lib/docker", "run.output_dir": "runs/x"},
                          need_mb=cfg.run.min_free_disk_mb + cfg.sandbox.disk_mb)
    await reserve.wait_room()   # before each boot: returns at once while every path has room

While one of the paths has less than `need_mb` free, boots wait and look again every `poll_s`,
and `waiting` says why (the run's progress line shows it). Nothing is refused or lost: boxes
already running carry on, records keep being written, and boots resume once space comes back.
So a new box can still write its `sandbox.disk_mb`, and `run.min_free_disk_mb` stays free for the
record log, checkpoints and Docker itself. The check is per boot, not a ledger: boxes already
running may still grow into the reserve (each by at most its bound).
"""

from __future__ import annotations

import shutil
from typing import Callable

import anyio


def free_mb(path: str) -> int:
    return shutil.disk_usage(path).free >> 20


class DiskReserve:
    def __init__(self, paths: dict[str, str], *, need_mb: int, poll_s: float = 5.0,
                 free: Callable[[str], int] = free_mb) -> None:
        self.paths = {name: path for name, path in paths.items() if path}  # what -> host path
        self.need_mb = need_mb
        self.poll_s = poll_s
        self._free = free  # MiB free on a path's file system
        self.waiting = ""  # why boots wait now; "" while there is room
        self.waits = 0  # boots that had to wait

    async def wait_room(self) -> None:
        """Return once every path has `need_mb` free (at once when it has)."""
        waited = False
        while short := await anyio.to_thread.run_sync(self.shortage):
            self.waiting = short
            if not waited:
                waited, self.waits = True, self.waits + 1
            await anyio.sleep(self.poll_s)
        self.waiting = ""

    def shortage(self) -> str:
        """Why a boot would wait now, or "" (reads the file systems: call it off the loop)."""
        for name, path in self.paths.items():
            if (free := self._free(path)) < self.need_mb:
                return (f"boots wait for disk: {free} MiB free on {name} ({path}), {self.need_mb} MiB needed "
                        "(run.min_free_disk_mb + sandbox.disk_mb)")
        return ""
