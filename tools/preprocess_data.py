"""Tokenize JSONL documents into a Megatron indexed dataset (``.bin`` + ``.idx``).

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus \\
        [--tokenizer-type ByteLevelTokenizer | --tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR] \\
        [--json-keys text] [--workers 4]

For each JSON key it writes ``<output-prefix>_<key>_document.bin/.idx`` (Megatron-LM's naming); train on it
with ``--data-path <output-prefix>_<key>_document``. Every document is ``tokenizer.tokenize(text)``
followed by ``eod`` (``--no-append-eod`` to omit it). Documents keep their input order whatever
``--workers`` is. Several ``--input`` files are concatenated in the given order. A bad line stops the tool
with its file and line number; outputs are written to temporary names and only renamed into place on
success, so a failed run never leaves a half-written dataset behind.
"""
from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
from typing import Iterator, List, Optional, Sequence, Tuple

if __package__ in (None, ""):
    # Allow `python tools/preprocess_data.py` from a checkout without an installed megatron-rl.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy  # noqa: E402

from megatron.rl.training.data_jsonl import JsonlFormatError, parse_jsonl_line, tokenize_document  # noqa: E402
from megatron.rl.training.tokenizer import (  # noqa: E402
    DEFAULT_TOKENIZER_TYPE,
    TokenizerError,
    build_tokenizer,
    known_tokenizer_types,
)

logger = logging.getLogger("preprocess_data")

# Per-worker state (set by _init_worker): each worker process builds its own tokenizer once.
_WORKER = {}


def _init_worker(tokenizer_type: str, tokenizer_model: Optional[str], keys: Sequence[str], append_eod: bool) -> None:
    _WORKER.update(tokenizer=build_tokenizer(tokenizer_type, tokenizer_model), keys=tuple(keys),
                   append_eod=append_eod)


def _encode_line(item: Tuple[str, int, str]) -> Tuple[int, Optional[List[List[int]]]]:
    """(path, line_no, line) -> (bytes of the line, one id list per key, or None for a blank line)."""
    path, line_no, line = item
    tok, out = _WORKER["tokenizer"], []
    for key in _WORKER["keys"]:
        text = parse_jsonl_line(line, key, path, line_no)
        if text is None:
            return len(line.encode("utf-8")), None
        out.append(tokenize_document(tok, text, _WORKER["append_eod"]))
    return len(line.encode("utf-8")), out


def _read_lines(paths: Sequence[str]) -> Iterator[Tuple[str, int, str]]:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, start=1):
                yield path, line_no, line


def output_prefix_for(output_prefix: str, key: str) -> str:
    """The dataset prefix written for ``key`` (what ``--data-path`` takes)."""
    return f"{output_prefix}_{key}_document"


def preprocess(inputs: Sequence[str], output_prefix: str, tokenizer_type: str = DEFAULT_TOKENIZER_TYPE,
               tokenizer_model: Optional[str] = None, json_keys: Sequence[str] = ("text",), workers: int = 1,
               append_eod: bool = True, progress: bool = True, chunksize: int = 64) -> List[str]:
    """Tokenize ``inputs`` (JSONL files) into one indexed dataset per key; return the written prefixes.

    Raises:
        FileNotFoundError: an input is missing.  JsonlFormatError: a bad line (file:line in the message).
        TokenizerError: unknown tokenizer type or unusable tokenizer directory.
    """
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    from tqdm import tqdm

    for path in inputs:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--input {path!r}: file not found")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model)  # fail fast, before starting workers
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)

    prefixes = [output_prefix_for(output_prefix, key) for key in json_keys]
    tmp_prefixes = [f"{p}.tmp{os.getpid()}" for p in prefixes]
    builders = [IndexedDatasetBuilder(p + ".bin", dtype=dtype) for p in tmp_prefixes]
    total_bytes = sum(os.path.getsize(p) for p in inputs)
    num_docs = num_tokens = 0
    ok = False
    try:
        init_args = (tokenizer_type, tokenizer_model, tuple(json_keys), append_eod)
        if workers == 1:
            _init_worker(*init_args)
            results = map(_encode_line, _read_lines(inputs))
            pool = None
        else:
            pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=init_args)
            results = pool.imap(_encode_line, _read_lines(inputs), chunksize=chunksize)  # imap keeps order
        try:
            with tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenizing", disable=not progress) as bar:
                for nbytes, docs in results:
                    bar.update(nbytes)
                    if docs is None:
                        continue
                    for builder, ids in zip(builders, docs):
                        builder.add_document(numpy.asarray(ids, dtype=numpy.int64), [len(ids)])
                    num_docs += 1
                    num_tokens += len(docs[0])
        finally:
            if pool is not None:
                pool.terminate()
        for builder, tmp in zip(builders, tmp_prefixes):
            builder.finalize(tmp + ".idx")
        for tmp, final in zip(tmp_prefixes, prefixes):
            os.replace(tmp + ".bin", final + ".bin")
            os.replace(tmp + ".idx", final + ".idx")
        ok = True
    finally:
        if not ok:
            for builder, tmp in zip(builders, tmp_prefixes):
                builder.data_file.close()
                for suffix in (".bin", ".idx"):
                    if os.path.exists(tmp + suffix):
                        os.remove(tmp + suffix)
    logger.info("wrote %d documents (%d tokens for key %r) to %s", num_docs, num_tokens, json_keys[0],
                ", ".join(p + ".{bin,idx}" for p in prefixes))
    return prefixes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="JSONL file(s), one document per line")
    p.add_argument("--output-prefix", required=True,
                   help="writes <output-prefix>_<key>_document.bin/.idx for each --json-keys key")
    p.add_argument("--tokenizer-type", default=DEFAULT_TOKENIZER_TYPE,
                   help=f"one of: {', '.join(known_tokenizer_types())}")
    p.add_argument("--tokenizer-model", default=None, help="local tokenizer directory (HuggingFaceTokenizer)")
    p.add_argument("--json-keys", nargs="+", default=["text"], help="JSON field(s) holding the text")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false",
                   help="do not append the eod id after each document")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="hide the progress bar")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        prefixes = preprocess(args.input, args.output_prefix, args.tokenizer_type, args.tokenizer_model,
                              args.json_keys, args.workers, args.append_eod, args.progress)
    except (FileNotFoundError, JsonlFormatError, TokenizerError, ValueError) as err:
        logger.error("%s", err)
        return 2
    for prefix in prefixes:
        logger.info("train with: --data-path %s", prefix)
    return 0


if __name__ == "__main__":
    sys.exit(main())
