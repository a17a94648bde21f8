"""torchrun --nproc-per-node 2: --rl-verify-model-weights-swap passes after a refit and fails loudly on a bad copy.

Train TP=2 -> copy TP=1 (tiny GPT, CPU fp32). After the refit the check passes; after perturbing one weight of
the copy (as a broken refit would leave it) it raises RefitVerificationError on every rank.
"""
from __future__ import annotations

import functools
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    from megatron.rl.layout.parity import RefitVerificationError, verify_weights_swap
    from megatron.rl.layout.refit import build_layout_inference
    from megatron.rl.rl_config import add_rl_args, rl_config_from_args
    from megatron.rl.rl_utils import StepContext, probe_logprob_gap
    from megatron.rl.training.config import parse_args
    from megatron.rl.training.initialize import destroy_megatron, initialize_megatron
    from megatron.rl.training.model_provider import build_model
    from megatron.rl.training.tokenizer import build_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        env = Path(tmp) / "env.yaml"
        env.write_text("environments: [{type: arithmetic, weight: 1}]\n")
        cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                          "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "4",
                          "--global-batch-size", "8", "--train-iters", "1", "--lr", "1e-3",
                          "--grpo-prompts-per-step", "2", "--grpo-group-size", "4", "--rl-max-new-tokens", "8",
                          "--tensor-model-parallel-size", "2", "--rl-inference-tensor-model-parallel-size", "1",
                          "--langrl-env-config", str(env)], extra_args_providers=[add_rl_args])
        rl = rl_config_from_args(cfg)
    runtime = initialize_megatron(cfg)
    tokenizer = build_tokenizer(cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model)
    model = build_model(cfg, tokenizer=tokenizer)
    inference = build_layout_inference(cfg, rl.inference_layout, model, tokenizer)
    ctx = StepContext(model=model, optimizer=None, scheduler=None, agent=None, inference=inference,
                      pad_token_id=tokenizer.pad, seq_length=cfg.model.seq_length,
                      micro_batch_size=cfg.train.micro_batch_size, global_batch_size=cfg.train.global_batch_size,
                      seed=cfg.train.seed, device=runtime.device)
    inference.refit_if_stale()
    trainer_gap = functools.partial(probe_logprob_gap, ctx, rl)
    gap = verify_weights_swap(inference, trainer_gap, rl.max_new_tokens, rl.temperature)
    assert gap < 1e-5, gap
    with torch.no_grad():  # what a refit that skipped one tensor on one rank would leave behind
        if dist.get_rank() == 1:
            weight = dict(inference.copy.model[0].named_parameters())["decoder.layers.1.mlp.linear_fc2.weight"]
            weight.add_(0.05 * torch.randn_like(weight))
    try:
        verify_weights_swap(inference, trainer_gap, rl.max_new_tokens, rl.temperature)
    except RefitVerificationError as e:
        assert "--rl-verify-model-weights-swap" in str(e), e
        print(f"rank {dist.get_rank()}: VERIFY OK (passed at {gap:.1e}, then caught the bad copy)", flush=True)
    else:
        raise AssertionError("a perturbed inference copy passed --rl-verify-model-weights-swap")
    inference.close()
    destroy_megatron()


if __name__ == "__main__":
    main()
