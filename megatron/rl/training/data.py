"""Pretraining data: micro-batches of token sequences for this data-parallel rank.

:func:`build_pretraining_data` reads ``--mock-data``, a JSONL file, a Megatron indexed dataset or a blend of
them through megatron-core's ``BlendedMegatronDatasetBuilder`` + ``GPTDataset``, so sampling, index caches and
sharding behave as in Megatron-LM; it yields ``{"tokens", "labels", "loss_mask", "position_ids"}`` micro-batches
([micro_batch_size, seq_length]) and counts ``consumed_samples`` for the checkpoint. Building is collective when
``torch.distributed`` is initialized: call it on every rank. It does no RL and compiles nothing at run time.
Sources, batch contents, sharding and caches: docs/pretraining_data.md.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any, Dict, Iterator, List, Optional, Protocol, Sequence

import numpy
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.utils import Split, get_blend_from_list

from megatron.rl.training.data_jsonl import iter_jsonl_texts, tokenize_document
from megatron.rl.base.errors import UserError

logger = logging.getLogger(__name__)

__all__ = [
    "DataError",
    "DataSourceConfig",
    "BATCH_KEYS",
    "RandomTokenDocuments",
    "InMemoryDocuments",
    "PretrainingGPTDataset",
    "MicroBatchIterator",
    "build_pretraining_dataset",
    "build_pretraining_data",
]

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
JSONL_SUFFIXES = (".jsonl", ".json")


class DataError(UserError, ValueError):
    """Bad data configuration or input (names the flag/field, the value, and what to do)."""


class DataSourceConfig(Protocol):
    """What :func:`build_pretraining_data` reads from the data config (TRAIN's ``DataConfig``).

    Required: ``data_path: list[str] | None``, ``mock_data: bool``, ``split: str`` (e.g. "969,30,1"),
    ``data_cache_path: str | None``. Optional (defaults in brackets): ``num_workers`` [0], ``json_key``
    ["text"], ``eod_mask_loss`` [False], ``reset_position_ids`` [False], ``reset_attention_mask`` [False],
    ``create_attention_mask`` [False].
    """

    data_path: Optional[List[str]]
    mock_data: bool
    split: str
    data_cache_path: Optional[str]


# --------------------------------------------------------------------------------------------------------
# Low-level datasets (documents of token ids) in the shape GPTDataset reads: ``sequence_lengths`` (int32
# array, one entry per document), ``get(doc, offset, length)``, ``__len__`` and ``path_prefix``.
# --------------------------------------------------------------------------------------------------------


class RandomTokenDocuments:
    """Deterministic random documents for ``--mock-data``.

    Document ``i`` has a length drawn from ``[2, max_document_length]`` and random ids in ``[0, vocab_size)``
    (avoiding ``eod`` and ``pad``) followed by ``eod``; everything is a pure function of ``(seed, i)``.
    """

    def __init__(self, vocab_size: int, eod: int, pad: int, seed: int, num_documents: int,
                 max_document_length: int) -> None:
        self.vocab_size, self.eod, self.pad, self.seed = vocab_size, eod, pad, seed
        self.path_prefix = None
        rng = numpy.random.default_rng([seed, 0x6D6F636B])  # "mock": separate stream from the shuffles
        self.sequence_lengths = rng.integers(2, max(2, max_document_length) + 1, size=num_documents,
                                             dtype=numpy.int32)
        # The ids a document may contain: everything except the two ids with special meaning.
        self._allowed = numpy.setdiff1d(numpy.arange(vocab_size, dtype=numpy.int64), [eod, pad])

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int) -> numpy.ndarray:
        n = int(self.sequence_lengths[idx])
        rng = numpy.random.default_rng([self.seed, int(idx) + 1])
        body = self._allowed[rng.integers(0, len(self._allowed), size=n - 1)]
        return numpy.concatenate([body, [self.eod]]).astype(numpy.int64)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        doc = self[idx]
        return doc[offset:] if length is None else doc[offset:offset + length]


class InMemoryDocuments:
    """Token ids of tokenized documents held in memory (one flat array plus document boundaries).

    Args:
        tokens: all documents' ids concatenated, 1-D.
        sequence_lengths: ids per document, 1-D int32, summing to ``len(tokens)``.
        path_prefix: where megatron-core puts its default index cache (``<path_prefix>/cache/``).
    """

    def __init__(self, tokens: numpy.ndarray, sequence_lengths: numpy.ndarray, path_prefix: Optional[str]) -> None:
        self.tokens = numpy.asarray(tokens, dtype=numpy.int64)
        self.sequence_lengths = numpy.asarray(sequence_lengths, dtype=numpy.int32)
        self._starts = numpy.concatenate([[0], numpy.cumsum(self.sequence_lengths, dtype=numpy.int64)])
        if self._starts[-1] != len(self.tokens):
            raise ValueError(f"sequence_lengths sum to {self._starts[-1]} but there are {len(self.tokens)} tokens")
        self.path_prefix = path_prefix

    @classmethod
    def from_jsonl(cls, path: str, tokenizer, key: str = "text") -> "InMemoryDocuments":
        """Tokenize every document of a JSONL file (``tokenize(text) + [eod]`` each)."""
        chunks, lengths = [], []
        for _, text in iter_jsonl_texts(path, key):
            ids = tokenize_document(tokenizer, text)
            chunks.append(numpy.asarray(ids, dtype=numpy.int64))
            lengths.append(len(ids))
        if not lengths:
            raise DataError(f"--data-path {path!r}: the JSONL file has no documents")
        logger.info("tokenized %s: %d documents, %d tokens", path, len(lengths), sum(lengths))
        return cls(numpy.concatenate(chunks), numpy.asarray(lengths), os.path.splitext(path)[0])

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        start, end = int(self._starts[idx]) + offset, int(self._starts[idx + 1])
        if length is not None:
            end = min(end, start + length)
        return self.tokens[start:end]


# --------------------------------------------------------------------------------------------------------
# megatron-core dataset classes
# --------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class PretrainingDatasetConfig(GPTDatasetConfig):
    """megatron-core's GPTDatasetConfig plus what our sources need."""

    source_fingerprint: str = ""
    """Size and mtime of every data file: part of the index-cache key, so changed data rebuilds the index."""

    json_key: str = "text"
    """The JSONL field holding the document text."""

    mock_num_documents: int = 4096
    """Documents in the ``--mock-data`` corpus (their lengths are random in [2, 2 * sequence_length])."""


class PretrainingGPTDataset(GPTDataset):
    """``GPTDataset`` whose low-level dataset is chosen by the path: None -> :class:`RandomTokenDocuments`
    (mock), ``*.jsonl``/``*.json`` -> :class:`InMemoryDocuments`, anything else -> ``IndexedDataset``."""

    @staticmethod
    def build_low_level_dataset(dataset_path: Optional[str], config: PretrainingDatasetConfig):
        if dataset_path is None:
            tok = config.tokenizer
            return RandomTokenDocuments(tok.vocab_size, tok.eod, tok.pad, config.random_seed,
                                        config.mock_num_documents, 2 * config.sequence_length)
        if dataset_path.endswith(JSONL_SUFFIXES):
            return InMemoryDocuments.from_jsonl(dataset_path, config.tokenizer, config.json_key)
        return GPTDataset.build_low_level_dataset(dataset_path, config)

    @staticmethod
    def _key_config_attributes() -> List[str]:
        return GPTDataset._key_config_attributes() + ["source_fingerprint", "json_key", "mock_num_documents"]

    def _get_num_epochs(self, num_tokens_per_epoch: int) -> int:
        # megatron-core loops forever adding epochs when a split has no tokens: fail with a clear message
        # when samples are wanted from it, else build it empty.
        if num_tokens_per_epoch == 0:
            if not self.num_samples:
                return 1
            raise DataError(
                f"the {self.index_split.name} split of {self.dataset_path or 'the mock data'} has no documents "
                f"(--split {self.config.split!r} over {len(self.dataset)} documents); give it a larger share "
                "or add data"
            )
        return super()._get_num_epochs(num_tokens_per_epoch)


# --------------------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------------------


def _source_files(prefix: str) -> List[str]:
    if prefix.endswith(JSONL_SUFFIXES):
        return [prefix]
    return [prefix + ".bin", prefix + ".idx"]


def _check_sources(prefixes: Sequence[str]) -> str:
    """Fail early (before any barrier or compute) on missing files; return the sources' fingerprint."""
    stats = []
    for prefix in prefixes:
        for path in _source_files(prefix):
            if not os.path.isfile(path):
                what = ("a JSONL file" if prefix.endswith(JSONL_SUFFIXES)
                        else "an indexed-dataset prefix (PREFIX.bin and PREFIX.idx must exist)")
                raise DataError(
                    f"--data-path {prefix!r}: {path} not found. Expected {what}; make .bin/.idx files with "
                    "`python tools/preprocess_data.py --input X.jsonl --output-prefix P`, or use --mock-data"
                )
            st = os.stat(path)
            stats.append([os.path.abspath(path), st.st_size, st.st_mtime_ns])
    return hashlib.sha1(json.dumps(stats).encode()).hexdigest()[:16]


def _blend(data_cfg: DataSourceConfig, mock: bool, num_samples: Optional[int]) -> tuple[Any, str]:
    """(megatron-core's blend of --data-path, the sources' fingerprint); (None, "") for --mock-data."""
    data_path = getattr(data_cfg, "data_path", None)
    if mock and data_path:
        raise DataError("--mock-data and --data-path were both given; choose one")
    if not mock and not data_path:
        raise DataError("no training data: pass --data-path (JSONL file or .bin/.idx prefix) or --mock-data")
    if mock:
        return None, ""
    blend = get_blend_from_list(list(data_path))
    fingerprint = _check_sources(blend[0])
    if blend[1] is not None and num_samples is None:
        raise DataError("a weighted --data-path blend needs num_samples (train_iters * global_batch_size)")
    return blend, fingerprint


def build_pretraining_dataset(data_cfg: DataSourceConfig, tokenizer, seq_length: int, seed: int,
                              num_samples: Optional[int], split: str = "train") -> torch.utils.data.Dataset:
    """Build one split of the pretraining dataset (megatron-core ``GPTDataset`` or ``BlendedDataset``).

    ``dataset[i]`` is a dict of 1-D tensors of length ``seq_length`` (see the module docstring).
    ``num_samples``: how many samples the run will draw (sizes epochs and blends); None = one pass over the
    data (not allowed for weighted blends). Collective when ``torch.distributed`` is initialized.
    """
    if split not in ("train", "valid", "test"):
        raise DataError(f"split must be 'train', 'valid' or 'test', got {split!r}")
    if seq_length < 1:
        raise DataError(f"--seq-length must be >= 1, got {seq_length}")
    mock = bool(getattr(data_cfg, "mock_data", False))
    blend, fingerprint = _blend(data_cfg, mock, num_samples)
    config = PretrainingDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=None if mock else data_cfg.split,
        path_to_cache=getattr(data_cfg, "data_cache_path", None),
        tokenizer=tokenizer,
        reset_position_ids=bool(getattr(data_cfg, "reset_position_ids", False)),
        reset_attention_mask=bool(getattr(data_cfg, "reset_attention_mask", False)),
        eod_mask_loss=bool(getattr(data_cfg, "eod_mask_loss", False)),
        create_attention_mask=bool(getattr(data_cfg, "create_attention_mask", False)),
        source_fingerprint=fingerprint,
        json_key=getattr(data_cfg, "json_key", None) or "text",
    )
    split_enum = Split[split]
    # Only the requested split is sized; megatron-core insists on sizes for every split of a weighted blend,
    # so the others get 0 there (built empty, cheaply).
    sizes: List[Optional[int]] = [0 if blend and blend[1] is not None else None] * len(Split)
    sizes[split_enum.value] = num_samples
    try:
        datasets = BlendedMegatronDatasetBuilder(PretrainingGPTDataset, sizes, lambda: True, config).build()
    except DataError:
        raise
    except Exception as err:
        # The builder wraps errors of the mock path; surface ours (they carry the actionable message).
        cause = err.__cause__
        if isinstance(cause, (DataError, ValueError)):
            raise cause from None
        raise
    dataset = datasets[split_enum.value]
    if dataset is None or len(dataset) == 0:
        raise DataError(
            f"the {split} split is empty (--split {config.split!r}, seq_length {seq_length}); give it a share "
            "of the data, add data, or pass num_samples so short corpora are repeated"
        )
    logger.info("%s data: %d samples of %d tokens", split, len(dataset), seq_length)
    return dataset


