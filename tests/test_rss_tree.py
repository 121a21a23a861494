"""bench/support/rss_tree.py counts the memory of a command's whole process tree: a grandchild's
allocation shows in the peak sum though the command's own process stays small, and the largest
single process is the grandchild, not the sum. The command's exit status comes back."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

SAMPLER = Path(__file__).resolve().parents[1] / "bench" / "support" / "rss_tree.py"

# the child starts a grandchild that touches 300 MiB and holds it for a second; the child itself
# holds nothing, and both exit 3
GRANDCHILD = "import time; x = b\"\\x01\" * (300 * 2**20); time.sleep(1.5)"
CHILD = textwrap.dedent(f"""
    import subprocess, sys
    subprocess.run([sys.executable, "-c", {GRANDCHILD!r}], check=True)
    sys.exit(3)
""")


def test_the_peak_counts_a_grandchild_and_the_exit_status_comes_back():
    done = subprocess.run([sys.executable, str(SAMPLER), "--every", "0.1", "--", sys.executable, "-c", CHILD],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    values = dict(re.findall(r"(\w+)=([\d.]+)", last))
    assert last.startswith("RESULT ") and values["rc"] == "3"
    # ones, not zeros: every page is written, so all 300 MiB are resident (a calloc'd zero buffer
    # need not be); the interpreters add their own tens of MiB
    assert 0.29 <= float(values["peak_pss_sum_gib"]) < 0.6
    assert 0.29 <= float(values["peak_rss_max_gib"]) <= float(values["peak_pss_sum_gib"]) + 0.05


def test_no_command_is_a_usage_error():
    done = subprocess.run([sys.executable, str(SAMPLER)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "no command given" in done.stderr


def test_the_breakdown_at_the_peak_adds_up_processes_of_one_kind():
    # two grandchildren of one kind, started together: one row with count 2 holds their 2 x 150 MiB
    two = textwrap.dedent(f"""
        import subprocess, sys
        kids = [subprocess.Popen([sys.executable, "-c", {GRANDCHILD.replace("300", "150")!r}]) for _ in range(2)]
        sys.exit(sum(k.wait() for k in kids))
    """)
    done = subprocess.run([sys.executable, str(SAMPLER), "--every", "0.1", "--", sys.executable, "-c", two],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = re.findall(r"^\| (python[\w.]* -c) \| (\d+) \| ([\d.]+) \|$", done.stdout, re.M)
    assert len(rows) == 1, done.stdout  # the command and its grandchildren are all `python -c`
    count, gib = int(rows[0][1]), float(rows[0][2])
    assert count == 3 and 0.29 <= gib < 0.6
