"""tools/preprocess_data.py: JSONL -> .bin/.idx, read back equal to the tokenizer's output."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy
import pytest

from data_test_utils import write_jsonl
from megatron.rl.training.data_jsonl import JsonlFormatError
from megatron.rl.training.tokenizer import build_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(REPO_ROOT / "tools"))

import preprocess_data  # noqa: E402

DOCS = ["Hello world!", "Grüße aus Köln 🚀", "", "a" * 300, "line\nbreak"]


def _read_back(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    assert ds.document_indices.tolist() == list(range(len(ds) + 1))  # one sequence per document
    return [numpy.asarray(ds[i]).tolist() for i in range(len(ds))]


@pytest.mark.parametrize("tokenizer_kind", ["byte", "hf"])
def test_preprocess_roundtrip_equals_tokenizer(tmp_path, tokenizer_kind, hf_tokenizer_dir):
    ttype, tmodel = (("ByteLevelTokenizer", None) if tokenizer_kind == "byte"
                     else ("HuggingFaceTokenizer", str(hf_tokenizer_dir)))
    tok = build_tokenizer(ttype, tmodel)
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    # A blank line in the middle is skipped, not an error.
    src.write_text(src.read_text().replace("\n", "\n\n", 1))
    (prefix,) = preprocess_data.preprocess([str(src)], str(tmp_path / "out" / "corpus"), ttype, tmodel,
                                           progress=False)
    assert prefix == str(tmp_path / "out" / "corpus") + "_text_document"
    assert _read_back(prefix) == [tok.tokenize(d) + [tok.eod] for d in DOCS]
    dtype = numpy.uint16  # vocab < 65500: Megatron's optimal dtype
    assert Path(prefix + ".bin").stat().st_size == sum(len(tok.tokenize(d)) + 1 for d in DOCS) * numpy.dtype(dtype).itemsize
    assert not list((tmp_path / "out").glob("*.tmp*"))


def test_preprocess_workers_match_single_process_and_keys(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", [f"doc {i} " + "é" * (i % 7) for i in range(200)])
    src2 = write_jsonl(tmp_path / "b.jsonl", ["second file"])
    (p1,) = preprocess_data.preprocess([str(src), str(src2)], str(tmp_path / "one"), progress=False)
    rc = preprocess_data.main(["--input", str(src), str(src2), "--output-prefix", str(tmp_path / "many"),
                               "--workers", "2", "--no-progress"])
    assert rc == 0
    p2 = preprocess_data.output_prefix_for(str(tmp_path / "many"), "text")
    assert Path(p1 + ".bin").read_bytes() == Path(p2 + ".bin").read_bytes()
    assert Path(p1 + ".idx").read_bytes() == Path(p2 + ".idx").read_bytes()
    docs = _read_back(p2)
    assert len(docs) == 201 and docs[-1] == list(b"second file") + [256]
    # --json-keys picks another field; --no-append-eod omits eod.
    other = tmp_path / "other.jsonl"
    other.write_text('{"body": "xyz", "text": "ignored"}\n')
    assert preprocess_data.main(["--input", str(other), "--output-prefix", str(tmp_path / "o"), "--json-keys",
                                 "body", "--no-append-eod", "--no-progress"]) == 0
    assert _read_back(str(tmp_path / "o_body_document")) == [list(b"xyz")]


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_bad_line_names_file_and_line(tmp_path, workers):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    with pytest.raises(JsonlFormatError, match=r"bad\.jsonl:2: no 'text' field \(fields present: \['txt'\]\)"):
        preprocess_data.preprocess([str(src)], str(tmp_path / "x"), workers=workers, progress=False)
    assert list(tmp_path.iterdir()) == [src]  # nothing half-written
    src.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(JsonlFormatError, match=r"bad\.jsonl:2: not valid JSON"):
        preprocess_data.preprocess([str(src)], str(tmp_path / "x"), workers=workers, progress=False)


def test_preprocess_cli_errors(tmp_path, caplog):
    src = write_jsonl(tmp_path / "a.jsonl", ["x"])
    with caplog.at_level(logging.ERROR, logger="preprocess_data"):
        assert preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "o"),
                                     "--tokenizer-type", "Nope"]) == 2
        assert preprocess_data.main(["--input", str(tmp_path / "missing.jsonl"),
                                     "--output-prefix", str(tmp_path / "o")]) == 2
        assert preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "o"),
                                     "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                     str(tmp_path / "no_tok")]) == 2
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert "known types: ByteLevelTokenizer, HuggingFaceTokenizer" in messages
    assert "missing.jsonl': file not found" in messages
    assert "directory not found" in messages
    assert not list(tmp_path.glob("o*"))
