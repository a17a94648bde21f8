"""Cropped micro-batches (megatron.rl.packing.microbatches): the shape each one needs, and views into the batch."""
from __future__ import annotations

import pytest
import torch

from megatron.rl.packing.microbatches import get_microbatch_dataloader, microbatch_shape, shared_microbatch_shapes, token_slots
from megatron.rl.sequence_packing_utils import build_packed_batch, build_rank_batch, distribute_bins, plan_packing


def _batch(lengths, cap, max_per_bin, mbs):
    info = plan_packing(lengths, cap, max_per_bin)
    dist = distribute_bins(info.num_bins, 1, mbs)
    tokens = [list(range(1, n + 1)) for n in lengths]
    masks = [[0] + [1] * (n - 1) for n in lengths]
    per_token = {"old_logprobs": [torch.zeros(n - 1) for n in lengths]}
    return info, dist, build_packed_batch(info, dist.for_rank(0), tokens, masks, 0, per_token=per_token)


def test_shape_is_rows_to_the_last_real_bin_by_the_longest_row():
    info, dist, _ = _batch([5, 3, 7, 2], cap=16, max_per_bin=1, mbs=3)  # bins by FFD: 7, 5, 3, 2
    mbs = dist.assignment[0]
    assert [list(mb) for mb in mbs] == [[0, 1, 2], [3, None, None]]
    assert microbatch_shape(info, mbs[0]) == (3, 7)
    assert microbatch_shape(info, mbs[1]) == (1, 2)
    assert microbatch_shape(info, mbs[1], length_multiple=4) == (1, 4)
    assert microbatch_shape(info, (None, None)) == (1, 1)  # an all-padding micro-batch still runs
    assert token_slots(info, dist, dynamic_shapes=True) == 3 * 7 + 1 * 2
    assert token_slots(info, dist, dynamic_shapes=False) == 6 * 16


def test_cropped_microbatches_keep_every_real_token_and_write_through():
    lengths = [5, 3, 7, 2, 6]
    info, dist, batch = _batch(lengths, cap=16, max_per_bin=2, mbs=2)
    fixed = list(get_microbatch_dataloader(batch, 2))
    cropped = list(get_microbatch_dataloader(batch, 2, dynamic_shapes=True))
    assert sum(int((mb.seq_ids >= 0).sum()) for mb in cropped) == sum(lengths)
    for f, c in zip(fixed, cropped):
        rows, length = c.tokens.shape
        assert torch.equal(f.tokens[:rows, :length], c.tokens)
        assert not bool((f.seq_ids[:, length:] >= 0).any()) and not bool((f.seq_ids[rows:] >= 0).any())
        assert all(sum(seg) == length for seg in c.row_segments)  # attention segments cover the row
        assert torch.equal(c.attention_mask(), f.attention_mask()[:rows, :, :length, :length])
        c.values["old_logprobs"].fill_(1.0)  # a view: the scoring pass's writes land in the batch
    assert float(batch.values["old_logprobs"][batch.seq_ids >= 0].min()) == 1.0


def test_crop_refuses_to_cut_real_tokens():
    _, _, batch = _batch([5, 3], cap=8, max_per_bin=1, mbs=2)
    with pytest.raises(ValueError, match="cut real tokens"):
        batch.crop(2, 4)


def test_shared_shapes_are_equal_on_every_data_parallel_rank():
    # expert parallelism all-gathers tokens over data-parallel ranks: their micro-batch i needs one shape
    lengths = [9, 2, 7, 3, 5, 2]
    info = plan_packing(lengths, 16, 1)
    dist = distribute_bins(info.num_bins, 2, 2)
    tokens = [list(range(1, n + 1)) for n in lengths]
    masks = [[0] + [1] * (n - 1) for n in lengths]
    own = [[microbatch_shape(info, mb) for mb in rank] for rank in dist.assignment]
    assert own[0] != own[1]  # per-rank crops differ: the case that made gloo abort
    shared = shared_microbatch_shapes(info, dist)
    assert shared == [(max(a[0], b[0]), max(a[1], b[1])) for a, b in zip(*own)]
    seen = []
    for rank in range(2):
        batch = build_rank_batch(info, dist, rank, tokens, masks, 0)
        mbs = list(get_microbatch_dataloader(batch, 2, dynamic_shapes=True, shapes=shared))
        seen.append([tuple(mb.tokens.shape) for mb in mbs])
        assert sum(int((mb.seq_ids >= 0).sum()) for mb in mbs) == int((batch.seq_ids >= 0).sum())
    assert seen[0] == seen[1] == shared
    assert token_slots(info, dist, True, shared=True) == 2 * sum(r * n for r, n in shared)
    with pytest.raises(ValueError, match="micro-batch shapes"):
        get_microbatch_dataloader(batch, 2, dynamic_shapes=True, shapes=shared[:1])


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_sequence_never_spans_two_microbatches_or_ranks(dynamic):
    """Sequence-level losses (GSPO, sequence IS, rejection, the sequence aggregation) reduce per sequence inside
    one micro-batch: every sequence's tokens must all land in one micro-batch of one rank, whatever the packing."""
    import random

    rng = random.Random(4)
    for _ in range(30):
        lengths = [rng.randint(2, 14) for _ in range(rng.randint(1, 25))]
        info = plan_packing(lengths, 16, rng.randint(1, 6))
        dp, mbs = rng.randint(1, 3), rng.randint(1, 3)
        dist = distribute_bins(info.num_bins, dp, mbs)
        tokens = [list(range(1, n + 1)) for n in lengths]
        masks = [[0] + [1] * (n - 1) for n in lengths]
        owner: dict[int, tuple[int, int]] = {}
        for rank in range(dp):
            batch = build_rank_batch(info, dist, rank, tokens, masks, 0)
            for m, mb in enumerate(get_microbatch_dataloader(batch, mbs, dynamic_shapes=dynamic)):
                for sid in torch.unique(mb.seq_ids[mb.seq_ids >= 0]).tolist():
                    assert owner.setdefault(sid, (rank, m)) == (rank, m), (sid, owner[sid], (rank, m))
                    assert int((mb.seq_ids == sid).sum()) == lengths[sid]  # whole, not split across rows
        assert sorted(owner) == list(range(len(lengths)))
