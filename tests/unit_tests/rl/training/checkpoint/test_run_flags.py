"""Run flags recorded in checkpoints come back under --use-checkpoint-args: explicit flags win, stored files are
checked by content, flags a parser does not know are left out."""
from __future__ import annotations

import argparse
import logging

import pytest

from megatron.rl.base.errors import ConfigError
from megatron.rl.training.checkpoint.run_flags import file_sha256, record_run_flags, run_flags_argv


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--env-config", dest="env_config")
    p.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=64)
    p.add_argument("--packing", dest="packing", action="store_true")
    p.add_argument("--ks", dest="ks", type=int, nargs="+")
    return p


def test_record_makes_file_flags_absolute_and_hashes_them(tmp_path, monkeypatch):
    (tmp_path / "env.yaml").write_text("environments: []\n")
    monkeypatch.chdir(tmp_path)
    rec = record_run_flags({"env_config": "env.yaml", "ks": (1, 4), "missing": None}, files=["env_config", "missing"])
    assert rec["flags"] == {"env_config": str(tmp_path / "env.yaml"), "ks": [1, 4], "missing": None}
    assert rec["sha256"] == {"env_config": file_sha256(tmp_path / "env.yaml")}


def test_stored_flags_come_back_and_explicit_ones_win(tmp_path):
    env = tmp_path / "env.yaml"
    env.write_text("a\n")
    rec = record_run_flags({"env_config": str(env), "max_new_tokens": 8, "packing": True, "ks": [1, 2],
                            "unknown_to_this_parser": 3}, files=["env_config"])
    argv = run_flags_argv(rec, _parser(), explicit=set(), source="--load=RUN")
    assert argv == [["--env-config", str(env)], ["--max-new-tokens", "8"], ["--packing"], ["--ks", "1", "2"]]
    ns = _parser().parse_args([t for g in argv for t in g])
    assert (ns.max_new_tokens, ns.packing, ns.ks) == (8, True, [1, 2])
    # a flag on the command line is not added, whatever its value
    assert ["--max-new-tokens", "8"] not in run_flags_argv(rec, _parser(), {"max_new_tokens"}, "--load=RUN")
    assert run_flags_argv(None, _parser(), set(), "--load=RUN") == []


def test_missing_stored_file_is_a_config_error_naming_the_flag(tmp_path):
    env = tmp_path / "env.yaml"
    env.write_text("a\n")
    rec = record_run_flags({"env_config": str(env)}, files=["env_config"])
    env.unlink()
    with pytest.raises(ConfigError, match=r"--env-config=.*env.yaml, which no longer exists; pass --env-config"):
        run_flags_argv(rec, _parser(), set(), "--load=RUN")
    # given explicitly, the stored path is not looked at
    assert run_flags_argv(rec, _parser(), {"env_config"}, "--load=RUN") == []


def test_changed_stored_file_is_used_with_a_warning(tmp_path, caplog):
    env = tmp_path / "env.yaml"
    env.write_text("a\n")
    rec = record_run_flags({"env_config": str(env)}, files=["env_config"])
    with caplog.at_level(logging.WARNING):
        run_flags_argv(rec, _parser(), set(), "--load=RUN")
    assert not caplog.records
    env.write_text("b\n")
    with caplog.at_level(logging.WARNING):
        assert run_flags_argv(rec, _parser(), set(), "--load=RUN") == [["--env-config", str(env)]]
    assert "changed since the checkpoint in --load=RUN was saved" in caplog.text
