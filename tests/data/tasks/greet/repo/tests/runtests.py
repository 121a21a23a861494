#!/usr/bin/env python3
"""Runs test modules named relative to tests/ with unittest at verbosity 2, taking the options
django's tests/runtests.py takes, so the repo runs under django's test spec and log format."""
import argparse
import os
import sys
import unittest

parser = argparse.ArgumentParser()
parser.add_argument("modules", nargs="*")
parser.add_argument("--verbosity", type=int, default=1)
parser.add_argument("--settings")
parser.add_argument("--parallel", type=int, default=1)
args = parser.parse_args()
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [here, os.path.dirname(here)]
suite = unittest.defaultTestLoader.loadTestsFromNames(args.modules)
result = unittest.TextTestRunner(verbosity=args.verbosity).run(suite)
sys.exit(not result.wasSuccessful())
