"""Type stub of the Rust extension (rust/merge/src/lib.rs). Call it through polar_fast.merge and
polar_fast.capture.tokenizer."""

from typing import Any, Sequence

import numpy as np
import numpy.typing as npt

from polar_fast.config import Layout
from polar_fast.errors import MergeError as MergeError

def merge(calls: bytes | Sequence[Any], *, layout: Layout = "tree") -> dict[str, Any]:
    """Insert a group's calls into one token trie and flatten it.

    Args:
        calls: msgpack bytes of a list of CallRecord maps, or objects with the attributes
            rollout_id, prompt_ids, completion_ids, completion_logprobs, policy_version.
        layout: "tree" (every prefix once, DFS order) or "paths" (one sequence per leaf).

    Returns:
        The arrays of polar_fast.merge.arrays.Merged (int32 / uint8 / float32 numpy arrays), plus
        "rollout_ids" (list[str]) and "stats" (dict[str, int]).

    Raises:
        MergeError: undecodable bytes, a missing or mistyped field, a token id outside
            [0, 2**31), a policy version outside int32, or completion ids and logprobs of
            different lengths.
    """

def pack_plan(
    parent: npt.NDArray[np.int32],
    size: npt.NDArray[np.int32],
    offsets: npt.NDArray[np.int32],
    loss_mask: npt.NDArray[np.uint8],
    extra_index: npt.NDArray[np.int32],
    *,
    layout: Layout,
    max_tokens: int,
) -> list[dict[str, npt.NDArray[Any]]]:
    """First-fit-decreasing micro-batch plans over merged arrays.

    Args:
        parent, size, offsets, loss_mask, extra_index: the arrays of a Merged.
        layout: the Merged's layout; trees over the budget are split, paths never are.
        max_tokens: the most tokens one micro-batch may hold.

    Returns:
        One dict per micro-batch with the fields of polar_fast.merge.arrays.PackPlan.

    Raises:
        MergeError: max_tokens < 1, a root-to-leaf path longer than max_tokens, or arrays
            that do not describe a forest (inconsistent parent / size / offsets).
    """

def crc32(data: bytes) -> int:
    """`zlib.crc32(data)`, computed with SIMD folding (GIL released)."""

class BpeEncoder:
    """A byte-level BPE tokenizer that encodes exactly as HF `tokenizers` does.

    Raises:
        ValueError: (from the constructor) the tokenizer.json is malformed or uses a part the
            encoder does not reproduce exactly; the message names that part.
    """

    def __new__(cls, tokenizer_json: str) -> BpeEncoder:
        """Build from a tokenizer.json string (`tokenizers.Tokenizer.to_str()`)."""

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, as HF `encode(text, add_special_tokens=False).ids` (GIL released)."""

    def encode_bytes(self, text: str) -> bytes:
        """`encode(text)` as native-endian int32 bytes (`array("i").frombytes`)."""
    def encode_many(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each text, in order, in one call (GIL released)."""

def json_value_span(body: bytes, key: str) -> tuple[int, int] | None:
    """(start, end) byte offsets of top-level `key`'s value in the JSON object `body`; None when
    `body` is not an object, lacks the key, has it twice or escapes any top-level key."""

def json_array_items(body: bytes, at: int, *, after_item: bool = False) -> tuple[list[tuple[int, int]], int] | None:
    """(start, end) offsets of the elements of the array opening at `at` (or, with `after_item`,
    of the elements after the one ending at `at`), and the offset of its closing bracket; None
    when the text there is not such an array. Structural only: decode what it points at."""

def common_prefix_len(a: bytes, b: bytes) -> int:
    """Length of the longest common prefix of `a` and `b`."""

def json_int32s(ids: Any) -> bytes:
    """JSON of `list(ids)` (byte for byte what msgspec writes) from a non-empty contiguous
    int32 buffer such as `array("i")`; ValueError or BufferError for anything else."""

def msgpack_int32s(ids: Any) -> bytes:
    """MessagePack of `list(ids)` (byte for byte what msgspec writes) from a contiguous int32
    buffer such as `array("i")` or a memoryview slice of one; ValueError for anything else."""
