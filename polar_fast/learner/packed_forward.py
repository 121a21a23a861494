"""Packed forward of any HF causal LM over a merged micro-batch, and the sampled tokens' logprobs.

One attention rule serves both layouts: query q may attend key k iff k <= q < k + size[k]
(merge arrays). For `paths` this is block-diagonal causal attention (position ids restart at 0
in every sequence); for `tree` it is the ancestor rule of the DFS-flattened trie, with depth as
the position id, so a shared prefix is computed once for all its branches.

Masks: the learner's SDPA choice (CPU, or GPU without flex) is packed_attention.NAME, which
never builds the (T, T) mask: a plan from `size`, made once per micro-batch and shared by every
layer, runs causal SDPA per `paths` sequence and, in a tree, each block of queries against only
its ancestors (see learner/packed_attention.py). A model left on plain "sdpa" gets an explicit boolean
(1, 1, T, T) mask; eager gets the same as an additive float mask; `flex_attention` gets a
FlexAttention BlockMask built from the same rule, which skips fully masked blocks (the sparse
part of a tree). transformers passes a 4D mask / BlockMask through to the attention function
untouched; a hybrid model (Qwen3.5) gets it as a per-layer-type mapping, the recurrent layers
`None` (their packing is packed_recurrence's). A model class whose transformers code does not
declare FlexAttention support (Qwen3.5 in transformers 5.25) runs transformers' own
flex_attention_forward registered under FLEX: our BlockMask is all it needs. We do not special-case flash-attn varlen for `paths`: the BlockMask is equally sparse
for block-diagonal masks.

Logprobs. The logprob of a sampled token q is read from the hidden state of its PARENT
(parent[q]), not of q - 1: in a tree the token before q in DFS order may sit on another branch.
Only rows that carry a loss term are sent through the LM head, `chunk_tokens` rows at a time,
each chunk but the last under activation checkpointing, so (chunk, vocab) logits exist for one
chunk at a time in forward and backward and full logits never materialise for a long sequence.
The last chunk's backward follows right after its forward, so it is kept, not recomputed; the
short remainder chunk goes first, so that the kept one is a full chunk.

A step in progress can be watched and stopped (learner/step_control.py): while `control` is
set, each decoder layer reports itself before its forward and, through a hook on its output,
before its backward, and each logprob chunk checks too; a stop request raises StepInterrupted
there, so a long micro-batch stops within one layer's time.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from polar_fast.learner import packed_attention, packed_recurrence
from polar_fast.learner.step_control import StepControl

FLEX = "polar_fast_flex"  # transformers' flex_attention_forward, for classes that do not declare it
FLEX_NAMES = ("flex_attention", FLEX)


class Terms(NamedTuple):
    """The loss terms of one micro-batch: one per sampled token, plus one per extra sample.

    All (N,) numpy arrays; `position` is local to the micro-batch, `sequence` is the local
    sequence index (from offsets), `rollout` indexes the merge's rollout_ids."""

    position: np.ndarray  # int64
    rollout: np.ndarray  # int64
    behaviour_logp: np.ndarray  # float32
    version: np.ndarray  # int64
    sequence: np.ndarray  # int64


def loss_terms(batch: Any) -> Terms:
    """Primary samples (loss_mask == 1) followed by extra samples of already-masked tokens."""
    masked = np.flatnonzero(np.asarray(batch.loss_mask))
    extra = np.asarray(batch.extra_index, dtype=np.int64)
    position = np.concatenate([masked, extra]).astype(np.int64)
    rollout = np.concatenate([np.asarray(batch.rollout)[masked], np.asarray(batch.extra_rollout)])
    behaviour = np.concatenate([np.asarray(batch.logprobs)[masked], np.asarray(batch.extra_logprob)])
    version = np.concatenate([np.asarray(batch.versions)[masked], np.asarray(batch.extra_version)])
    sequence = np.searchsorted(np.asarray(batch.offsets), position, side="right") - 1
    return Terms(
        position=position,
        rollout=rollout.astype(np.int64),
        behaviour_logp=behaviour.astype(np.float32),
        version=version.astype(np.int64),
        sequence=sequence.astype(np.int64),
    )


def dense_mask(size: torch.Tensor) -> torch.Tensor:
    """(1, 1, T, T) bool: True where query q may attend key k (k <= q < k + size[k])."""
    t = size.shape[0]
    idx = torch.arange(t, device=size.device)
    q, k = idx[:, None], idx[None, :]
    return ((k <= q) & (q < k + size[None, :]))[None, None]


