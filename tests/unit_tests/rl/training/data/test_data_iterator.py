"""Pretraining data iterator: shapes, next-token labels, loss mask, DP sharding, determinism, resume,
JSONL / indexed-dataset / mock sources, blends and bad input."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy
import pytest
import torch

from data_test_utils import write_jsonl
from megatron.rl.training.data import DataError, build_pretraining_data
from megatron.rl.training.data_jsonl import JsonlFormatError
from megatron.rl.training.tokenizer import ByteLevelTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[5] / "tools"))
import preprocess_data  # noqa: E402

TOK = ByteLevelTokenizer()
SEQ = 16
TEXTS = [f"document number {i}: " + "abcdefghij"[i % 10] * (5 + 7 * (i % 5)) + " é" for i in range(40)]


def cfg(**kw):
    base = dict(data_path=None, mock_data=False, split="969,30,1", data_cache_path=None, num_workers=0)
    base.update(kw)
    return SimpleNamespace(**base)


def mock_iter(mbs=2, gbs=8, dp_rank=0, dp_size=1, seed=1234, consumed=0, **kw):
    return build_pretraining_data(cfg(mock_data=True, **kw), TOK, SEQ, mbs, gbs, dp_rank, dp_size, seed,
                                  consumed_samples=consumed, num_samples=256)


def take(it, n):
    return [next(it) for _ in range(n)]


def rows(batches):
    """Every sample as a tuple of its tokens plus final label (the full seq+1 window)."""
    return [tuple(t.tolist()) + (l[-1].item(),) for b in batches for t, l in zip(b["tokens"], b["labels"])]


def test_mock_batch_shapes_labels_and_masks():
    it = mock_iter(mbs=3, gbs=6)
    for batch in take(it, 4):
        assert set(batch) == {"tokens", "labels", "loss_mask", "position_ids"}
        assert batch["tokens"].shape == batch["labels"].shape == batch["loss_mask"].shape == (3, SEQ)
        assert batch["tokens"].dtype == batch["labels"].dtype == batch["position_ids"].dtype == torch.int64
        assert batch["loss_mask"].dtype == torch.float32
        assert torch.equal(batch["labels"][:, :-1], batch["tokens"][:, 1:])  # next-token labels
        assert torch.equal(batch["position_ids"], torch.arange(SEQ).expand(3, SEQ))
        assert torch.all(batch["loss_mask"] == 1)
        assert batch["tokens"].min() >= 0 and batch["tokens"].max() < TOK.vocab_size
        assert not torch.any(batch["tokens"] == TOK.pad)
    assert it.consumed_samples == 12 and it.state_dict() == {"consumed_samples": 12}
    # Documents end in eod, so windows over several documents contain it.
    assert any(torch.any(b["tokens"] == TOK.eod) for b in take(it, 8))


def test_mock_is_deterministic_given_seed():
    a, b, c = rows(take(mock_iter(), 4)), rows(take(mock_iter(), 4)), rows(take(mock_iter(seed=7), 4))
    assert a == b and a != c


def test_dp_sharding_disjoint_covering_and_in_megatron_order():
    steps, mbs, dp = 5, 2, 2
    per_rank = [take(mock_iter(mbs=mbs, gbs=4, dp_rank=r, dp_size=dp), steps) for r in range(dp)]
    single = rows(take(mock_iter(mbs=mbs * dp, gbs=4), steps))  # DP=1 reading the same global samples
    rank_rows = [rows(batches) for batches in per_rank]
    assert not set(rank_rows[0]) & set(rank_rows[1])
    assert sorted(rank_rows[0] + rank_rows[1]) == sorted(single)
    # Megatron's order: step k, rank r holds global samples k*mbs*dp + r*mbs + [0, mbs).
    dataset = mock_iter().dataset
    for r in range(dp):
        for k, batch in enumerate(per_rank[r]):
            for j in range(mbs):
                assert torch.equal(batch["tokens"][j], dataset[k * mbs * dp + r * mbs + j]["tokens"])


def test_resume_from_consumed_samples_matches_uninterrupted():
    full = mock_iter(mbs=2, gbs=8, dp_rank=1, dp_size=2)
    uninterrupted = take(full, 10)
    consumed = 8 * 2  # two global batches (each = 2 micro-batch steps of mbs*dp = 4 samples)
    resumed = mock_iter(mbs=2, gbs=8, dp_rank=1, dp_size=2, consumed=consumed)
    assert resumed.consumed_samples == consumed
    for expected, got in zip(uninterrupted[4:], take(resumed, 6)):
        assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert resumed.consumed_samples == full.consumed_samples == 40


def test_wraps_around_after_num_samples():
    it = mock_iter(mbs=1, gbs=1)
    n = len(it.dataset)
    assert n >= 256  # at least num_samples
    stream = rows(take(it, n + 2))
    assert stream[n:] == stream[:2] and len(set(stream[:n])) == n  # sample n wraps to sample 0


def test_num_workers_give_same_batches():
    a = take(mock_iter(num_workers=0), 5)
    it = mock_iter(num_workers=2)
    b = take(it, 5)
    it.close()
    assert rows(a) == rows(b)
    with pytest.raises(StopIteration):
        next(it)


def test_eod_mask_loss_and_attention_mask_options():
    batch = take(mock_iter(eod_mask_loss=True, create_attention_mask=True, mbs=4, gbs=4), 4)[-1]
    assert torch.equal(batch["loss_mask"] == 0, batch["tokens"] == TOK.eod)
    assert batch["attention_mask"].shape == (4, 1, SEQ, SEQ)
    assert torch.equal(batch["attention_mask"][0, 0], torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1))


def test_jsonl_windows_are_the_tokenized_corpus(tmp_path):
    src = write_jsonl(tmp_path / "corpus.jsonl", TEXTS)
    it = build_pretraining_data(cfg(data_path=[str(src)], split="100,0,0"), TOK, SEQ, 2, 2, 0, 1, 5)
    dataset = it.dataset
    docs = [TOK.tokenize(t) + [TOK.eod] for t in TEXTS]
    stream = numpy.concatenate([docs[d] for d in dataset.document_index])  # documents in shuffled order
    windows = [tuple(stream[i * SEQ: i * SEQ + SEQ + 1].tolist()) for i in range(len(dataset))]
    n = 2 * (len(dataset) // 2)
    assert n >= 20
    # Sample j is window shuffle_index[j] of the document stream (seq + 1 tokens, consecutive windows
    # overlapping by one token).
    assert rows(take(it, n // 2)) == [windows[dataset.shuffle_index[j]] for j in range(n)]
    # The default cache location mirrors megatron-core's <prefix>/cache/ next to the data.
    assert list((tmp_path / "corpus" / "cache").rglob("*shuffle_index.npy"))


def test_indexed_dataset_gives_same_batches_as_jsonl(tmp_path):
    src = write_jsonl(tmp_path / "corpus.jsonl", TEXTS)
    (prefix,) = preprocess_data.preprocess([str(src)], str(tmp_path / "bin" / "corpus"), progress=False)
    kw = dict(seq_length=SEQ, micro_batch_size=2, global_batch_size=4, dp_rank=1, dp_size=2, seed=3,
              num_samples=200)
    from_jsonl = build_pretraining_data(cfg(data_path=[str(src)]), TOK, **kw)
    from_bin = build_pretraining_data(cfg(data_path=[prefix]), TOK, **kw)
    a, b = take(from_jsonl, 30), take(from_bin, 30)  # 30 steps x 4 samples > one epoch: crosses epochs
    assert rows(a) == rows(b)
    assert len(set(rows(a))) > 20


def test_weighted_blend_draws_from_both_sources(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ["a" * 50] * 20)
    b = write_jsonl(tmp_path / "b.jsonl", ["b" * 50] * 20)
    it = build_pretraining_data(cfg(data_path=["0.5", str(a), "0.5", str(b)], split="100,0,0"), TOK, SEQ, 4, 4,
                                0, 1, 1, num_samples=40)
    tokens = torch.cat([x["tokens"] for x in take(it, 10)])
    from_a = (tokens == ord("a")).any(dim=1).sum().item()
    from_b = (tokens == ord("b")).any(dim=1).sum().item()
    assert from_a >= 10 and from_b >= 10 and set(it.state_dict()) == {"consumed_samples"}


def test_cache_key_changes_when_data_changes(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", TEXTS)
    cache = tmp_path / "cache"
    data_cfg = cfg(data_path=[str(src)], data_cache_path=str(cache))
    first = rows(take(build_pretraining_data(data_cfg, TOK, SEQ, 2, 2, 0, 1, 0), 3))
    n_cached = len(list(cache.glob("*description.txt")))
    assert n_cached >= 1
    again = rows(take(build_pretraining_data(data_cfg, TOK, SEQ, 2, 2, 0, 1, 0), 3))  # cache hit
    assert again == first and len(list(cache.glob("*description.txt"))) == n_cached
    write_jsonl(src, [t.upper() for t in TEXTS])
    os.utime(src, ns=(1, 1))  # a different mtime even on coarse-clock file systems
    changed = rows(take(build_pretraining_data(data_cfg, TOK, SEQ, 2, 2, 0, 1, 0), 3))
    assert len(list(cache.glob("*description.txt"))) > n_cached
    lowercase = set(range(ord("a"), ord("z") + 1))
    assert all(set(r) & lowercase for r in first) and not any(set(r) & lowercase for r in changed)


# ---------------------------------------------------------------- bad input


def test_missing_data_paths_are_named(tmp_path):
    with pytest.raises(DataError, match=r"--data-path '.*nope\.jsonl'.*not found.*preprocess_data\.py"):
        build_pretraining_data(cfg(data_path=[str(tmp_path / "nope.jsonl")]), TOK, SEQ, 1, 1, 0, 1, 0)
    with pytest.raises(DataError, match=r"--data-path '.*prefix'.*prefix\.bin not found.*PREFIX\.bin and PREFIX\.idx"):
        build_pretraining_data(cfg(data_path=[str(tmp_path / "prefix")]), TOK, SEQ, 1, 1, 0, 1, 0)
    with pytest.raises(DataError, match="pass --data-path .* or --mock-data"):
        build_pretraining_data(cfg(), TOK, SEQ, 1, 1, 0, 1, 0)
    with pytest.raises(DataError, match="both given"):
        build_pretraining_data(cfg(mock_data=True, data_path=["x"]), TOK, SEQ, 1, 1, 0, 1, 0)


def test_jsonl_line_without_text_key_names_file_and_line(tmp_path):
    src = tmp_path / "broken.jsonl"
    src.write_text('{"text": "ok"}\n\n{"content": "no text key"}\n')
    with pytest.raises(JsonlFormatError, match=r"broken\.jsonl:3: no 'text' field"):
        build_pretraining_data(cfg(data_path=[str(src)]), TOK, SEQ, 1, 1, 0, 1, 0)
    # json_key selects another field.
    src.write_text('{"content": "' + "x" * 100 + '"}\n')
    it = build_pretraining_data(cfg(data_path=[str(src)], json_key="content", split="1"), TOK, SEQ, 1, 1, 0, 1, 0)
    assert set(next(it)["tokens"][0].tolist()) <= {ord("x"), TOK.eod}


def test_batch_geometry_errors():
    with pytest.raises(DataError, match="--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2"):
        mock_iter(mbs=2, gbs=6, dp_size=2)
    with pytest.raises(DataError, match="consumed_samples 3 must be a non-negative multiple"):
        mock_iter(mbs=2, gbs=4, consumed=3)
    with pytest.raises(DataError, match="dp_rank"):
        mock_iter(dp_rank=2, dp_size=2)


def test_empty_split_is_an_error(tmp_path):
    src = write_jsonl(tmp_path / "few.jsonl", TEXTS[:3])
    with pytest.raises(DataError, match="valid split .* has no documents"):
        build_pretraining_data(cfg(data_path=[str(src)], split="98,1,1"), TOK, SEQ, 1, 1, 0, 1, 0,
                               num_samples=10, split="valid")
    with pytest.raises(DataError, match="split is empty"):
        build_pretraining_data(cfg(data_path=[str(src)], split="100,0,0"), TOK, SEQ, 1, 1, 0, 1, 0, split="test")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_rank_build_is_collective_and_sharded(tmp_path, torchrun):
    src = write_jsonl(tmp_path / "corpus.jsonl", TEXTS)
    script = Path(__file__).parent / "scripts" / "data_dp_sharding.py"
    proc = torchrun(script, [src, tmp_path / "cache"])
    assert "DP_SHARDING_OK" in proc.stdout
    assert list((tmp_path / "cache").glob("*shuffle_index.npy"))  # built once by rank 0, loaded by rank 1
