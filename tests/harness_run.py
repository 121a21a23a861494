"""Runs an AgentCommand on this host the way a local sandbox would: files written under a private
HOME, only the command's env, its own process group killed at the end, bounded time."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import anyio

from polar_fast.rollouts.harnesses import AgentCommand


def write_home_files(cmd: AgentCommand, home: Path) -> None:
    for rel, text in cmd.files.items():
        path = home / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


async def run_on_host(cmd: AgentCommand, *, home: Path, cwd: Path, timeout_s: float = 90.0) -> tuple[int, str]:
    """Returns (exit code, stdout+stderr); exit code -1 when it ran past timeout_s."""
    await anyio.to_thread.run_sync(write_home_files, cmd, home)
    proc = await asyncio.create_subprocess_exec(
        *cmd.argv, env=cmd.env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await proc.communicate()
        return proc.returncode, out.decode(errors="replace")
    except TimeoutError:
        return -1, "timed out"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # helpers the CLI left behind die with it
        except ProcessLookupError:
            pass
        await proc.wait()
