"""The Rust extension is built for CPython's stable ABI (abi3, Python >= 3.11): one wheel built
on this machine loads on any later CPython (pyproject's maturin features)."""

from __future__ import annotations

from pathlib import Path

from polar_fast import _native


def test_the_extension_is_abi3():
    name = Path(_native.__file__).name
    assert name == "_native.abi3.so", f"{name}: built for one Python only (pyo3/abi3-py311 missing?)"
