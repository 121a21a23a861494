"""The learner's memory per GPU, estimated from the model's config alone: no weights, no GPU.

    estimate = estimate_memory(cfg, world=4)          # cfg: the run's Config
    estimate.total_bytes(checkpointing=True)

The model is built on the meta device from its config.json (tensors with shapes and no storage),
so the parameter count is exact, tied weights once. Then, per rank:

- weights, gradients: fp32 (the learner keeps fp32 master weights; bf16 is autocast or FSDP2's
  compute dtype), sharded on dim 0 over `world` ranks by FSDP2 (the largest shard, rounded up);
- optimizer: AdamW's exp_avg and exp_avg_sq in the parameter's dtype, and a float32 `step` per
  parameter (fused AdamW keeps it as a tensor). These three are exact: tests/test_memory.py
  compares them with the tensors of a real step;
- reference: with learner.kl_coef > 0, a frozen fp32 copy of the model, whole on every rank;
- gathered: under FSDP2, a decoder layer unsharded for compute and the next one prefetched;
- casts: on one rank with bf16 autocast, the bf16 copy of every weight autocast keeps for a step;
- activations at `merge.max_tokens` tokens (one packed micro-batch), without and with gradient
  checkpointing, and the logits of one `logprob_chunk_tokens` chunk (packed_forward.py). These
  are estimates: what autograd saves per token of a decoder layer (two RMSNorms' fp32 input and
  output, autocast's bf16 copy of each projection's input, q/k/v, rotary, attention in and out,
  Qwen3's per-head q/k norms, SwiGLU's gate, up and product), for a standard attention layer; a
  Gated DeltaNet layer is counted as one of the same widths.

The peak is the static part plus the larger of the gradients (all alive at the optimizer step)
and the activations with the logits (all alive when backward starts, before most gradients
exist). Measured on an H200 (bench/memory_bench.py: bf16 autocast, one rank, 16k and 32k tokens,
Qwen3-0.6B, Llama-3.2-1B and Qwen3-4B shapes), the estimate was 1.00-1.04x the peak without
gradient checkpointing and 1.05-1.19x with it (docs/gpu.md has the table).

Not counted: the CUDA context and the caching allocator's slack (`check` keeps 5% of the device
for them), NCCL buffers, and on a CPU learner the embedded engine that shares the host's memory.
"""

from __future__ import annotations

import math

import msgspec

from polar_fast.config import Config

FP32 = 4
ADAM_MOMENTS = 2  # exp_avg, exp_avg_sq
STEP_BYTES = 4  # fused AdamW's per-parameter float32 step tensor
PREFETCHED_LAYERS = 2  # FSDP2: the layer computing and the one being gathered
LOGIT_COPIES_FP32 = 4  # a chunk's logits as float32, cross-entropy's log-softmax, their gradient, the entropy's softmax


class MemoryEstimate(msgspec.Struct, frozen=True, kw_only=True):
    """Bytes per rank; see the module docstring for what each part holds."""

    params: int  # parameters of the model (tied weights once)
    world: int  # ranks the weights, gradients and optimizer state are sharded over
    tokens: int  # tokens of one packed micro-batch (merge.max_tokens)
    weights: int
    gradients: int
    optimizer: int
    reference: int  # the frozen KL reference (0 without kl_coef)
    gathered: int  # FSDP2 unsharded layers in flight (0 on one rank)
    casts: int  # autocast's bf16 weight copies (one rank, bf16; else 0)
    activations: int  # at `tokens`, without gradient checkpointing
    activations_checkpointed: int  # the same with gradient checkpointing
    logits: int  # one logprob chunk's logits, forward and backward

    def total_bytes(self, *, checkpointing: bool) -> int:
        """The peak: the static part, plus the gradients or the activations, whichever is larger."""
        acts = self.activations_checkpointed if checkpointing else self.activations
        static = self.weights + self.optimizer + self.reference + self.gathered + self.casts
        return static + max(self.gradients, acts + self.logits)


def meta_model(model_path: str):
    """The causal LM of `model_path`'s config with every tensor on the meta device (no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from polar_fast.model import model_dir

    config = AutoConfig.from_pretrained(str(model_dir(model_path)))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _shard_elements(shape: tuple[int, ...], world: int) -> int:
    """Elements of the largest dim-0 shard FSDP2 gives a rank (uneven shards are padded)."""
    if not shape:
        return 1
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def estimate_memory(cfg: Config, *, world: int = 1, model=None) -> MemoryEstimate:
    """The learner's memory per rank for this run on `world` ranks; `model`: a meta (or real)
    model to count instead of building one from model.path."""
    model = model if model is not None else meta_model(cfg.model.path)
    lc = cfg.learner
    params = list(model.parameters())  # tied weights once
    n_params = sum(p.numel() for p in params)
    elements = sum(_shard_elements(tuple(p.shape), world) for p in params)
    weights = elements * FP32
    optimizer = ADAM_MOMENTS * elements * FP32 + STEP_BYTES * len(params)
    compute = 2 if lc.dtype == "bfloat16" else FP32
    # one rank with autocast keeps an fp32 residual stream; FSDP2's bf16 policy computes in bf16 throughout
    residual = compute if world > 1 else FP32
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = model.get_decoder().layers
    gathered = 0
    if world > 1:
        largest = max(sum(p.numel() for p in layer.parameters()) for layer in layers)
        gathered = PREFETCHED_LAYERS * largest * compute
    autocast = world == 1 and compute != FP32
    first = layers[0]
    qk_norm = any(name.endswith(("q_norm", "k_norm")) for name, _ in first.named_modules())
    per_layer = _layer_activation_bytes(text, compute=compute, residual=residual, autocast=autocast,
                                        qk_norm=qk_norm)  # per token
    tokens = cfg.merge.max_tokens
    hidden = text.hidden_size
    outside = tokens * hidden * (residual * 2 + compute)  # embeddings, final norm, the rows sent to the head
    activations = tokens * per_layer * len(layers) + outside
    checkpointed = tokens * (hidden * residual * len(layers) + per_layer) + outside
    chunk = min(lc.logprob_chunk_tokens, tokens)
    logits = chunk * text.vocab_size * (compute + LOGIT_COPIES_FP32 * FP32)
    return MemoryEstimate(
        params=n_params, world=world, tokens=tokens, weights=weights, gradients=weights, optimizer=optimizer,
        reference=n_params * FP32 if lc.kl_coef > 0 else 0, gathered=gathered,
        casts=n_params * compute if autocast else 0, activations=activations,
        activations_checkpointed=checkpointed, logits=logits)


def _layer_activation_bytes(text, *, compute: int, residual: int, autocast: bool, qk_norm: bool) -> int:
    """What autograd keeps per token for one decoder layer's backward (module docstring)."""
    h = text.hidden_size
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or h // heads
    q = heads * head_dim
    kv = (getattr(text, "num_key_value_heads", None) or heads) * head_dim
    inter = text.intermediate_size
    norms = 2 * (FP32 + residual) * h  # each RMSNorm: its input upcast to fp32, and its output
    # autocast casts a projection's input once per projection: q, k and v each keep a copy, as do gate and up
    attn_inputs, mlp_inputs = (3, 2) if autocast else (1, 1)
    attention = compute * (attn_inputs * h + 3 * q + 4 * kv) + FP32 * heads  # q/k/v, rotary, sdpa in/out, lse
    if qk_norm:  # Qwen3: an RMSNorm per head on q and k
        attention += (FP32 + compute) * (q + kv)
    mlp = compute * (mlp_inputs * h + 4 * inter)  # gate, up, act(gate), product
    return norms + attention + mlp
