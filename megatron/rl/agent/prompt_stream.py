"""Deterministic, resumable, per-data-parallel-rank order in which an agent draws its prompts.

The global stream of a dataset of size ``N`` is epoch after epoch of a seeded permutation of ``range(N)``
(a fresh permutation per epoch); a generated, unbounded task (``N is None``) uses the indices
``0, 1, 2, ...`` directly. Data-parallel rank ``r`` of ``R`` takes global positions ``r, r + R, r + 2R, ...``,
so ranks draw disjoint prompts and together cover every prompt of an epoch exactly once (up to the last
``R - 1`` at an epoch boundary, which the next epoch continues through).

The only state is how many positions this rank has drawn; :meth:`PromptStream.state_dict` stores it as
the global number consumed, so a run resumed with a different DP size continues from the same place.
"""
from __future__ import annotations

import random
from typing import Any

__all__ = ["PromptStream"]

_MAX_CONSUMED = 2**53  # exact in float64 JSON readers; far beyond any real run


class PromptStream:
    """Yields dataset indices for one DP rank (see the module docstring).

    Args:
        size: dataset size, or None for a generated task whose problem ``i`` is built from ``i``.
        seed: shuffling seed (same on every rank).
        rank, world_size: this rank's data-parallel coordinates.
        shuffle: permute each epoch (finite datasets only).
    """

    def __init__(self, size: int | None, seed: int, rank: int = 0, world_size: int = 1, shuffle: bool = True):
        if size is not None and size <= 0:
            raise ValueError(f"PromptStream needs a non-empty dataset, got size={size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"data-parallel rank {rank} is outside world size {world_size}")
        self.size, self.seed, self.rank, self.world_size, self.shuffle = size, int(seed), rank, world_size, shuffle
        self.position = 0  # number of indices this rank has drawn
        self._perm_cache: tuple[int, list[int]] | None = None

    def _permutation(self, epoch: int) -> list[int]:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            order = list(range(self.size))
            if self.shuffle:
                # String seeds hash deterministically (sha512), unlike hash() of tuples across processes.
                random.Random(f"prompt-stream:{self.seed}:{epoch}").shuffle(order)
            self._perm_cache = (epoch, order)
        return self._perm_cache[1]

    def index_at(self, global_position: int) -> int:
        """Dataset index at a global stream position."""
        if self.size is None:
            return global_position
        epoch, offset = divmod(global_position, self.size)
        return self._permutation(epoch)[offset]

    def next(self) -> tuple[int, int]:
        """Return ``(dataset_index, global_position)`` of this rank's next prompt and advance."""
        global_position = self.position * self.world_size + self.rank
        self.position += 1
        return self.index_at(global_position), global_position

    def take(self, n: int) -> list[tuple[int, int]]:
        return [self.next() for _ in range(n)]

    def state_dict(self) -> dict[str, Any]:
        return {"consumed_global": self.position * self.world_size, "seed": self.seed, "size": self.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed") != self.seed or state.get("size") != self.size:
            raise ValueError(f"prompt stream state was saved with seed={state.get('seed')}, size={state.get('size')} "
                             f"but this agent has seed={self.seed}, size={self.size}; resume with the same seed "
                             "and dataset")
        consumed = state.get("consumed_global")
        # a state can come over HTTP (environment server): a negative or absurd position is refused, not used
        if not isinstance(consumed, int) or isinstance(consumed, bool) or not 0 <= consumed <= _MAX_CONSUMED:
            raise ValueError(f"prompt stream state: consumed_global must be an integer in 0..{_MAX_CONSUMED}, "
                             f"got {str(consumed)[:40]}")
        # ceil: never repeat a prompt another rank might already have drawn before the checkpoint.
        self.position = -(-consumed // self.world_size)
