"""The forward of one embedded-engine step: the packed tokens of several calls in, the logits of
the rows that sample out.

Two ways, chosen per model by `for_model`:
- `FusedStep`, for Llama-shaped decoders (Llama, Mistral without sliding windows, Qwen2, and
  SmolLM2, the default): the model's arithmetic written out over its weights, with fewer and
  larger ops than transformers' modules run. On 2 cores at 8 calls, transformers' module calls,
  hooks and small ops were 24 ms of a 108 ms step (issue 36); a decode step's matmuls are
  bound by reading the weights, and everything else is per-op overhead. So:
  - q, k and v are one matmul (their weights packed into one tensor), gate and up another;
  - rotary turns q and k in one pass; each RMSNorm is one kernel; residual adds happen in place;
  - attention stays batched_attention's (each call its own keys, shared prefixes read once);
  - the LM head runs only on the rows that sample.
  The module's own parameters become views of the packed tensors, so a weight update (a copy
  into the model's state dict) reaches the step with nothing to rebuild but the LM head's
  low-precision copy (`refresh`).
- `TransformersStep`: the model's own forward with batched_attention registered as its
  attention, for any other architecture transformers routes through its attention interface.

Precision. float32 computes what transformers' float32 forward does, op for op up to the order
of a reduction: a call samples the same ids alone or batched, and its logprobs are a
teacher-forced forward's. bfloat16 (engine.dtype) computes the way the learner's bf16 autocast
does (grpo.Learner.autocast): matmuls, the LM head included, in bf16 on weights rounded from the
float32 ones; embedding, residual stream, norms and rotary in float32; keys and values cached in
bf16. A bf16 engine and a bf16 learner then round the same values the same way, and the
mismatch the learner measures is what their kernels add, not two recipes of rounding.

Compile (engine.compile = true): the dense parts of each layer, everything between two attention
calls, go through torch.compile (inductor: fused C++ loops for the norms, rotary, activation and
residuals around the matmuls). Attention reads per-call caches of data-dependent lengths and
stays eager. The token count of a step varies (decode rows, prefill chunks), so the compiled
functions take it as a dynamic size; torch specialises a size of 1 apart, so there are two
buckets, a step of one row and a step of any more, both compiled when the engine starts, once
per process (`compile_s` says what it cost; inductor's cache on disk makes later processes
cheaper). Inductor needs a C++ compiler; without one the step runs eager and says so once.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from polar_fast.engines import batched_attention
from polar_fast.engines.batched_attention import StepPlan

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def for_model(model: nn.Module, *, dtype: str, compile: bool = False, fused: bool = True,
              rows: int = 8) -> FusedStep | TransformersStep:
    """The step for `model` (loaded in float32): fused where its shape allows (and `fused`: False
    is the reference bench/engine_bench.py compares against), else transformers'. `rows`: the
    calls a step usually decodes."""
    if dtype == "bfloat16" and model.device.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        log.warning("engine.dtype = bfloat16 on a CPU without native bf16 (no avx512_bf16 / amx): it runs, "
                    "slower than float32")
    if fused and why_not_fused(model) is None:
        return FusedStep(model, DTYPES[dtype], compile=compile, rows=rows)
    model.to(DTYPES[dtype])
    return TransformersStep(model)


def why_not_fused(model: nn.Module) -> str | None:
    """None when FusedStep computes exactly what the model's forward does; else the reason."""
    config = model.config
    decoder = model.get_decoder()
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
        return "logit softcapping"
    for layer in getattr(decoder, "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        parts = [attn, mlp, getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
        if any(p is None for p in parts) or set(dict(layer.named_children())) != {
                "self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}:
            return f"{type(layer).__name__} is not a Llama-shaped layer"
        if set(dict(attn.named_children())) != {"q_proj", "k_proj", "v_proj", "o_proj"}:  # q_norm: Qwen3, OLMo2
            return f"{type(attn).__name__} has parts besides q/k/v/o projections"
        if set(dict(mlp.named_children())) - {"gate_proj", "up_proj", "down_proj", "act_fn"}:
            return f"{type(mlp).__name__} is not a gated MLP"
    if set(dict(decoder.named_children())) != {"embed_tokens", "layers", "norm", "rotary_emb"}:
        return f"{type(decoder).__name__} has parts besides embedding, layers, norm and rotary"
    if type(model).__name__ not in FUSED_CLASSES:  # e.g. a scaled embedding (Gemma) hides in forward()
        return f"{type(model).__name__} is not one of the classes checked against the fused step"
    return None


# forwards read and found to be: embed -> [norm, attention (rotary), residual, norm, silu MLP,
# residual] per layer -> norm -> LM head, nothing more
FUSED_CLASSES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


class TransformersStep:
    """The model's own forward, batched_attention as its attention (any supported architecture)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.dtype = model.dtype
        model.set_attn_implementation(batched_attention.NAME)
        self.compile_s = 0.0

    def logits(self, tokens: list[int], positions: list[int], plan: StepPlan, rows: list[int]) -> torch.Tensor | None:
        device = self.model.device
        hidden = self.model.get_decoder()(
            input_ids=torch.tensor([tokens], device=device), position_ids=torch.tensor([positions], device=device),
            attention_mask=None, use_cache=False, step_plan=plan,
        ).last_hidden_state[0]  # (T, H)
        if not rows:
            return None
        picked = hidden.index_select(0, torch.tensor(rows, device=device))
        return self.model.get_output_embeddings()(picked).float()  # (B, V)

    def refresh(self) -> None:
        pass


class _Proj(NamedTuple):
    """One matmul's operands: the weight (the model's parameters are views of its rows), its bias,
    and, on a CPU with oneDNN, the weight reordered into oneDNN's blocked layout (`blocked`): what
    inductor's weight prepacking does, without a compile. At the 8 rows of a decode step on 2 cores
    it runs 2-4x faster than the plain weight, in bf16 and in float32 alike (float32: the LM head
    16.9 -> 4.1 ms, a layer's four matmuls 0.76 -> 0.36 ms), and a little faster at a prefill chunk's.
    Its float32 rounding differs from the plain matmul's only in the order of a reduction, and a row
    computes alike whatever rows share its step, as the plain one does."""

    weight: torch.Tensor | None
    bias: torch.Tensor | None
    blocked: torch.Tensor | None = None

    def reblocked(self, rows: int) -> _Proj:
        return self._replace(blocked=torch.ops.mkldnn._reorder_linear_weight(self.weight, rows))


@dataclass(eq=False)
class _Layer:
    """One decoder layer: packed projections in the compute dtype, norms in float32."""

    norm_attn: torch.Tensor  # (H,)
    qkv: _Proj  # ((heads + 2 kv_heads) * D, H)
    o: _Proj  # (H, heads * D)
    norm_mlp: torch.Tensor
    gate_up: _Proj  # (2 I, H)
    down: _Proj  # (H, I)

    @classmethod
    def pack(cls, layer: nn.Module, dtype: torch.dtype) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return cls(layer.input_layernorm.weight.detach(), _pack([attn.q_proj, attn.k_proj, attn.v_proj], dtype),
                   _pack([attn.o_proj], dtype), layer.post_attention_layernorm.weight.detach(),
                   _pack([mlp.gate_proj, mlp.up_proj], dtype), _pack([mlp.down_proj], dtype))

    def reblock(self, rows: int) -> None:
        self.qkv, self.o, self.gate_up, self.down = (p.reblocked(rows) for p in (self.qkv, self.o, self.gate_up,
                                                                                  self.down))


def _pack(linears: list[nn.Linear], dtype: torch.dtype) -> _Proj:
    """The linears' weights (and biases) stacked into one tensor in `dtype`; each linear's own
    parameter becomes a view of its rows, so that copying into the model's state dict (a weight
    update) writes the packed tensor, rounding to `dtype` as autocast's cast does."""
    weight = torch.cat([lin.weight.detach() for lin in linears]).to(dtype)
    biases = [lin.bias for lin in linears]
    bias = None if biases[0] is None else torch.cat([b.detach() for b in biases]).to(dtype)
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[start:start + rows], requires_grad=False)
        start += rows
    return _Proj(weight, bias)


