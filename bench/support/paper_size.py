"""The model the Polar paper trains, Qwen3.5-4B, at its published size, for bench/gpu_check.py.

QWEN35_4B holds the text model's published configuration values (Qwen/Qwen3.5-4B config.json,
`text_config`), written out here: nothing is downloaded, and the weights are random, initialised
on the device. 32 layers, every 4th full attention (16 query / 4 key-value heads of 256, gated
output, rotary on a quarter of each head, theta 1e7), the other 24 Gated DeltaNet (16 key heads
and 32 value heads of 128, causal conv of 4), hidden 2560, MLP 9216, vocabulary 248,320 tied to
the LM head: 4.2B parameters. `small()` keeps the layer types and head ratios at a CPU width (the
smoke run the tests make).

FLOPs of a packed step (`step_flops`), the usual model-FLOPs count (no recomputation counted):
6 x non-embedding parameters x tokens forwarded, 6 x hidden x vocabulary per loss term (only those
rows reach the LM head), and for each full-attention layer 12 x heads x head_dim per (query, key)
pair attended, where a packed token attends to its ancestors: depth + 1 keys. The Gated DeltaNet
scan (~1% of the total at 16k) is left out.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import numpy as np

QWEN35_4B: dict[str, Any] = dict(
    vocab_size=248320, hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
    num_attention_heads=16, num_key_value_heads=4, head_dim=256,
    linear_num_key_heads=16, linear_key_head_dim=128, linear_num_value_heads=32, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
    hidden_act="silu", rms_norm_eps=1e-6, max_position_embeddings=262144, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
)

# dense bf16 tensor-core peak of the chips a device may be, from their spec sheets (SXM parts)
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


def small() -> dict[str, Any]:
    """QWEN35_4B's layer types and head ratios at a CPU width: 4 layers (3 Gated DeltaNet + 1
    full attention), key heads half the value heads, as in the 4B."""
    return {**QWEN35_4B, "vocab_size": 4000, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2,
            "linear_key_head_dim": 32, "linear_num_value_heads": 4, "linear_value_head_dim": 32,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"], "max_position_embeddings": 16384}


def build(values: dict[str, Any], device: str):
    """A random-weight Qwen3_5ForCausalLM of `values`, its parameters created on `device`."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    with torch.device(device):
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**values)).float()


def parameters(model) -> tuple[int, int]:
    """(all parameters, those outside the embedding): tied weights counted once."""
    total = sum(p.numel() for p in model.parameters())
    return total, total - model.get_input_embeddings().weight.numel()


def step_flops(batch, values: dict[str, Any], non_embedding: int) -> float:
    """Model FLOPs of one training step (forward + backward) on a StepBatch (see the docstring)."""
    tokens = batch.n_tokens
    pairs = sum(float(np.asarray(mb.positions, np.float64).sum()) + len(mb.positions) for mb in batch.micro_batches)
    full = values["layer_types"].count("full_attention")
    attention = 12.0 * full * values["num_attention_heads"] * values["head_dim"] * pairs
    head = 6.0 * values["hidden_size"] * values["vocab_size"] * batch.n_terms
    return 6.0 * non_embedding * tokens + head + attention


def peak_flops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)


def scan_kernel() -> str:
    """Which gated-delta-rule kernel the Qwen3.5 modeling module calls: flash-linear-attention's
    when `fla` was importable when transformers loaded it (and the inputs are on CUDA), else the
    torch reference."""
    module = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    fn: Any = module.torch_chunk_gated_delta_rule
    for _ in range(4):  # packed_recurrence's hook -> kernels' Func module -> transformers' fallback wrapper
        fn = getattr(fn, "polar_original", fn)
        code_of = type(fn).forward if not hasattr(fn, "__code__") and hasattr(type(fn), "forward") else fn
        cells = dict(zip(code_of.__code__.co_freevars, (c.cell_contents for c in code_of.__closure__ or ())))
        inner = cells.get("implementation", cells.get("func"))
        if inner is None or inner is fn:
            break
        fn = inner
    return f"{fn.__module__}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def fla_version() -> str | None:
    """flash-linear-attention's version when it is installed, else None."""
    if importlib.util.find_spec("fla") is None:
        return None
    import fla

    return getattr(fla, "__version__", "?")
