"""Decode attention over the dense mirror must give the paged gather's results bit for bit, step after step, while
requests grow, finish, move between rows, arrive, are readmitted with recomputed tokens, and the mirror grows."""
import random

import pytest
import torch

from megatron.rl.runtime import decode_mirror
from megatron.rl.runtime import torch_attention as ta
from megatron.rl.runtime.decode_lengths import set_decode_lengths

HEADS, KV_HEADS, DIM, BLOCK, BLOCKS, LAYERS = 4, 2, 8, 4, 8192, 2


class _Owner:
    """Stands for the engine's context (the mirror holds it weakly)."""


class _PagedRequests:
    """Paged K/V caches of LAYERS layers that requests append to, one token per step, as the engine's would."""

    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)
        # unused slots hold NaN: a mirror slot copied from one, or read unmasked, would show in the result
        self.caches = [(torch.full((BLOCKS, BLOCK, KV_HEADS, DIM), float("nan")),
                        torch.full((BLOCKS, BLOCK, KV_HEADS, DIM), float("nan"))) for _ in range(LAYERS)]
        self.free = list(range(BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.blocks: dict[int, list[int]] = {}
        self.length: dict[int, int] = {}

    def admit(self, rid: int, prompt: int) -> None:
        self.blocks[rid], self.length[rid] = [], 0
        for _ in range(prompt):
            self.append(rid)

    def append(self, rid: int) -> None:
        n = self.length[rid]
        if n % BLOCK == 0:
            self.blocks[rid].append(self.free.pop())
        self._write(rid, n)
        self.length[rid] = n + 1

    def recompute(self, rid: int) -> None:
        """Readmission after an eviction: the same tokens computed again (other values, as another kernel's)."""
        for n in range(self.length[rid]):
            self._write(rid, n)

    def finish(self, rid: int) -> None:
        self.free.extend(self.blocks.pop(rid))
        del self.length[rid]

    def _write(self, rid: int, n: int) -> None:
        block, slot = self.blocks[rid][n // BLOCK], n % BLOCK
        for k, v in self.caches:
            k[block, slot] = torch.randn(KV_HEADS, DIM, generator=self.g)
            v[block, slot] = torch.randn(KV_HEADS, DIM, generator=self.g)

    def step_inputs(self, rows: list[int], padding: int = 0):
        lens = [self.length[r] for r in rows] + [0] * padding
        width = max(len(self.blocks[r]) for r in rows)
        table = torch.full((len(lens), width), -1, dtype=torch.int32)
        for i, r in enumerate(rows):
            table[i, :len(self.blocks[r])] = torch.tensor(self.blocks[r], dtype=torch.int32)
        return torch.tensor(lens, dtype=torch.int32), table


def _attend_both(paged: _PagedRequests, rows: list[int], owner, padding: int = 0):
    """Every layer's decode attention for batch ``rows``, over the mirror and by gathering."""
    lens, table = paged.step_inputs(rows, padding)
    q = torch.randn(len(rows) + padding, 1, HEADS, DIM, generator=paged.g)
    set_decode_lengths(lens, request_ids=list(rows), owner=owner)
    mirrored = [ta.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table) for k, v in paged.caches]
    set_decode_lengths(lens)  # no request ids: the gather
    gathered = [ta.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, block_table=table) for k, v in paged.caches]
    return mirrored, gathered


def _assert_same(mirrored, gathered, rows):
    for layer, (m, g) in enumerate(zip(mirrored, gathered)):
        assert not torch.isnan(g[:len(rows)]).any()
        assert torch.equal(m[:len(rows)], g[:len(rows)]), f"layer {layer}, rows {rows}"


@pytest.fixture(autouse=True)
def _fresh_mirror(monkeypatch):
    monkeypatch.setattr(ta, "MIRROR_MIN_ELEMENTS", 0)  # these batches are small: read the mirror at every size
    decode_mirror.release()
    yield
    decode_mirror.release()


@pytest.mark.parametrize("split_elements", [None, 64], ids=["one padded batch", "length groups"])
def test_mirrored_decode_steps_equal_the_gathered_ones_through_finishes_moves_arrivals_and_growth(
        split_elements, monkeypatch):
    if split_elements is not None:  # attending a group costs little: requests of far apart lengths split
        monkeypatch.setitem(ta._SPLIT_OVERHEAD_ELEMENTS, "cpu", split_elements)
    paged, owner = _PagedRequests(seed=0), _Owner()
    rows = list(range(6))
    for rid in rows:
        paged.admit(rid, prompt=3 + 2 * rid)
    next_id = len(rows)
    for step in range(40):
        if step in (5, 17, 30):  # the request in row 1 finishes; the last row's request moves into its place
            paged.finish(rows[1])
            rows[1] = rows.pop()
        if step in (8, 9, 25):  # a request arrives in a new last row
            paged.admit(next_id, prompt=120 if step == 8 else 2 + step % 5)  # one long, two short
            rows.append(next_id)
            next_id += 1
        if step == 12:  # rows swap places
            rows[0], rows[2] = rows[2], rows[0]
        for rid in rows:
            paged.append(rid)
        _assert_same(*_attend_both(paged, rows, owner), rows)
        if split_elements is not None and step == 20:
            lens, table = paged.step_inputs(rows)
            plan = ta._paged_decode_plan(lens, table, (len(rows), 1, HEADS, DIM), paged.caches[0][0].shape,
                                         mirrored=True)
            assert len(plan) > 1, lens  # groups copied out of the mirror
    mirror = decode_mirror.current()
    assert mirror is not None and len(mirror.layers) == LAYERS  # the mirror was used, one per layer
    assert max(paged.length[r] for r in rows) > decode_mirror.SLOT_MULTIPLE // 4  # and lengths grew past a few


def test_the_mirror_grows_to_more_rows_and_slots_than_it_was_made_for():
    paged, owner = _PagedRequests(seed=1), _Owner()
    rows = [0, 1]
    for rid in rows:
        paged.admit(rid, prompt=2)
    _assert_same(*_attend_both(paged, rows, owner), rows)
    first = next(iter(decode_mirror.current().layers.values())).keys.shape
    for rid in range(2, decode_mirror.ROW_MULTIPLE + 3):  # more rows than one allocation holds
        paged.admit(rid, prompt=1)
        rows.append(rid)
    paged.admit(1000, prompt=decode_mirror.SLOT_MULTIPLE + 5)  # more slots than one allocation holds
    rows[0] = 1000
    for rid in rows:
        paged.append(rid)
    _assert_same(*_attend_both(paged, rows, owner), rows)
    grown = next(iter(decode_mirror.current().layers.values())).keys.shape
    assert grown[0] > first[0] and grown[2] > first[2]


def test_a_readmitted_request_is_copied_afresh_once_forgotten():
    paged, owner = _PagedRequests(seed=2), _Owner()
    rows = [0, 1, 2]
    for rid in rows:
        paged.admit(rid, prompt=5)
    for _ in range(3):
        for rid in rows:
            paged.append(rid)
        _assert_same(*_attend_both(paged, rows, owner), rows)
    paged.recompute(1)  # evicted and prefilled again: same request, same row, other values in the cache
    decode_mirror.current().forget([1])
    for rid in rows:
        paged.append(rid)
    _assert_same(*_attend_both(paged, rows, owner), rows)


def test_without_forgetting_a_recomputed_request_the_mirror_would_be_stale():
    """The check above can fail: the mirror copies only new tokens of a request it already holds."""
    paged, owner = _PagedRequests(seed=3), _Owner()
    rows = [0, 1]
    for rid in rows:
        paged.admit(rid, prompt=5)
    paged.append(0), paged.append(1)
    _attend_both(paged, rows, owner)
    paged.recompute(1)
    paged.append(0), paged.append(1)
    mirrored, gathered = _attend_both(paged, rows, owner)
    assert torch.equal(mirrored[0][0], gathered[0][0]) and not torch.equal(mirrored[0][1], gathered[0][1])


def test_padding_rows_a_new_engine_and_a_mirror_larger_than_the_cache():
    paged, owner = _PagedRequests(seed=4), _Owner()
    rows = [0, 1, 2]
    for rid in rows:
        paged.admit(rid, prompt=4)
    _assert_same(*_attend_both(paged, rows, owner, padding=5), rows)  # decode buckets pad rows with length 0
    first = decode_mirror.current()
    _assert_same(*_attend_both(paged, rows, _Owner()), rows)  # another engine's context: a mirror of its own
    assert decode_mirror.current() is not first
    decode_mirror.release()
    # a batch whose mirror would be larger than a layer's paged cache: attention gathers, with the same results
    wide = [rows[0]] * (BLOCKS * BLOCK // decode_mirror.SLOT_MULTIPLE + 1)
    assert _attend_both(paged, wide, owner)[0][0].shape[0] == len(wide)
    _assert_same(*_attend_both(paged, wide, owner), wide)
    assert not decode_mirror.current().layers


def test_small_steps_gather_and_the_first_large_one_catches_the_mirror_up(monkeypatch):
    paged, owner = _PagedRequests(seed=5), _Owner()
    rows = [0, 1, 2, 3]
    for rid in rows:
        paged.admit(rid, prompt=6)
    # K of a step: 4 rows x longest x KV_HEADS x DIM elements; the mirror from 12 tokens on
    monkeypatch.setattr(ta, "MIRROR_MIN_ELEMENTS", 4 * 12 * KV_HEADS * DIM)
    copied = []
    plan = decode_mirror.DecodeMirror._plan

    def noting(self, *args):
        result = plan(self, *args)
        copied.append(0 if result.src is None else result.src.numel())
        return result

    monkeypatch.setattr(decode_mirror.DecodeMirror, "_plan", noting)
    for step in range(10):
        for rid in rows:
            paged.append(rid)
        _assert_same(*_attend_both(paged, rows, owner), rows)
        assert bool(copied) == (paged.length[0] >= 12)
    # the first mirrored step copied every token so far, the later ones one per request
    assert copied[0] == 4 * 12 * KV_HEADS and copied[-1] == 4 * KV_HEADS


@pytest.mark.parametrize("lens", [[2, 3] + [50] * 6, [4] * 3 + [100] * 5, [5, 60, 61, 62]])
def test_the_mirror_attends_the_groups_a_gather_would(lens, monkeypatch):
    """A softmax or product over another number of padded slots can round differently, so the mirror keeps the
    gather's groups, even where one padded batch read in place copies less."""
    monkeypatch.setitem(ta._SPLIT_OVERHEAD_ELEMENTS, "cpu", 16 * HEADS * DIM)
    paged = _PagedRequests(seed=6)
    for rid, n in enumerate(lens):
        paged.admit(rid, prompt=n)
    lengths, table = paged.step_inputs(list(range(len(lens))))
    set_decode_lengths(lengths, request_ids=list(range(len(lens))), owner=_Owner())
    plans = [ta._paged_decode_plan(lengths, table, (len(lens), 1, HEADS, DIM), paged.caches[0][0].shape,
                                   mirrored=mirrored) for mirrored in (True, False)]
    groups = [[None if part.rows is None else part.rows.tolist() for part in plan] for plan in plans]
    assert len(groups[1]) > 1 and groups[0] == groups[1]
    assert [part.max_len for part in plans[0]] == [part.max_len for part in plans[1]]


def test_the_mirror_threshold_is_the_one_measured_on_each_instruction_set():
    assert ta.mirror_min_elements("AVX2") == 1 << 18
    assert ta.mirror_min_elements("AVX512") == ta.mirror_min_elements("DEFAULT") == 1 << 20