def _blocks(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the step's matmuls read oneDNN-blocked weights: on a CPU with oneDNN, in float32
    and bfloat16 (a CPU without native bf16 runs them too, slowly: for_model says so). The blocked
    copy is held beside the plain weights, which stay the model's parameters: in float32 that is a
    second copy of the weights (0.54 GB for SmolLM2-135M), the price of the speed."""
    return device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()


class FusedStep:
    """A Llama-shaped decoder's step, written out (see the module docstring)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype, *, compile: bool = False, rows: int = 8) -> None:
        """`rows`: the rows a decode step usually has (the engine's batch), which oneDNN's
        blocked weights are laid out for; any other count works too."""
        config, decoder = model.config, model.get_decoder()
        self.model = model
        self.dtype = dtype  # matmuls, keys and values
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.hidden_size = config.hidden_size
        self.eps = config.rms_norm_eps
        self.scaling = decoder.layers[0].self_attn.scaling
        self.embed = decoder.embed_tokens.weight.detach()  # float32: the learner's embedding is too
        self.norm = decoder.norm.weight.detach()
        self.rotary = decoder.rotary_emb
        with torch.no_grad():
            self.layers = [_Layer.pack(layer, dtype) for layer in decoder.layers]
        half = self.head_dim // 2
        # rotate_half(x) * sin == roll(x, D/2) * (sin with its first half negated), exactly
        self._sin_sign = torch.cat([-torch.ones(half), torch.ones(self.head_dim - half)])
        self._before, self._after = _before_attention, _after_attention
        self.compile_s = 0.0
        # inductor compiles the plain weights' matmuls itself: blocked ones only run eager
        self._block_rows = rows if _blocks(dtype, self.embed.device) and not compile else 0
        self.refresh()
        if compile:
            self._compile()

    def refresh(self) -> None:
        """After a weight update: the LM head in the compute dtype (a copy in bf16: the
        embedding it is tied to stays float32) and the oneDNN-blocked weights; the plain packed
        weights are views of the model's parameters and already current."""
        head = self.model.get_output_embeddings().weight.detach()
        self.head = _Proj(head if head.dtype == self.dtype else head.to(self.dtype), None)
        if self._block_rows:
            self.head = _Proj(None, None, self.head.reblocked(self._block_rows).blocked)  # the plain copy is not needed
            for layer in self.layers:
                layer.reblock(self._block_rows)

    def logits(self, tokens: list[int], positions: list[int], plan: StepPlan, rows: list[int]) -> torch.Tensor | None:
        """(len(rows), V) float32 logits of the packed rows `rows`; None when no row samples."""
        device = self.embed.device
        x = F.embedding(torch.tensor(tokens, device=device), self.embed)  # (T, H) float32
        cos, sin = self.rotary(x, torch.tensor([positions], device=device))  # (1, T, D) float32
        cos, sin = cos[0, :, None], (sin[0] * self._sin_sign.to(device))[:, None]  # (T, 1, D)
        shape = (self.heads, self.kv_heads, self.head_dim, self.eps, self.dtype)
        for i, w in enumerate(self.layers):
            q, k, v = self._before(x, w.norm_attn, w.qkv, cos, sin, *shape)
            a = batched_attention.attend(i, q, k, v, plan, self.scaling)  # (T, heads * D)
            x = self._after(x, a, w.o, w.norm_mlp, w.gate_up, w.down, self.eps, self.dtype)
        if not rows:
            return None
        picked = _rms_norm(x.index_select(0, torch.tensor(rows, device=device)), self.norm, self.eps)
        return _linear(picked.to(self.dtype), self.head).float()  # (B, V)

    def _compile(self) -> None:
        """Compile the dense parts now, on a throwaway step of each shape class, so that the first
        real call does not pay for it (and `compile_s` states the cost)."""
        if shutil.which("c++") is None and shutil.which("g++") is None:
            log.warning("engine.compile: no C++ compiler for inductor (scripts/install.sh installs g++); "
                        "the embedded engine runs its step eager")
            return
        started = time.perf_counter()
        self._before = torch.compile(_before_attention, fullgraph=True)
        self._after = torch.compile(_after_attention, fullgraph=True)
        self._warm_up()
        self.compile_s = time.perf_counter() - started
        log.info("engine.compile: the embedded engine's step compiled in %.1f s", self.compile_s)

    def _warm_up(self) -> None:
        """A step of 1 row, then one of 3: the first compiles for its static size, the second
        recompiles with the row count dynamic (torch's automatic dynamic shapes), which serves
        every step of 2 rows or more."""
        from polar_fast.engines.batched_attention import CallKV, Segment

        for n in (1, 3):
            kv = CallKV.for_model(self.model.config, dtype=self.dtype, device=self.embed.device, capacity=n)
            plan = StepPlan.of([Segment(kv, 0, n)], self.embed.device, self.dtype,
                               rep=self.heads // self.kv_heads)
            with torch.inference_mode():
                self.logits(list(range(n)), list(range(n)), plan, [n - 1])


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _linear(x: torch.Tensor, proj: _Proj) -> torch.Tensor:
    if proj.blocked is not None:
        return torch.ops.mkldnn._linear_pointwise(x, proj.blocked, proj.bias, "none", [], "")
    return F.linear(x, proj.weight, proj.bias)


def _before_attention(x: torch.Tensor, norm: torch.Tensor, qkv: _Proj, cos: torch.Tensor, sin: torch.Tensor,
                      heads: int, kv_heads: int, head_dim: int, eps: float,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (T, H) float32 -> q (T, heads, D), k, v (T, kv_heads, D) in `dtype`, q and k turned."""
    qkv_out = _linear(_rms_norm(x, norm, eps).to(dtype), qkv).unflatten(1, (-1, head_dim))
    qk = qkv_out[:, : heads + kv_heads].float()  # rotary in float32, as the learner's autocast runs it
    qk = (qk * cos + qk.roll(head_dim // 2, -1) * sin).to(dtype)
    return qk[:, :heads], qk[:, heads:], qkv_out[:, heads + kv_heads:]


def _after_attention(x: torch.Tensor, attn: torch.Tensor, o: _Proj, norm: torch.Tensor, gate_up: _Proj,
                     down: _Proj, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """The rest of a layer: attention out (T, heads * D) -> residual -> norm -> silu MLP -> residual."""
    x = x + _linear(attn, o)
    gate, up = _linear(_rms_norm(x, norm, eps).to(dtype), gate_up).chunk(2, dim=-1)
    return x + _linear(F.silu(gate) * up, down)