class MicroBatchIterator:
    """Infinite iterator over this DP rank's micro-batches (dicts of [micro_batch_size, seq_length] tensors).

    ``consumed_samples`` counts samples consumed by *all* DP ranks so far (Megatron's convention); store it in
    the checkpoint and pass it back to resume.
    """

    def __init__(self, dataset, micro_batch_size: int, dp_rank: int, dp_size: int, consumed_samples: int = 0,
                 num_workers: int = 0, keys: Sequence[str] = BATCH_KEYS) -> None:
        self.dataset = dataset
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.keys = tuple(keys)
        self.consumed_samples = consumed_samples
        self._loader = iter(torch.utils.data.DataLoader(
            dataset, batch_sampler=self._rank_indices(consumed_samples), num_workers=num_workers,
            collate_fn=self._collate, persistent_workers=False))

    def _rank_indices(self, start: int) -> Iterator[List[int]]:
        n, step = len(self.dataset), self.micro_batch_size * self.dp_size
        first = start + self.dp_rank * self.micro_batch_size
        while True:
            yield [(first + j) % n for j in range(self.micro_batch_size)]
            first += step

    def _collate(self, samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
        return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in self.keys}

    def __iter__(self) -> "MicroBatchIterator":
        return self

    def __next__(self) -> Dict[str, torch.Tensor]:
        batch = next(self._loader)
        self.consumed_samples += self.micro_batch_size * self.dp_size
        return batch

    def close(self) -> None:
        """Stop the loader's worker processes (also happens when the iterator is garbage-collected)."""
        loader, self._loader = self._loader, iter(())
        shutdown = getattr(loader, "_shutdown_workers", None)  # multi-process loader iterators only
        if shutdown is not None:
            shutdown()

    def state_dict(self) -> Dict[str, int]:
        """JSON-able position for the checkpoint's run_state."""
        return {"consumed_samples": self.consumed_samples}


