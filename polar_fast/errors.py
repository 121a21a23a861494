"""The base of every exception polar_fast raises on purpose, and the errors more than one stage
raises. Each carries a message meant for a user.

Every polar_fast exception derives from `PolarError`, so `except PolarError` catches all of them
(the CLI prints the message and exits 2). An error that only one stage raises lives beside the
code that raises it (EngineError in engines/, SandboxError in rollouts/sandboxes/, DialectError in
capture/dialects/, ...). Where callers catch a builtin base, an error keeps it as a second base:
`HttpError(PolarError, OSError)` is one of the pools' infra errors, `ConfigError` and `TaskError`
are ValueErrors. tests/test_layout.py checks that no exception class escapes this rule.
"""

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
