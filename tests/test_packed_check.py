"""The learner's start-up guard: a tiny random model of the configured architecture must give the
same layer outputs, logprobs and gradients packed as per call, or the learner refuses to start."""

from __future__ import annotations

import pytest
import torch
from test_packed_forward import tiny_llama, tiny_qwen35

from polar_fast.config import LearnerConfig
from polar_fast.errors import PackedForwardError
from polar_fast.grpo import Learner
from polar_fast.learner import packed_attention, packed_check, packed_recurrence


@pytest.fixture(autouse=True)
def _fresh_guard(monkeypatch):
    monkeypatch.setattr(packed_check, "_passed", set())  # every test runs the check itself
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("layout", ["tree", "paths"])
@pytest.mark.parametrize("model", [tiny_llama, tiny_qwen35], ids=["llama", "qwen35"])
def test_exact_layouts_pass(model, layout):
    packed_check.check(model(), layout, attention=packed_attention.NAME)


def test_a_learner_refuses_a_recurrent_layer_that_leaks(monkeypatch):
    monkeypatch.setattr(packed_recurrence, "install", lambda lm: False)  # Gated DeltaNet packed as one row
    with pytest.raises(PackedForwardError) as err:
        Learner(LearnerConfig(), tiny_qwen35(), layout="tree")
    message = str(err.value)
    assert "packed 'tree' forward of Qwen3_5ForCausalLM" in message
    assert "first at decoder layer 0 (linear_attention, Qwen3_5GatedDeltaNet)" in message
    Learner(LearnerConfig(check_packed=False), tiny_qwen35(), layout="tree")  # the check can be turned off


def test_attention_that_leaks_across_sequences_is_refused(monkeypatch):
    def one_causal_block(size, dtype=torch.float32, *args):
        return packed_attention.Plan([len(size)], None, [len(size)], [None])

    monkeypatch.setattr(packed_attention, "plan", one_causal_block)
    with pytest.raises(PackedForwardError, match=r"packed 'paths' forward .* decoder layer 0 \(LlamaAttention\)"):
        packed_check.check(tiny_llama(), "paths", attention=packed_attention.NAME)


def test_tiny_copy_keeps_class_and_layer_types():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=1000, hidden_size=96, intermediate_size=192, num_hidden_layers=8,
                            num_attention_heads=6, num_key_value_heads=3, head_dim=16, linear_key_head_dim=16,
                            linear_value_head_dim=16, linear_num_key_heads=3, linear_num_value_heads=6)
    tiny = packed_check.tiny_copy(Qwen3_5ForCausalLM(cfg))
    assert type(tiny) is Qwen3_5ForCausalLM
    assert tiny.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (tiny.config.hidden_size, tiny.config.vocab_size, tiny.config.num_attention_heads) == (64, 256, 4)
    assert tiny.config.num_attention_heads % tiny.config.num_key_value_heads == 0
    assert tiny.config.linear_num_value_heads % tiny.config.linear_num_key_heads == 0
