"""split_evenly: an iteration's sequences split into optimizer steps."""
import pytest

from megatron.rl.packing.plan import split_evenly


@pytest.mark.parametrize("n,parts", [(10, 3), (3, 5), (0, 2), (16, 4), (7, 1)])
def test_split_evenly(n, parts):
    out = split_evenly(n, parts)
    assert len(out) == parts
    flat = [i for r in out for i in r]
    assert flat == list(range(n))
    sizes = [len(r) for r in out]
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


def test_split_evenly_bad_parts():
    with pytest.raises(ValueError, match="parts"):
        split_evenly(4, 0)
