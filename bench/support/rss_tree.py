"""Run a command and sample the memory of its whole process tree: the run's own process, the
harness CLIs, sandboxes and engines it starts. `/usr/bin/time -v` reports only the largest single
process; a user's machine runs out on the sum.

Every --every seconds it reads /proc/<pid>/smaps_rollup of each process in the tree and adds up
Pss (proportional set size: a page shared by n processes counts 1/n in each, so shared libraries
and forked copies are not counted twice). It prints the peak of that sum, the peak of the
largest single process (Rss, what `time -v` reports), and when each peak happened, what the sum
was made of at its peak (Pss per kind of process: the program and its first argument, so the
harness CLIs add up apart from the run's own process), then one line
`RESULT peak_pss_sum_gib=.. peak_rss_max_gib=.. wall_s=.. rc=..`.

    python bench/support/rss_tree.py -- .venv/bin/python -m polar_fast --config run.toml

A sampler can miss a peak shorter than its period; 0.5 s is far below a learner step's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

GIB = 2**30


def children_of() -> dict[int, list[int]]:
    """pid -> its children's pids, from every process's stat line (field 4 is the parent)."""
    tree: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended while we listed
            continue
        fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parens
        tree.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return tree


def descendants(root: int) -> list[int]:
    tree, out, todo = children_of(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(tree.get(pid, []))
    return out


def label(pid: int) -> str:
    """What a process is, for the breakdown: its program's name, and for an interpreter the script
    or module it runs (`python -m polar_fast`, `python mini`), so that eight copies of a harness
    CLI add up as one row."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv if a]
    if not words:
        return "?"
    name = Path(words[0]).name
    if not name.startswith(("python", "node", "bash", "sh")) or len(words) < 2:
        return name
    if words[1] == "-m" and len(words) > 2:
        return f"{name} -m {words[2]}"
    return f"{name} {'-c' if words[1] == '-c' else Path(words[1]).name}"


def memory_kib(pid: int) -> tuple[int, int]:
    """(Pss, Rss) of one process in KiB; (0, 0) once it has ended."""
    pss = rss = 0
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
            elif line.startswith("Rss:"):
                rss = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return pss, rss


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")
    started = time.monotonic()
    proc = subprocess.Popen(command)
    peak_sum = peak_one = 0
    at_sum = at_one = 0.0
    breakdown: dict[str, list[int]] = {}  # label -> [processes, Pss KiB] at the peak of the sum
    while proc.poll() is None:
        pids = descendants(proc.pid)
        sizes = [memory_kib(pid) for pid in pids]
        total, largest = sum(p for p, _ in sizes), max((r for _, r in sizes), default=0)
        now = time.monotonic() - started
        if total > peak_sum:
            peak_sum, at_sum = total, now
            breakdown = {}
            for pid, (pss, _) in zip(pids, sizes):
                if pss:
                    row = breakdown.setdefault(label(pid), [0, 0])
                    row[0] += 1
                    row[1] += pss
        if largest > peak_one:
            peak_one, at_one = largest, now
        time.sleep(args.every)
    wall = time.monotonic() - started
    print(f"\n| memory of the process tree | GiB | at s |\n| --- | ---: | ---: |\n"
          f"| peak sum of Pss | {peak_sum * 1024 / GIB:.2f} | {at_sum:.0f} |\n"
          f"| peak Rss of the largest process | {peak_one * 1024 / GIB:.2f} | {at_one:.0f} |")
    print("\n| at the peak of the sum: process | count | Pss GiB |\n| --- | ---: | ---: |")
    for name, (count, pss) in sorted(breakdown.items(), key=lambda kv: -kv[1][1]):
        print(f"| {name} | {count} | {pss * 1024 / GIB:.2f} |")
    print(f"RESULT peak_pss_sum_gib={peak_sum * 1024 / GIB:.2f} peak_rss_max_gib={peak_one * 1024 / GIB:.2f} "
          f"wall_s={wall:.0f} rc={proc.returncode}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