def block_mask(size: torch.Tensor) -> Any:
    """FlexAttention BlockMask of the same rule (GPU; imported lazily). Built compiled: the eager
    path evaluates `mask_mod` on every (q, k) pair at once, a dense (T, T) tensor (64k tokens:
    4 GiB of bools) that the block mask exists to avoid."""
    def mask_mod(b, h, q, k):  # noqa: ARG001 - FlexAttention's signature
        return (k <= q) & (q < k + size[k])

    t = size.shape[0]
    return _compiled_create_block_mask()(mask_mod, B=None, H=None, Q_LEN=t, KV_LEN=t, device=size.device)


@functools.cache
def flex_kernel_options() -> dict[str, Any]:
    """FlexAttention's standard Triton kernel, never its decoding kernel: every packed query is a
    whole row, but with fewer than 128 tokens (the start-up check's tiny batches) AUTO picks the
    decoding kernel, which on torch 2.11 has no configuration for fp32 (NoValidChoicesError, found
    by bench/gpu_check.py on an H200). Older torch names the same choice FORCE_USE_FLEX_ATTENTION."""
    from typing import get_type_hints

    from torch.nn.attention.flex_attention import FlexKernelOptions

    if "BACKEND" in get_type_hints(FlexKernelOptions):
        return {"BACKEND": "TRITON"}
    return {"FORCE_USE_FLEX_ATTENTION": True}


@functools.cache
def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def register_flex() -> None:
    """Register FLEX (idempotent; imports transformers' flex integration only when asked for)."""
    from transformers import AttentionInterface
    from transformers.integrations.flex_attention import flex_attention_forward

    AttentionInterface.register(FLEX, flex_attention_forward)


def attention_mask_for(model: nn.Module, size: torch.Tensor, dtype: torch.dtype) -> Any:
    """The mask in the form the model's attention implementation takes."""
    impl = getattr(model.config, "_attn_implementation", "sdpa")
    if impl in FLEX_NAMES:
        return block_mask(size)
    mask = dense_mask(size)
    if impl == "eager":  # eager adds the mask to the scores
        return torch.zeros(mask.shape, dtype=dtype, device=size.device).masked_fill(
            ~mask, torch.finfo(dtype).min
        )
    return mask


