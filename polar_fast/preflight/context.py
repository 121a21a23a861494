"""Config items: each harness's context budget in the served window.

A harness told the served limits (model.max_context_tokens, sampling.max_tokens) compacts at its
own threshold (the adapter's `compaction_threshold`). The run is sound when, for every harness it
runs, the threshold is above zero and below the window, the first request (system prompt, tool
schemas and the task, in the model's tokens) leaves room for MIN_TURNS turns of TURN_TOKENS before
compaction or the window, and one reply at the output cap fits after it. Otherwise every rollout
ends on a context error or compacts on every call, scores 0, and the GPUs train on nothing.
"""

from __future__ import annotations

from typing import Callable

from polar_fast.config import Config
from polar_fast.errors import PolarError
from polar_fast.preflight import Item, failed, not_applicable, passed
from polar_fast.rollouts.harnesses import HARNESSES, ModelLimits

MIN_TURNS = 3  # turns the first request must leave room for
TURN_TOKENS = 2_000  # one turn: a short reply and a tool output of ~100 lines (an assumption, not a measurement)
STAND_IN_PROMPT = "Fix the failing test in this repository."  # when no task loads
AREA = "config"


def harnesses_of(cfg: Config) -> list[str]:
    return list(dict.fromkeys([cfg.harness.name, *cfg.eval.harnesses]))


async def check_context(cfg: Config, prompt: str, *, measure: Callable | None = None) -> list[Item]:
    from polar_fast.preflight.first_request import measure_first_request

    measure = measure or measure_first_request
    items: list[Item] = []
    for name in harnesses_of(cfg):
        if name not in HARNESSES:
            items.append(failed(AREA, f"{name}", f"unknown harness {name!r}", f"use one of {', '.join(HARNESSES)}"))
            continue
        try:
            first: int | None = await measure(cfg, name, prompt)
            error = ""
        except PolarError as e:
            first, error = None, str(e)
        items += harness_items(cfg, name, first, error)
    return items


def harness_items(cfg: Config, name: str, first: int | None, error: str = "") -> list[Item]:
    """The three items of one harness, given its measured first request (None: not measured)."""
    window, out = cfg.model.max_context_tokens, cfg.sampling.max_tokens
    threshold = HARNESSES[name].compaction_threshold(ModelLimits(context_tokens=window, max_output_tokens=out))
    fix = (f"raise model.max_context_tokens (vLLM's --max-model-len; now {window:,}) or lower sampling.max_tokens "
           f"(now {out:,})")
    items = [_compaction(name, threshold, window, out, first, fix)]
    if first is None:
        items.append(failed(AREA, f"{name} first request", f"not measured: {error}",
                            f"make `python -m polar_fast harnesses install {name}` and model.path work here"))
    else:
        items.append(_first_request(name, first, threshold, window, out, fix))
    if out >= window or (first is not None and first + out > window):
        what = f"the first request ({first:,}) + " if first is not None else ""
        items.append(failed(AREA, f"{name} output cap", f"{what}sampling.max_tokens ({out:,}) exceeds the "
                            f"{window:,}-token window", fix))
    else:
        room = f" after the {first:,}-token first request" if first is not None else ""
        items.append(passed(AREA, f"{name} output cap", f"a reply at sampling.max_tokens = {out:,} fits{room} "
                            f"in the {window:,}-token window"))
    return items


def _compaction(name: str, threshold: int | None, window: int, out: int, first: int | None, fix: str) -> Item:
    what = f"{name} compaction"
    if threshold is None:
        return not_applicable(AREA, what, f"{name} never compacts: its prompt grows until the {window:,}-token "
                                          "window ends the run")
    told = f"(window {window:,}, output cap {out:,})"
    if threshold <= 0:
        return failed(AREA, what, f"threshold {threshold:,} tokens {told}: it would compact on every call", fix)
    if threshold >= window:
        return failed(AREA, what, f"threshold {threshold:,} tokens is not below the {window:,}-token window: the "
                                  "proxy refuses prompts before it compacts", fix)
    if first is not None and threshold <= first:
        return failed(AREA, what, f"threshold {threshold:,} tokens {told} is below its {first:,}-token first "
                                  "request: it would compact on every call", fix)
    return passed(AREA, what, f"compacts at {threshold:,} of {window:,} tokens (output cap {out:,})")


def _first_request(name: str, first: int, threshold: int | None, window: int, out: int, fix: str) -> Item:
    what = f"{name} first request"
    limit = min(threshold, window - out) if threshold is not None else window - out
    turns = (limit - first) // TURN_TOKENS
    evidence = (f"{first:,} tokens (system prompt, tools and task, rendered with the model's template); "
                f"room for {max(turns, 0)} turn{'' if turns == 1 else 's'} of ~{TURN_TOKENS:,} tokens before "
                f"{'compaction' if threshold is not None and threshold < window - out else 'the window'} "
                f"at {limit:,}")
    if turns < MIN_TURNS:
        return failed(AREA, what, evidence + f", fewer than {MIN_TURNS}", fix)
    return passed(AREA, what, evidence)
