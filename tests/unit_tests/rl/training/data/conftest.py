"""Fixtures for tokenizer/data tests: tiny Hugging Face tokenizers saved to tmp dirs (no downloads)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # data_test_utils

from data_test_utils import HF_CHAT_TEMPLATE, save_tiny_hf_tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def hf_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer with its own chat template and an extra generation eos id (<eot>, id 3)."""
    return save_tiny_hf_tokenizer(tmp_path_factory.mktemp("hf_tok"), HF_CHAT_TEMPLATE, generation_eos=[2, 3])


@pytest.fixture(scope="session")
def hf_tokenizer_dir_plain(tmp_path_factory) -> Path:
    """A tokenizer without chat template and without pad token."""
    return save_tiny_hf_tokenizer(tmp_path_factory.mktemp("hf_tok_plain"), pad=False)
