"""Learner checkpoints: retention keeps the newest N and never the one `latest` names, and
`export-model` writes a checkpoint's weights as an HF model directory."""

from __future__ import annotations

import torch

from polar_fast.cli import main
from polar_fast.learner.checkpoint import prune_checkpoints


def test_retention_keeps_the_newest_and_always_the_latest(tmp_path):
    for step in (2, 4, 6, 8, 10):
        (tmp_path / f"step_{step}.pt").write_bytes(b"x")
        (tmp_path / f"step_{step}.pt.hf").mkdir()  # an `eval --checkpoint` conversion beside it
    (tmp_path / "latest").write_text("step_4.pt")  # e.g. a resumed run that went back to step 4
    removed = prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in removed) == ["step_2.pt", "step_6.pt"]
    assert sorted(p.name for p in tmp_path.glob("step_*.pt")) == ["step_10.pt", "step_4.pt", "step_8.pt"]
    assert not (tmp_path / "step_2.pt.hf").exists() and (tmp_path / "step_8.pt.hf").is_dir()
    assert prune_checkpoints(tmp_path, 0) == []  # 0 keeps all
    (tmp_path / "latest").write_text("step_10.pt")
    assert [p.name for p in prune_checkpoints(tmp_path, 1)] == ["step_4.pt", "step_8.pt"]


def test_export_model_writes_the_checkpoint_as_an_hf_model(tmp_path, capsys):
    from test_packed_forward import tiny_llama

    from polar_fast.config import LearnerConfig
    from polar_fast.grpo import Learner
    from polar_fast.model import load_model, load_tokenizer

    base = tmp_path / "base"
    tiny_llama().save_pretrained(base)
    load_tokenizer().save_pretrained(base)
    learner = Learner(LearnerConfig(check_packed=False), load_model(str(base)))
    with torch.no_grad():
        next(learner.policy.parameters()).add_(1.0)  # weights the base does not have
    learner.save(str(tmp_path / "checkpoints"))
    assert main(["export-model", "--set", f"model.path={base}", "--checkpoint", str(tmp_path / "checkpoints"),
                 "--out", str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().out.strip() == f"model: {tmp_path / 'hf'}"
    exported = load_model(str(tmp_path / "hf")).state_dict()
    for name, tensor in learner.policy.lm.state_dict().items():
        assert torch.equal(exported[name], tensor), name
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    assert main(["export-model", "--checkpoint", str(tmp_path / "nope.pt"), "--out", str(tmp_path / "x")]) == 2
    assert "nope.pt does not exist" in capsys.readouterr().err
