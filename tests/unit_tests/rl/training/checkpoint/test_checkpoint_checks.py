"""Load-time checks that turn silent wrong results / raw KeyErrors into named CheckpointErrors:
padded-vocab mismatch (TP / --make-vocab-size-divisible-by) and optimizer-format mismatch."""
from __future__ import annotations

import pytest

import ckpt_tiny_model as T
from megatron.rl.training.checkpoint.model_checks import divisible_by_for_padded_vocab
from megatron.rl.training.checkpoint.save_load import CheckpointError, load_checkpoint, save_checkpoint

ARCH = T.Arch(num_layers=2, hidden_size=32)
BASE_ARGS = {k: v for k, v in ARCH.model_args().items() if k != "vocab_size"}  # vocab is what we vary


@pytest.mark.parametrize("vocab,padded,tp,expect", [
    (259, 384, 1, 128), (259, 384, 2, 64), (259, 512, 2, 256), (259, 512, 1, 512), (259, 385, 2, None),
    (259, 256, 1, None), (300, 384, 3, 128)])
def test_divisible_by_for_padded_vocab(vocab, padded, tp, expect):
    got = divisible_by_for_padded_vocab(vocab, padded, tp)
    assert got == expect
    if got is not None:  # Megatron's rule reproduces the target
        assert -(-vocab // (got * tp)) * got * tp == padded


def _padding(vocab, div, tp):
    return {"vocab_size": vocab, "make_vocab_size_divisible_by": div, "tensor_model_parallel_size": tp}


def test_smaller_vocab_checkpoint_is_refused_before_loading(tmp_path, monkeypatch):
    T.init_single_process()
    T.set_layout()
    chunks, opt, sched = T.build(ARCH, distopt=False)
    args = {**BASE_ARGS, "padded_vocab_size": 128, "vocab_padding": _padding(100, 128, 1)}
    save_checkpoint(tmp_path / "a", 1, chunks, opt, sched, model_args=args)
    save_checkpoint(tmp_path / "old", 1, chunks, opt, sched, model_args=BASE_ARGS)  # no key: metadata
    monkeypatch.setattr(T, "VOCAB", 256)
    big, bopt, bsched = T.build(ARCH, distopt=False)
    before = big[0].module.embedding.word_embeddings.weight.detach().clone()
    now = {**BASE_ARGS, "padded_vocab_size": 256, "vocab_padding": _padding(100, 128, 2)}
    for d in ("a", "old"):
        with pytest.raises(CheckpointError, match=r"padded vocab 128.*this run pads to 256.*"
                                                  r"--make-vocab-size-divisible-by 64 to pad to 128 at TP=2"):
            load_checkpoint(tmp_path / d, big, bopt, bsched, model_args=now)
    assert big[0].module.embedding.word_embeddings.weight.equal(before)  # nothing was read
    # a different tokenizer gets no flag advice
    with pytest.raises(CheckpointError, match="tokenizer had 100 tokens"):
        load_checkpoint(tmp_path / "a", big, bopt, bsched,
                        model_args={**now, "vocab_padding": _padding(200, 128, 2)})
    # without model_args (callers that do not know the vocab) nothing changes; matching padding loads
    monkeypatch.setattr(T, "VOCAB", 128)
    same, sopt, ssched = T.build(ARCH, distopt=False)
    load_checkpoint(tmp_path / "a", same, sopt, ssched,
                    model_args={**BASE_ARGS, "padded_vocab_size": 128, "vocab_padding": _padding(100, 64, 2)})


@pytest.mark.parametrize("saved_dist", [False, True])
def test_optimizer_kind_mismatch_is_a_named_error(tmp_path, saved_dist):
    T.init_single_process()
    T.set_layout()
    chunks, opt, sched = T.build(ARCH, distopt=saved_dist)
    save_checkpoint(tmp_path, 1, chunks, opt, sched)
    other, oopt, osched = T.build(ARCH, distopt=not saved_dist)
    verb = "add" if saved_dist else "drop"
    with pytest.raises(CheckpointError, match=rf"{verb} --use-distributed-optimizer.*--no-load-optim"):
        load_checkpoint(tmp_path, other, oopt, osched)
    load_checkpoint(tmp_path, other, oopt, osched, load_optimizer=False)  # the suggested way out works
    for a, b in zip(chunks[0].parameters(), other[0].parameters()):
        assert a.equal(b)


def test_optimizer_load_failure_names_the_expert_parallel_change(tmp_path, monkeypatch):
    """megatron-core's ChainedOptimizer raises a bare RuntimeError when the EP size changed the number of
    sub-optimizers ("Expected 2 entries in state dict, but got 4"); the loader names the EP change."""
    import megatron.rl.training.checkpoint.save_load as ck

    T.init_single_process()
    T.set_layout()
    chunks, opt, sched = T.build(ARCH, distopt=False)
    save_checkpoint(tmp_path, 1, chunks, opt, sched)
    other, oopt, osched = T.build(ARCH, distopt=False)
    real_layout = ck.parallel_layout
    monkeypatch.setattr(ck, "parallel_layout", lambda: {**real_layout(), "ep": 2})

    def mcore_failure(state_dict):
        raise RuntimeError("Expected 2 entries in state dict, but got 4.")

    monkeypatch.setattr(oopt, "load_state_dict", mcore_failure)
    with pytest.raises(CheckpointError, match=r"expert-parallel size changed \(1 -> 2.*--no-load-optim"):
        load_checkpoint(tmp_path, other, oopt, osched)


@pytest.mark.slow  # ~25 s: a 2-process torchrun save, then two 1-process loads
@pytest.mark.multiprocess
def test_moe_optimizer_across_ep_change_real_run(tmp_path):
    """The real failure behind the test above: an EP=2 MoE checkpoint's plain-optimizer state loaded at EP=1."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT, run_torchrun

    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--mock-data",
             "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--disable-bias-linear",
             "--moe-token-dispatcher-type", "alltoall", "--log-interval", "1"]
    script = REPO_ROOT / "pretrain_gpt.py"
    run_torchrun(script, [*flags, "--train-iters", "1", "--expert-model-parallel-size", "2",
                          "--save", tmp_path / "ep2"])
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)

    def load(*extra):
        return subprocess.run([sys.executable, str(script), *flags, "--train-iters", "2", "--load",
                               str(tmp_path / "ep2"), *extra], cwd=REPO_ROOT, env=env, capture_output=True,
                              text=True, timeout=300)

    proc = load()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    assert "expert-parallel size changed (2 -> 1" in out and "--no-load-optim" in out, out[-4000:]
    proc = load("--no-load-optim")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
