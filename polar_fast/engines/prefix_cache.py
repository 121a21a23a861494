"""KV caches of recent calls, reused by the next call whose prompt starts the same way.

An agent's next call repeats its previous prompt and reply, and every session of a harness opens
with the same system prompt, so on a CPU most of a call's prefill is work already done. The
embedded engine keeps the KV cache left by each of its last few generations, keyed by the tokens
it holds, and starts a new call from the longest common prefix (a copy of that many positions,
`copy_prefix`), prefilling only the rest. Caches hold the weights' keys and values: `clear` on every weight update.
"""

from __future__ import annotations

from typing import Any, Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Most recently used first; bounded by entries and by total tokens held."""

    def __init__(self, *, max_entries: int = 8, max_tokens: int = 32_768) -> None:
        self.max_entries = max_entries
        self.max_tokens = max_tokens
        self._entries: list[tuple[tuple[int, ...], Any]] = []  # (tokens the cache holds, batched_attention.CallKV)
        self.hits = 0
        self.reused_tokens = 0

    def take(self, prompt: Sequence[int]):
        """(cache, n): a private copy holding the KV of prompt[:n] (n < len(prompt), so the last
        prompt token is always fed and gives the first logits), or (None, 0)."""
        best, best_n = None, 0
        for i, (tokens, _) in enumerate(self._entries):
            n = min(common_prefix(tokens, prompt), len(prompt) - 1)
            if n > best_n:
                best, best_n = i, n
        if best is None:
            return None, 0
        tokens, cache = self._entries.pop(best)
        self._entries.insert(0, (tokens, cache))
        mine = cache.copy_prefix(best_n)
        self.hits += 1
        self.reused_tokens += best_n
        return mine, best_n

    def put(self, tokens: Sequence[int], cache) -> None:
        """Keep `cache` (which now belongs to this store) as holding the KV of `tokens`."""
        key = tuple(tokens)
        if not key or len(key) > self.max_tokens:
            return
        # an entry that is a prefix of the new one is redundant: the new one serves its callers too
        self._entries = [(t, c) for t, c in self._entries if common_prefix(t, key) < len(t)]
        self._entries.insert(0, (key, cache))
        while len(self._entries) > self.max_entries or sum(len(t) for t, _ in self._entries) > self.max_tokens:
            self._entries.pop()

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
