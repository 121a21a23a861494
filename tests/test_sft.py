"""`sft`: fine-tuning on token rows in export's format lowers their loss, with the packed learner,
and writes a model directory that loads again (and that `eval --checkpoint` takes as is)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_packed_forward import tiny_llama

from polar_fast.config import parse_config
from polar_fast.evaluate import checkpoint_model_dir
from polar_fast.grpo import Learner
from polar_fast.learner.batches import nll_step_batch
from polar_fast.learner.sft import SftError, read_rows, run_sft
from polar_fast.model import load_model, load_tokenizer

EXCHANGES = [("Which file holds the bug?", "calc.py, in the function total."),
             ("What command runs the tests?", "python3 -m unittest -v")]


def token_rows() -> list[dict]:
    """Rows as export writes them: the chat template's ids, loss_mask 1 on the reply tokens."""
    tok = load_tokenizer()
    rows = []
    for question, answer in EXCHANGES:
        user = [{"role": "user", "content": question}]
        prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
        whole = tok.apply_chat_template(user + [{"role": "assistant", "content": answer}], tokenize=False)
        p_ids = tok.encode(prompt, add_special_tokens=False)
        ids = tok.encode(whole, add_special_tokens=False)
        assert ids[: len(p_ids)] == p_ids
        rows.append({"input_ids": ids, "loss_mask": [0] * len(p_ids) + [1] * (len(ids) - len(p_ids))})
    return rows


def update_gap(start: dict, a: dict, b: dict) -> tuple[float, float]:
    """(|a - b|, |b - start|) over all parameters: how far two fine-tunes of `start` ended apart,
    beside how far one of them moved."""
    def norm(diffs) -> float:
        return float(torch.cat([d.flatten().float() for d in diffs]).norm())
    return norm(a[n] - b[n] for n in start), norm(b[n] - start[n] for n in start)


def write_rows(path, rows) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokens.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sft_lowers_the_loss_on_its_rows_and_writes_a_loadable_model(tmp_path):
    write_rows(tmp_path / "data", token_rows())
    cfg = parse_config({"run": {"output_dir": str(tmp_path / "run")}, "sft": {"epochs": 3, "lr": 1e-4, "rows_per_step": 1}})
    report = run_sft(cfg, tmp_path / "data", Learner.from_config, out_dir=tmp_path / "model")
    assert report.rows == 2 and report.steps == 6 and report.trained_tokens > 10
    assert report.nll_after < report.nll_before * 0.8, (report.nll_before, report.nll_after)
    assert checkpoint_model_dir(str(tmp_path / "model"), "") == tmp_path / "model"
    tuned, base = load_model(str(tmp_path / "model")), load_model("")
    changed = [n for n, p in tuned.state_dict().items() if not p.equal(base.state_dict()[n])]
    assert changed  # the saved weights are the fine-tuned ones


def test_sft_fits_the_models_own_distribution_whatever_the_runs_sampling_temperature(tmp_path, tiny_model):
    # a warm start is cached without the sampling temperature: sft must not compute with it
    write_rows(tmp_path / "data", token_rows())
    seen = []

    def build(cfg):
        seen.append(cfg.sampling.temperature)
        return Learner.from_config(cfg)

    nll = {}
    for temperature in (0.7, 1.0):
        cfg = parse_config({"model": {"path": str(tiny_model)}, "sampling": {"temperature": temperature},
                            "sft": {"epochs": 1, "lr": 1e-4, "rows_per_step": 2}})
        nll[temperature] = run_sft(cfg, tmp_path / "data", build, out_dir=tmp_path / f"model-{temperature}").nll_before
    assert seen == [1.0, 1.0]
    assert nll[0.7] == nll[1.0]


def test_bad_rows_are_named(tmp_path):
    with pytest.raises(SftError, match="write them with `python -m polar_fast export`"):
        read_rows(tmp_path / "missing")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "tokens.jsonl").write_text('{"input_ids": [1, 2], "loss_mask": [1]}\n')
    with pytest.raises(SftError, match="row 1: 2 input_ids but 1 loss_mask"):
        read_rows(tmp_path / "a")
    (tmp_path / "a" / "tokens.jsonl").write_text('{"input_ids": [1, 2], "loss_mask": [0, 0]}\n')
    with pytest.raises(SftError, match="no row has a trainable"):
        read_rows(tmp_path / "a")


def test_sft_cli_says_what_is_missing_in_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "polar_fast", "sft", "--data", str(tmp_path / "none"),
                           "--set", f"run.output_dir={tmp_path}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "no SFT token rows" in done.stderr


def test_rows_sharing_a_prompt_are_forwarded_once_with_the_same_loss():
    """Two multi-turn rows with the same system prompt: the tree batch forwards that prompt once,
    the per-call layout forwards every call whole, and the token-mean NLL is the same."""
    from polar_fast.config import LearnerConfig

    system = list(range(100, 160))  # token ids < tiny_llama's vocabulary of 211
    rows = []
    for r in range(2):
        reply1, obs, reply2 = [20 + r, 21, 22], [30 + r, 31], [40 + r, 41]
        ids = system + [10 + r] + reply1 + obs + reply2
        mask = [0] * (len(system) + 1) + [1] * 3 + [0] * 2 + [1] * 2
        rows.append((ids, mask))
    tree = nll_step_batch(rows, layout="tree")
    flat = nll_step_batch(rows, layout="percall")
    assert tree.n_terms == flat.n_terms == 10
    assert tree.n_tokens < len(system) + 2 * 10 < flat.n_tokens
    learner = Learner(LearnerConfig(), tiny_llama(), layout="tree")
    assert learner.nll(tree) == pytest.approx(learner.nll(flat), rel=1e-5)


def test_small_micro_batches_train_the_same_step(tmp_path, tiny_model):
    # sft.micro_batch_tokens: each row its own micro-batch (the bound of 1 rises to the longest
    # row); the step's gradient is still the sum over all its rows
    write_rows(tmp_path / "data", token_rows())
    seen = {}

    def build(tag):
        def learner(cfg):
            built = Learner.from_config(cfg)
            step = built.train_step
            seen[tag] = []

            def counted(batch, **kw):
                seen[tag].append(len(batch.micro_batches))
                return step(batch, **kw)
            built.train_step = counted
            return built
        return learner

    start = load_model(str(tiny_model)).state_dict()
    weights = {}
    for tag, micro in (("whole", 0), ("small", 1)):
        cfg = parse_config({"model": {"path": str(tiny_model)},
                            "sft": {"epochs": 2, "lr": 1e-3, "rows_per_step": 2, "micro_batch_tokens": micro}})
        run_sft(cfg, tmp_path / "data", build(tag), out_dir=tmp_path / tag)
        weights[tag] = load_model(str(tmp_path / tag)).state_dict()
    assert seen == {"whole": [1, 1], "small": [2, 2]}
    gap, update = update_gap(start, weights["small"], weights["whole"])
    assert update > 0 and gap < 0.05 * update, (gap, update)


def test_a_negative_micro_batch_bound_is_an_sft_error(tmp_path, tiny_model):
    write_rows(tmp_path / "data", token_rows())
    cfg = parse_config({"model": {"path": str(tiny_model)}, "sft": {"micro_batch_tokens": -1}})
    with pytest.raises(SftError, match="micro_batch_tokens >= 0"):
        run_sft(cfg, tmp_path / "data", Learner.from_config, out_dir=tmp_path / "m")
