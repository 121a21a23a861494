"""The embedded engine's prefix cache: a call that starts from an earlier call's KV samples what a
fresh prefill samples (real SmolLM2), weight updates drop the cache, and the store's bookkeeping
matches a plain reference (property test)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from polar_fast.config import load_config
from polar_fast.engines import Sampling
from polar_fast.engines.prefix_cache import PrefixCache, common_prefix

pytestmark = pytest.mark.anyio


class _FakeKV:
    """Stands in for batched_attention.CallKV in the bookkeeping test: it only has to copy a prefix."""

    def __init__(self, n: int) -> None:
        self.n = n

    def copy_prefix(self, n: int) -> _FakeKV:
        assert 0 <= n <= self.n
        return _FakeKV(n)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=12),
       st.lists(st.integers(0, 3), min_size=1, max_size=9))
def test_take_returns_the_longest_usable_prefix(stored, prompt):
    store = PrefixCache(max_entries=64, max_tokens=10_000)
    for tokens in stored:
        store.put(tokens, _FakeKV(len(tokens)))
    cache, n = store.take(prompt)
    best = max((min(common_prefix(t, prompt), len(prompt) - 1) for t in stored), default=0)
    assert n == best
    assert (cache is None) == (n == 0)
    if cache is not None:
        assert cache.n == n


def test_bounds_and_redundant_prefixes():
    store = PrefixCache(max_entries=2, max_tokens=10)
    store.put([1, 2], _FakeKV(2))
    store.put([1, 2, 3], _FakeKV(3))  # [1, 2] is a prefix of it: dropped
    assert len(store) == 1
    store.put([4, 5, 6], _FakeKV(3))
    store.put([7, 8, 9, 9, 9], _FakeKV(5))  # 3 entries > 2: the least recently used goes
    assert len(store) == 2 and store.take([1, 2, 3, 4]) == (None, 0)
    store.put(list(range(11)), _FakeKV(11))  # longer than the whole budget: not kept
    assert len(store) == 2


async def test_reused_prefix_samples_like_a_fresh_prefill():
    from polar_fast.engines.embedded import EmbeddedEngine

    cfg = load_config(None)
    cached = await asyncio.to_thread(EmbeddedEngine, cfg.model, cfg.engine)
    fresh = await asyncio.to_thread(EmbeddedEngine, cfg.model, cfg.engine)
    first = list(range(1000, 1040))
    greedy = Sampling(temperature=0.0, max_tokens=6)
    g1 = await cached.generate(first, greedy)
    follow_up = first + g1.token_ids + list(range(2000, 2010))  # a next turn repeats the last one
    reused = await cached.generate(follow_up, greedy)
    assert cached.prefix_cache.hits == 1 and cached.prefix_cache.reused_tokens == len(first) + len(g1.token_ids) - 1
    again = await fresh.generate(follow_up, greedy)
    assert fresh.prefix_cache.hits == 0
    assert reused.token_ids == again.token_ids
    assert reused.logprobs == pytest.approx(again.logprobs, abs=1e-4)

    await cached.update_weights(None, version=1)  # reload: cached keys and values are stale
    assert len(cached.prefix_cache) == 0
