"""FlexAttention's BlockMask (the GPU learner's tree attention) follows the packed rule block by
block, built compiled (packed_forward.block_mask), never from a dense (T, T) tensor."""

from __future__ import annotations

import pytest
import torch

from polar_fast.learner.packed_forward import block_mask, dense_mask


def chain_and_branches(t: int) -> torch.Tensor:
    """size[k] for a trie in DFS order: a shared prefix, then two branches of the rest."""
    prefix, left = t // 3, t // 3
    right = t - prefix - left
    size = [t - k for k in range(prefix)]  # every prefix token covers the rest
    size += [left - k for k in range(left)] + [right - k for k in range(right)]
    return torch.tensor(size, dtype=torch.long)


@pytest.mark.slow
def test_block_mask_has_the_blocks_of_the_dense_rule():
    size = chain_and_branches(3 * 128 + 40)
    blocks = block_mask(size).to_dense()[0, 0].bool()  # (n_q_blocks, n_kv_blocks)
    dense = dense_mask(size)[0, 0]
    n = blocks.shape[0]
    padded = torch.zeros(n * 128, n * 128, dtype=torch.bool)
    padded[: dense.shape[0], : dense.shape[1]] = dense
    expected = padded.reshape(n, 128, n, 128).any(dim=3).any(dim=1)
    assert torch.equal(blocks, expected)
    assert not blocks[1, 2] and blocks[2, 1]  # causal, and the right branch sees the prefix
