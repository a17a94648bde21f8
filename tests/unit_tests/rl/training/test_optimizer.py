"""build_optimizer: torch's AdamW (megatron-core's fallback on CPU) runs its multi-tensor update, bit for bit."""
from __future__ import annotations

import pytest
import torch

from megatron.rl.training.config import parse_args
from megatron.rl.training.initialize import destroy_megatron, initialize_megatron, set_random_seeds
from megatron.rl.training.loop import gpt_forward_step, train_step

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--vocab-size", "128", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-2", "--lr-decay-style", "constant",
        "--weight-decay", "0.1", "--clip-grad", "1.0", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope"]


@pytest.fixture
def megatron_cleanup():
    yield
    destroy_megatron()


def _torch_optimizers(optimizer):
    return [inner.optimizer for inner in getattr(optimizer, "chained_optimizers", [optimizer])]


def _train(foreach: bool) -> list[torch.Tensor]:
    from megatron.rl.training.model_provider import build_model
    from megatron.rl.training.optimizer import build_optimizer

    cfg = parse_args(TINY, world_size=1)
    initialize_megatron(cfg)
    set_random_seeds(cfg.train.seed)
    model = build_model(cfg)
    optimizer, scheduler = build_optimizer(cfg, model)
    groups = [g for o in _torch_optimizers(optimizer) for g in o.param_groups]
    assert isinstance(_torch_optimizers(optimizer)[0], torch.optim.AdamW)
    assert all(g["foreach"] is True for g in groups)  # set by build_optimizer
    if not foreach:  # the per-tensor update torch picks on CPU by itself
        for g in groups:
            g["foreach"] = False
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        data = torch.randint(0, 128, (2, 2, 17), generator=g)  # 2 micro-batches of 2 rows
        mbs = [{"tokens": d[:, :-1].contiguous(), "labels": d[:, 1:].contiguous(), "loss_mask": torch.ones(2, 16),
                "position_ids": torch.arange(16).expand(2, -1)} for d in data]
        train_step(gpt_forward_step, iter(mbs), model, optimizer, scheduler, num_microbatches=2, seq_length=16,
                   micro_batch_size=2)
    params = [p.detach().clone() for p in model[0].parameters()]
    destroy_megatron()
    return params


def test_foreach_update_is_bit_identical_to_per_tensor(megatron_cleanup):
    per_tensor, multi_tensor = _train(foreach=False), _train(foreach=True)
    assert len(per_tensor) == len(multi_tensor) > 4
    for a, b in zip(per_tensor, multi_tensor):
        assert torch.equal(a, b)
