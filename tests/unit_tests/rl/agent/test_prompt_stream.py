"""PromptStream: deterministic from the seed, disjoint across DP ranks, resumable (also across DP sizes)."""
import pytest

from megatron.rl.agent.prompt_stream import PromptStream


def _draw(stream, n):
    return [stream.next()[0] for _ in range(n)]


def test_same_seed_same_order_and_each_epoch_is_a_permutation():
    a, b = PromptStream(10, seed=3), PromptStream(10, seed=3)
    order = _draw(a, 30)
    assert order == _draw(b, 30)
    for epoch in range(3):
        assert sorted(order[epoch * 10:(epoch + 1) * 10]) == list(range(10))
    assert order[:10] != order[10:20]  # reshuffled per epoch
    assert _draw(PromptStream(10, seed=4), 10) != order[:10]


def test_ranks_are_disjoint_and_cover_the_epoch():
    world = 3
    streams = [PromptStream(12, seed=1, rank=r, world_size=world) for r in range(world)]
    draws = [_draw(s, 4) for s in streams]
    flat = [i for d in draws for i in d]
    assert sorted(flat) == list(range(12))
    # interleaving the ranks reproduces the single-rank global stream
    single = _draw(PromptStream(12, seed=1), 12)
    assert [draws[p % world][p // world] for p in range(12)] == single


def test_generated_task_indices():
    s = PromptStream(None, seed=0, rank=1, world_size=2)
    assert _draw(s, 3) == [1, 3, 5]


def test_resume_exactly_and_with_a_different_world_size():
    s = PromptStream(7, seed=5)
    _draw(s, 9)
    state = s.state_dict()
    rest = _draw(s, 5)
    r = PromptStream(7, seed=5)
    r.load_state_dict(state)
    assert _draw(r, 5) == rest
    # 2 ranks resuming a 1-rank run continue at the same global position, disjointly
    r0, r1 = PromptStream(7, seed=5, rank=0, world_size=2), PromptStream(7, seed=5, rank=1, world_size=2)
    for x in (r0, r1):
        x.load_state_dict(state)
    # 9 consumed: rounded up to a multiple of the new world size so no prompt repeats
    assert [r0.next()[1], r1.next()[1]] == [10, 11]
    with pytest.raises(ValueError, match="same seed"):
        PromptStream(7, seed=6).load_state_dict(state)
