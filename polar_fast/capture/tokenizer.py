"""A Rust byte-level BPE encoder that gives the same ids as a HF fast tokenizer, faster
(bench/tokenize_bench.py measures by how much).

`fast_encoder(tokenizer)` builds `polar_fast._native.BpeEncoder` from the tokenizer's own tokenizer.json and
returns None when that tokenizer uses anything the encoder does not reproduce exactly (it never
approximates: see rust/merge/src/tokenize/bpe.rs for what is supported). `encode(text)` and
`encode_many(texts)` equal `tokenizer._tokenizer.encode(text, add_special_tokens=False).ids`
and release the GIL while they work.
"""

from __future__ import annotations

import logging
from typing import Any

from polar_fast._native import BpeEncoder

__all__ = ["BpeEncoder", "fast_encoder"]

log = logging.getLogger(__name__)


def fast_encoder(tokenizer: Any) -> BpeEncoder | None:
    """The Rust encoder for a HF fast tokenizer (or a `tokenizers.Tokenizer`), or None."""
    backend = getattr(tokenizer, "_tokenizer", tokenizer)
    to_str = getattr(backend, "to_str", None)
    if to_str is None:
        log.debug("fast_encoder: %s has no tokenizers backend", type(tokenizer).__name__)
        return None
    try:
        return BpeEncoder(to_str())
    except ValueError as e:
        log.debug("fast_encoder: %s", e)
        return None