class PackedLM(nn.Module):
    """Wraps a HF causal LM: packed micro-batch in, logprobs of chosen tokens out.

    Being one module matters for FSDP2: sharding this wrapper makes its forward unshard the
    embedding and LM head, which we call directly instead of the HF model's forward."""

    def __init__(self, lm: nn.Module, *, temperature: float = 1.0) -> None:
        super().__init__()
        self.lm = lm
        self.softcap = getattr(lm.config, "final_logit_softcapping", None)
        self.recurrent = packed_recurrence.install(lm)  # Gated DeltaNet layers: segment by segment
        # the sampling temperature: logprobs under the distribution the engine sampled from
        self.temperature = temperature if temperature > 0 else 1.0
        # (N,) the policy's entropy at each term's position, from the last forward (detached):
        # how sure the policy is where it sampled, a metric only (grpo: learner/entropy)
        self.entropy: torch.Tensor | None = None
        self._control = _step_checks(lm)  # [StepControl | None], read by lm's layer hooks

    @property
    def control(self) -> StepControl | None:
        """The step in progress (learner/step_control.py), set by the learner while a step runs."""
        return self._control[0]

    @control.setter
    def control(self, value: StepControl | None) -> None:
        self._control[0] = value

    def forward(
        self,
        tokens: torch.Tensor,  # (T,) long
        positions: torch.Tensor,  # (T,) long
        size: torch.Tensor,  # (T,) long
        source: torch.Tensor,  # (N,) long: row whose hidden state predicts the term's token
        target: torch.Tensor,  # (N,) long: the sampled token
        chunk_tokens: int = 1024,
    ) -> torch.Tensor:  # (N,) float32 logprobs
        decoder = self.lm.get_decoder()
        if getattr(self.lm.config, "_attn_implementation", None) == packed_attention.NAME:
            extra = {"attention_mask": None, "packed_plan": packed_attention.plan(size, self.lm.dtype)}
        else:
            extra = {"attention_mask": attention_mask_for(self.lm, size, self.lm.dtype)}
            if getattr(self.lm.config, "_attn_implementation", None) in FLEX_NAMES and size.is_cuda:
                extra["kernel_options"] = flex_kernel_options()
            if self.recurrent:  # a BlockMask is no 2D padding mask: the recurrent layers get None
                types = getattr(self.lm.config, "layer_types", None) or []
                extra["attention_mask"] = {t: None if t == "linear_attention" else extra["attention_mask"]
                                           for t in set(types)}
        if self.recurrent:
            extra[packed_recurrence.KEYWORD] = packed_recurrence.plan(size)
        hidden = decoder(
            input_ids=tokens[None], position_ids=positions[None], use_cache=False, **extra
        ).last_hidden_state[0]  # (T, H)
        rows = hidden.index_select(0, source)  # (N, H)
        head = self.lm.get_output_embeddings()
        n = rows.shape[0]
        bounds = [0, *range(n % chunk_tokens or chunk_tokens, n + 1, chunk_tokens)]  # a short chunk first
        parts = []
        for chunk, (start, stop) in enumerate(zip(bounds, bounds[1:])):
            if self.control is not None:
                self.control.at("logprob chunk", chunk, len(bounds) - 1)
            h, t = rows[start:stop], target[start:stop]
            if torch.is_grad_enabled() and stop < n:  # the last chunk's backward follows at once
                parts.append(checkpoint(self._chunk_logprobs, head, h, t, use_reentrant=False))
            else:
                parts.append(self._chunk_logprobs(head, h, t))
        if not parts:
            self.entropy = hidden.new_zeros(0, dtype=torch.float32)
            return hidden.new_zeros(0, dtype=torch.float32) + hidden.sum().float() * 0
        both = torch.cat(parts, 1)  # (2, N)
        self.entropy = both[1]
        return both[0]

    def _chunk_logprobs(self, head: nn.Module, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """(2, chunk): the logprobs of the targets, and (detached) the entropy of each row's
        distribution. One tensor, so that activation checkpointing recomputes both alike."""
        if self.control is not None:  # also when the backward recomputes a chunk
            self.control.check()
        logits = head(h).float()  # (chunk, V): the only place logits exist
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        if self.temperature != 1.0:
            logits = logits / self.temperature
        logp = -F.cross_entropy(logits, t, reduction="none")  # log_softmax(logits)[t], one fused kernel
        with torch.no_grad():  # H = logsumexp(z) - sum(p z); one more (chunk, V) copy: p
            p = torch.softmax(logits, -1)
            lse = logits.gather(1, t[:, None])[:, 0] - logp.detach()
            entropy = lse - torch.einsum("nv,nv->n", p, logits)
        return torch.stack([logp, entropy])


def _step_checks(lm: nn.Module) -> list[StepControl | None]:
    """The one-element list [StepControl | None] that `lm`'s decoder layers report to: before
    each layer's forward, and through a hook on its output, before its backward. Installed once
    per model, however many wrappers it gets (the start-up packing check wraps it too)."""
    slot = getattr(lm, "_polar_step_control", None)
    if slot is None:
        slot = [None]
        layers = getattr(lm.get_decoder(), "layers", [])
        for index, layer in enumerate(layers):
            layer.register_forward_pre_hook(functools.partial(_before_layer, slot, index, len(layers)))
            layer.register_forward_hook(functools.partial(_after_layer, slot, index, len(layers)))
        lm._polar_step_control = slot
    return slot


def _before_layer(slot: list, index: int, count: int, module: nn.Module, args: Any) -> None:  # noqa: ARG001 - hook
    if slot[0] is not None:
        slot[0].at("forward layer", index, count)


def _after_layer(slot: list, index: int, count: int, module: nn.Module, args: Any, output: Any) -> None:  # noqa: ARG001
    hidden = output[0] if isinstance(output, tuple) else output
    control = slot[0]
    if control is not None and isinstance(hidden, torch.Tensor) and hidden.requires_grad:
        # the gradient reaching this layer's output: its backward is next
        hidden.register_hook(lambda grad: control.at("backward layer", index, count))


def batch_tensors(batch: Any, terms: Terms, device: torch.device | str) -> dict[str, torch.Tensor]:
    """The PackedLM inputs of one micro-batch, on `device`."""
    tokens = torch.as_tensor(np.asarray(batch.tokens, dtype=np.int64), device=device)
    parent = np.asarray(batch.parent, dtype=np.int64)
    source = parent[terms.position]
    if (source < 0).any():
        raise ValueError("a loss term sits at a sequence root: a sampled token needs a prompt before it")
    return {
        "tokens": tokens,
        "positions": torch.as_tensor(np.asarray(batch.positions, dtype=np.int64), device=device),
        "size": torch.as_tensor(np.asarray(batch.size, dtype=np.int64), device=device),
        "source": torch.as_tensor(source, device=device),
        "target": tokens[torch.as_tensor(terms.position, device=device)],
    }
