"""concat_ranges equals the ranges made one by one."""
import torch

from megatron.rl.runtime.ranges import concat_ranges


def test_concat_ranges_equals_one_arange_per_range():
    starts, ends = [0, 5, 3, 7, 2], [4, 5, 9, 8, 3]  # an empty range in the middle
    owner, value = concat_ranges(starts, ends)
    assert value.tolist() == torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)]).tolist()
    assert owner.tolist() == [i for i, (s, e) in enumerate(zip(starts, ends)) for _ in range(s, e)]
    assert owner.dtype == value.dtype == torch.int64
    empty_owner, empty_value = concat_ranges([], [])
    assert empty_owner.numel() == empty_value.numel() == 0
