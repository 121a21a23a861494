"""`python -m polar_fast.harnesses install [NAMES...|--all] [--bundle-root DIR]`: build and cache
harness bundles (a no-op for those already cached); prints one `name path` line per bundle."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from polar_fast.harnesses import HARNESSES, BundleError, default_bundle_root, get_harness


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m polar_fast.harnesses")
    sub = parser.add_subparsers(dest="cmd", required=True)
    install = sub.add_parser("install", help="build harness bundles")
    install.add_argument("names", nargs="*", help=f"harnesses: {', '.join(HARNESSES)}")
    install.add_argument("--all", action="store_true", help="every harness")
    install.add_argument("--bundle-root", type=Path, default=None, help="default ~/.cache/polar_fast/harnesses")
    args = parser.parse_args(argv)
    if not args.all and not args.names:
        parser.error("name harnesses to install, or --all")
    try:
        harnesses = list(HARNESSES.values()) if args.all else [get_harness(n) for n in args.names]
    except ValueError as e:
        parser.error(str(e))
    root = args.bundle_root or default_bundle_root()
    for harness in harnesses:
        try:
            path = harness.install(root)
        except BundleError as e:
            print(f"install {harness.name}: {e}", file=sys.stderr)
            return 1
        print(f"{harness.name} {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
