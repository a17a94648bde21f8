"""The training step and pretraining driver in one process (gloo group of size 1)."""
from __future__ import annotations

import json

import pytest
import torch

from megatron.rl.training.config import parse_args
from megatron.rl.training.initialize import destroy_megatron, initialize_megatron, set_random_seeds
from megatron.rl.training.loop import (
    IterationStats, format_iteration_line, gpt_forward_step, pretrain, reduce_loss_dicts, train_step)

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--log-interval", "5"]


@pytest.fixture
def megatron_cleanup():
    yield
    destroy_megatron()


def _batches(n, mbs, seq, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        data = torch.randint(0, vocab, (mbs, seq + 1), generator=g)
        out.append({"tokens": data[:, :-1].contiguous(), "labels": data[:, 1:].contiguous(),
                    "loss_mask": torch.ones(mbs, seq), "position_ids": torch.arange(seq).expand(mbs, -1)})
    return out


def test_train_step_equals_full_batch_sgd(megatron_cleanup):
    """4 microbatches through the schedule + DDP + megatron SGD == one autograd step on the whole batch."""
    from megatron.rl.training.model_provider import build_model
    from megatron.rl.training.optimizer import build_optimizer

    lr = 0.5
    cfg = parse_args([*TINY, "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1",
                      "--optimizer", "sgd", "--sgd-momentum", "0", "--lr", str(lr), "--lr-decay-style", "constant",
                      "--weight-decay", "0", "--clip-grad", "0", "--vocab-size", "256", "--swiglu", "--normalization", "RMSNorm",
                      "--position-embedding-type", "rope"], world_size=1)
    initialize_megatron(cfg)
    set_random_seeds(cfg.train.seed)
    model = build_model(cfg)
    set_random_seeds(cfg.train.seed)
    reference = build_model(cfg, wrap_with_ddp=False)[0]
    before = {n: p.detach().clone() for n, p in reference.named_parameters()}
    for (n, p), (n2, p2) in zip(model[0].module.named_parameters(), reference.named_parameters()):
        assert n == n2 and torch.equal(p, p2), n  # same init
    optimizer, scheduler = build_optimizer(cfg, model)
    mbs = _batches(4, 2, 32, 256)

    losses, grad_norm, skipped = train_step(gpt_forward_step, iter(mbs), model, optimizer, scheduler,
                                            num_microbatches=4, seq_length=32, micro_batch_size=2)

    full = {k: torch.cat([b[k] for b in mbs]) for k in mbs[0]}
    per_token = reference(full["tokens"], full["position_ids"], None, labels=full["labels"])
    loss = per_token.float().mean()
    loss.backward()
    ref_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in reference.parameters())).item()
    assert not skipped
    assert abs(losses["lm loss"] - loss.item()) < 1e-6
    assert abs(grad_norm - ref_norm) < 1e-5 * max(1.0, ref_norm)
    for n, p in model[0].module.named_parameters():
        expected = before[n] - lr * dict(reference.named_parameters())[n].grad
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6, msg=n)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in model[0].module.named_parameters())


def test_reduce_loss_dicts_token_weighted_and_scalar_mean(megatron_cleanup):
    cfg = parse_args([*TINY, "--train-iters", "1", "--lr", "1e-3"], world_size=1)
    initialize_megatron(cfg)
    out = reduce_loss_dicts([{"lm loss": torch.tensor([6.0, 2.0]), "acc": torch.tensor(0.5)},
                             {"lm loss": torch.tensor([3.0, 4.0]), "acc": torch.tensor(1.0)}])
    assert out["lm loss"] == pytest.approx(9.0 / 6.0)  # not the mean of per-microbatch means (2.0)
    assert out["acc"] == pytest.approx(0.75)


def _write_corpus(path, n_docs=200):
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    with open(path, "w") as f:
        for i in range(n_docs):
            text = " ".join(words[(i + j) % len(words)] for j in range(12)) + "."
            f.write(json.dumps({"text": text}) + "\n")


@pytest.mark.parametrize("extra", [[], ["--bf16", "--use-distributed-optimizer"]], ids=["fp32", "bf16-distopt"])
def test_pretrain_loss_falls_and_resume_is_exact(tmp_path, megatron_cleanup, extra):
    corpus = tmp_path / "corpus.jsonl"
    _write_corpus(corpus)
    flags = [*TINY, *extra, "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "30", "--lr", "3e-3",
             "--lr-warmup-iters", "3", "--data-path", str(corpus), "--split", "100,0,0",
             "--data-cache-path", str(tmp_path / "cache"), "--swiglu", "--normalization", "RMSNorm",
             "--position-embedding-type", "rope", "--save", str(tmp_path / "ckpt"), "--save-interval", "25",
             "--tensorboard-dir", str(tmp_path / "tb")]
    full = pretrain(parse_args(flags, world_size=1))
    losses = [s.losses["lm loss"] for s in full.history]
    assert full.iteration == 30 and full.consumed_samples == 240
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5, losses  # byte-level text of 5 repeated words is easy
    assert (tmp_path / "ckpt" / "iter_0000025").is_dir() and (tmp_path / "ckpt" / "iter_0000030").is_dir()
    assert list((tmp_path / "tb").iterdir())  # event file written

    # resume from iteration 25 (weights, Adam, scheduler, data position): iterations 26..30 repeat exactly
    resumed = pretrain(parse_args([*flags, "--load", str(tmp_path / "ckpt" / "iter_0000025"),
                                   "--save", str(tmp_path / "ckpt2")], world_size=1))
    assert [s.iteration for s in resumed.history] == [26, 27, 28, 29, 30]
    assert [s.losses["lm loss"] for s in resumed.history] == losses[25:]
    assert [s.learning_rate for s in resumed.history] == [s.learning_rate for s in full.history[25:]]


def test_iteration_line_has_megatron_fields():
    stats = IterationStats(iteration=10, losses={"lm loss": 2.5}, grad_norm=1.25, learning_rate=3e-4,
                           skipped=False, elapsed_s=0.5, consumed_samples=80)
    line = format_iteration_line(stats, train_iters=100, global_batch_size=8, seq_length=32)
    for field in ("iteration       10/     100", "consumed samples:           80",
                  "elapsed time per iteration (ms): 500.0", "learning rate: 3.000000E-04", "lm loss: 2.500000E+00",
                  "grad norm: 1.250", "tokens/s: 512.0"):
        assert field in line, (field, line)
