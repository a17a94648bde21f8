"""megatron-core schedule + DDP with global normalisers: DP ranks x packed micro-batches == one full batch.

Run with torchrun (any number of processes). Each rank packs its share of the sequences (round-robin
bins, one bin per micro-batch), runs ``get_forward_backward_func`` with
``calculate_per_token_loss=True`` and a loss function returning
``(aggregate_loss(...), torch.tensor(0), report)``, so the all-reduced gradient must equal the
gradient of the global loss computed on one process over unpacked sequences. Prints one
``RESULT {mode: {...}}`` line on rank 0 (modes: comma-separated argument).
"""
import json
import sys

import torch

from megatron.rl.runtime import setup_runtime


def build(per_token: bool, ddp: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                            params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                            bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                            masked_softmax_fusion=False, gradient_accumulation_fusion=False,
                            calculate_per_token_loss=per_token)
    cfg.finalize_model_grads_func = finalize_model_grads
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=32,
                     max_sequence_length=16, position_embedding_type="rope")
    if ddp:
        return DistributedDataParallel(cfg, DistributedDataParallelConfig(), model)
    return model


def main(modes: list[str]):
    setup_runtime()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.rl.algorithms import (LossNormalizers, PolicyLossConfig, aggregate_loss, compute_token_loss,
                                        token_logprobs)
    from megatron.rl.packing.microbatches import get_microbatch_dataloader
    from megatron.rl.sequence_packing_utils import build_packed_batch, build_rank_batch, distribute_bins, plan_packing

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    rank, world = dist.get_rank(), dist.get_world_size()

    g = torch.Generator().manual_seed(3)
    lengths = [int(x) for x in torch.randint(3, 12, (10,), generator=g)]
    prompts = [int(torch.randint(1, n - 1, (1,), generator=g)) for n in lengths]
    tokens = [torch.randint(1, 32, (n,), generator=g).tolist() for n in lengths]
    masks = [[0] * p + [1] * (n - p) for p, n in zip(prompts, lengths)]
    adv = torch.randn(len(lengths), generator=g)
    old = [torch.randn(n - 1, generator=g) * 0.1 - 3.4 for n in lengths]
    cfg = PolicyLossConfig(eps_lower=0.2, eps_upper=0.28, kl_beta=0.0)
    loss_tokens = sum(n - p for n, p in zip(lengths, prompts))
    norm = LossNormalizers(num_tokens=loss_tokens, num_sequences=len(lengths), max_len=16)

    results = {}
    for mode in modes:
        def micro_loss(logits, mb, mode=mode):
            lp = token_logprobs(logits, mb.labels)
            tok, _ = compute_token_loss(cfg, lp, mb.values["old"], mb.values["adv"], mb.loss_mask)
            return aggregate_loss(tok, mb.loss_mask, mode, norm, mb.seq_ids)

        # packed, DP-sharded, through megatron's schedule and DDP
        ddp = build(per_token=True, ddp=True)
        ddp.zero_grad_buffer()
        info = plan_packing(lengths, 16, 3)
        dist_plan = distribute_bins(info.num_bins, world, 1, "round-robin")
        batch = build_rank_batch(info, dist_plan, rank, tokens, masks, 0, per_token={"old": old},
                                 per_sequence={"adv": adv})
        loader = get_microbatch_dataloader(batch, 1)

        def fwd(it, model, micro_loss=micro_loss):
            mb = next(it)
            logits = model(mb.tokens, mb.position_ids, mb.attention_mask())

            def loss_func(out):
                # token count 0: finalize_model_grads must not rescale, the loss is already global
                loss = micro_loss(out, mb)
                return loss, torch.tensor(0, dtype=torch.int), {"loss": loss.detach()}

            return logits, loss_func

        stats = get_forward_backward_func()(forward_step_func=fwd, data_iterator=iter(loader), model=ddp,
                                            num_microbatches=len(loader), seq_length=16, micro_batch_size=1,
                                            forward_only=False)
        local = torch.tensor(sum(float(s["loss"]) for s in stats))
        dist.all_reduce(local)
        grads = torch.cat([p.main_grad.reshape(-1) for p in ddp.module.parameters()])

        # reference: no DDP/schedule, plain autograd over all sequences, one sequence per row
        ref_model = build(per_token=False, ddp=False)
        ref_loss = 0.0
        one = plan_packing(lengths, 16, 1)
        for b in range(one.num_bins):
            mb = build_packed_batch(one, [b], tokens, masks, 0, per_token={"old": old}, per_sequence={"adv": adv})
            loss = micro_loss(ref_model(mb.tokens, mb.position_ids, mb.attention_mask()), mb)
            loss.backward()
            ref_loss += loss.item()
        ref_grads = torch.cat([p.grad.reshape(-1) for p in ref_model.parameters()])
        if rank == 0:
            results[mode] = {"loss": float(local), "ref_loss": ref_loss, "num_bins": info.num_bins,
                             "num_microbatches": len(loader),
                             "grad_max_abs_diff": float((grads - ref_grads).abs().max()),
                             "grad_norm": float(ref_grads.norm())}
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1].split(","))
