"""The config schema: what a user's typo or bad value gets back."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rolloutdb.config import ConfigError, Config, load_config

REPO_EXAMPLE = "examples/quickstart.yaml"


def _write(tmp_path, text, name="cfg.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_the_quickstart_config_is_valid_and_named_after_its_file():
    from pathlib import Path

    cfg = load_config(Path(__file__).resolve().parents[1] / REPO_EXAMPLE)
    assert cfg.run.name == "quickstart"
    assert cfg.ledger_dispatch


def test_a_misspelt_key_is_refused_naming_the_key_and_its_section(tmp_path):
    p = _write(tmp_path, "algorithm:\n  total_step: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'total_step' in section 'algorithm'"):
        load_config(p)


def test_an_unknown_section_is_refused_at_the_top_level(tmp_path):
    p = _write(tmp_path, "algorythm:\n  total_steps: 3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'algorythm' in section 'top level'"):
        load_config(p)


def test_dotted_overrides_apply_before_validation(tmp_path):
    p = _write(tmp_path, "algorithm:\n  total_steps: 3\n")
    cfg = load_config(p, ["algorithm.total_steps=7", 'generation.stop=["\\n"]', "run.name=x"])
    assert cfg.algorithm.total_steps == 7
    assert cfg.generation.stop == ["\n"]
    assert cfg.run.name == "x"


def test_an_override_of_an_unknown_key_is_refused_like_the_file(tmp_path):
    p = _write(tmp_path, "{}\n")
    with pytest.raises(ConfigError, match=r"unknown key 'nope' in section 'generation'"):
        load_config(p, ["generation.nope=1"])


def test_an_override_without_equals_sign_says_what_form_to_use(tmp_path):
    p = _write(tmp_path, "{}\n")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        load_config(p, ["algorithm.total_steps"])


@pytest.mark.parametrize("level", ["turn", "prefix"])
def test_turn_and_prefix_recovery_are_refused_until_they_land(tmp_path, level):
    p = _write(tmp_path, f"rollout_recovery:\n  target_level: {level}\n")
    with pytest.raises(ConfigError, match="not available yet"):
        load_config(p)


def test_a_value_out_of_range_names_the_dotted_key(tmp_path):
    p = _write(tmp_path, "algorithm:\n  group_size: 1\n")
    with pytest.raises(ConfigError, match=r"algorithm\.group_size"):
        load_config(p)


def test_min_tokens_above_max_tokens_is_refused(tmp_path):
    p = _write(tmp_path, "generation:\n  max_tokens: 2\n  min_tokens: 3\n")
    with pytest.raises(ConfigError, match="min_tokens"):
        load_config(p)


def test_the_fingerprint_changes_with_what_shapes_rollout_state_only():
    a, b = Config(), Config()
    b.logging.progress = False
    assert a.fingerprint() == b.fingerprint()
    b.algorithm.group_size = 4
    assert a.fingerprint() != b.fingerprint()


def test_the_train_command_prints_one_error_line_for_a_bad_config(tmp_path):
    p = _write(tmp_path, "algorithm:\n  total_step: 3\n")
    proc = subprocess.run(
        [sys.executable, "-m", "rolloutdb", "train", "--config", str(p), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "total_step" in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override", ["cluster.backend=ray", "generation.backend=vllm"])
def test_backends_that_have_not_landed_are_refused_with_what_to_use(tmp_path, override):
    p = _write(tmp_path, "{}\n")
    with pytest.raises(ConfigError, match="not available yet"):
        load_config(p, [override])


def test_every_config_key_is_explained_in_the_docs():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    for section, field in Config.model_fields.items():
        assert f"## `{section}`" in doc, section
        for key in field.annotation.model_fields:
            assert f"| `{key}` |" in doc, f"{section}.{key}"
