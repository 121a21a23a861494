"""The few exception types polar_fast raises on purpose. Each carries a message meant for a user."""

from __future__ import annotations


class PolarError(Exception):
    """Base of polar_fast's own errors."""


class ConfigError(PolarError, ValueError):
    """run.toml or an override is invalid: the message names the key and what was expected."""


class MergeError(PolarError, ValueError):
    """Input the merge cannot take (mismatched lengths, bad token ids, a sequence over budget).
    Raised by the Rust crate as well as the Python reference."""


class PackedForwardError(PolarError, ValueError):
    """The learner's packed forward of this architecture and layout differs from one forward per
    call (learner/packed_check.py): the message names the layout and the first layer that differs."""


class WeightSyncError(PolarError):
    """The engine refused or failed a weight update; the message names the step and reply."""