def build_pretraining_data(data_cfg: DataSourceConfig, tokenizer, seq_length: int, micro_batch_size: int,
                           global_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                           consumed_samples: int = 0, num_samples: Optional[int] = None,
                           split: str = "train") -> MicroBatchIterator:
    """Micro-batch iterator for DP rank ``dp_rank`` of ``dp_size`` (see the module docstring).

    Args:
        data_cfg: the data section of the training config (:class:`DataSourceConfig`).
        tokenizer: a :class:`megatron.rl.training.tokenizer.Tokenizer`.
        seq_length: tokens per sample ``s``.
        micro_batch_size: samples per micro-batch on this rank ``b``.
        global_batch_size: samples per optimizer step over all ranks (must be a multiple of ``b * dp_size``).
        dp_rank, dp_size: this rank's data-parallel coordinates (TP/PP peers pass the same values and get
            the same batches).
        seed: seeds the shuffles (and the mock data): same seed, same stream.
        consumed_samples: global samples already consumed (resume point; a multiple of ``b * dp_size``).
        num_samples: total samples the run will draw (``train_iters * global_batch_size``); None = one pass.
        split: "train", "valid" or "test" (``--split`` shares).

    Returns:
        :class:`MicroBatchIterator` yielding ``{"tokens", "labels", "loss_mask", "position_ids"}`` (+
        ``"attention_mask"`` when ``create_attention_mask``), each ``[micro_batch_size, seq_length]``.
    """
    if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"need micro_batch_size >= 1 and 0 <= dp_rank < dp_size; got micro_batch_size="
                        f"{micro_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}")
    step = micro_batch_size * dp_size
    if global_batch_size % step:
        raise DataError(f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size "
                        f"{micro_batch_size} x data-parallel size {dp_size}")
    if consumed_samples < 0 or consumed_samples % step:
        raise DataError(f"consumed_samples {consumed_samples} must be a non-negative multiple of micro_batch_size "
                        f"x dp_size = {step} (resume from a checkpoint taken at an iteration boundary)")
    dataset = build_pretraining_dataset(data_cfg, tokenizer, seq_length, seed, num_samples, split)
    keys = BATCH_KEYS + (("attention_mask",) if getattr(data_cfg, "create_attention_mask", False) else ())
    return MicroBatchIterator(dataset, micro_batch_size, dp_rank, dp_size, consumed_samples,
                              int(getattr(data_cfg, "num_workers", 0) or 0), keys)

