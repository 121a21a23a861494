"""run.toml parsing: defaults, overrides, and errors that name the key and the expected type."""

from __future__ import annotations

import pytest

from polar_fast.config import Config, load_config, parse_config
from polar_fast.errors import ConfigError


def test_defaults_need_no_file():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.engine.kind == "embedded" and cfg.sandbox.kind == "local"
    assert cfg.harness.name == "mini-swe-agent"


def test_file_and_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[learner]\nlr = 3e-6\n[pools]\ngroup_size = 8\n[engine]\nlaunch_gpus = [0, 1]\n')
    cfg = load_config(path, ["pools.group_size=16", "harness.name=codex", "model.path=/m/x.gguf"])
    assert cfg.learner.lr == 3e-6
    assert cfg.pools.group_size == 16
    assert cfg.harness.name == "codex"
    assert cfg.model.path == "/m/x.gguf"
    assert cfg.engine.launch_gpus == [0, 1]


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"learner": {"lr": "fast"}}, "key 'learner.lr': expected `float`, got `str`"),
        ({"learner": {"lrr": 1e-6}}, "unknown key 'learner.lrr'"),
        ({"lerner": {}}, "unknown key 'lerner'"),
        ({"pools": {"group_size": 2.5}}, "key 'pools.group_size': expected `int`, got `float`"),
        ({"engine": {"launch_gpus": [0, "x"]}}, "key 'engine.launch_gpus.1': expected `int`"),
        ({"harness": {"name": 3}}, "key 'harness.name': expected `str`, got `int`"),
    ],
)
def test_bad_config_names_the_key(raw, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        parse_config(raw)


def test_unknown_harness_names_the_key_at_start():
    # any name parses (a declared harness may carry it); resolving it, first thing at start, fails
    from polar_fast.rollouts.harnesses import run_harness

    with pytest.raises(ConfigError, match="key 'harness.name': unknown harness 'cursor'; known harnesses: claude-code"):
        run_harness(parse_config({"harness": {"name": "cursor"}}).harness)


def test_bad_toml_and_missing_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[learner\nlr = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, ["lr"])
