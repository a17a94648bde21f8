"""Secret names, redaction, and secrets read from an environment variable or a file."""
from __future__ import annotations

import pytest

from megatron.rl.base.errors import ConfigError, RLError
from megatron.rl.base.secrets import REDACTED, is_secret_name, redact, resolve_secrets
from megatron.rl.inference.api import build_inference_interface


def test_secret_names():
    for name in ("api_key", "apiKey", "auth_token", "client_secret", "password", "X-Auth-Token", "key"):
        assert is_secret_name(name), name
    for name in ("max_tokens", "tokenizer", "base_url", "api_key_env", "api_key_file", "monkey", "keys_seen"):
        assert not is_secret_name(name), name


def test_redact_is_deep_and_leaves_the_rest():
    cfg = {"a": [{"api_key": "s1", "n": 1}], "max_tokens": 5, "token": None, "password": "p", "api_key_env": "V"}
    assert redact(cfg) == {"a": [{"api_key": REDACTED, "n": 1}], "max_tokens": 5, "token": None,
                           "password": REDACTED, "api_key_env": "V"}
    assert cfg["password"] == "p"  # a copy


def test_secret_from_env_and_file(tmp_path, monkeypatch):
    monkeypatch.setenv("JUDGE_KEY", "from-env")
    assert resolve_secrets({"api_key_env": "JUDGE_KEY", "model": "m"}) == {"api_key": "from-env", "model": "m"}
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert resolve_secrets({"api_key_file": str(f)}) == {"api_key": "from-file"}
    backend = build_inference_interface("openai", base_url="http://127.0.0.1:9/v1", api_key_env="JUDGE_KEY")
    assert backend.api_key == "from-env"


def test_secret_source_errors_name_the_key(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_SUCH_VAR_43", raising=False)
    with pytest.raises(ConfigError, match=r"api_key_env: environment variable \$NO_SUCH_VAR_43"):
        resolve_secrets({"api_key_env": "NO_SUCH_VAR_43"})
    with pytest.raises(ConfigError, match="api_key_file: cannot read"):
        resolve_secrets({"api_key_file": str(tmp_path / "missing")})
    with pytest.raises(RLError, match="api_key: given as api_key and api_key_env"):
        resolve_secrets({"api_key": "x", "api_key_env": "V"})
