"""The view served by its real command line, and a real headless browser to look at it, for the
tests and scripts/view_screenshots.py.

The browser is Debian's chromium driven through Debian's chromium-driver (Selenium, test extra),
both from apt: nothing downloads a browser build. `view_server` runs
`python -m polar_fast view --port 0` in a subprocess and yields the address it printed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Iterator

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
CHROMEDRIVER = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")


def _first(paths: tuple[str, ...], name: str) -> str:
    for path in paths:
        if os.access(path, os.X_OK):
            return path
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found: apt-get install -y chromium chromium-driver (scripts/test.sh does)")
    return found


def browser_available() -> bool:
    try:
        _first(CHROMIUM, "chromium"), _first(CHROMEDRIVER, "chromedriver")
    except RuntimeError:
        return False
    return True


@contextlib.contextmanager
def chromium(*, width: int = 1400, height: int = 1000) -> Iterator:
    """A headless chromium WebDriver, quit on exit."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = _first(CHROMIUM, "chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                f"--window-size={width},{height}", "--no-first-run", "--disable-extensions"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=_first(CHROMEDRIVER, "chromedriver")), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@contextlib.contextmanager
def view_server(run_dir: Path, *extra: str, timeout_s: float = 60.0) -> Iterator[str]:
    """`python -m polar_fast view --run RUN_DIR --port 0 ...`; yields the printed address."""
    command = [sys.executable, "-m", "polar_fast", "view", "--run", str(run_dir), "--port", "0", *extra]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            line = proc.stdout.readline()  # the first line names the address, or the error
            match = re.search(r"on (http://\S+)", line)
            if match is None:
                rest = proc.communicate(timeout=timeout_s)[0]
                raise RuntimeError(f"view did not start (exit {proc.returncode}): {line}{rest}")
            # keep reading what it prints (tracebacks of failed requests), so its pipe never fills
            reader = threading.Thread(target=proc.stdout.read, daemon=True)
            reader.start()
            yield match.group(1)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
