"""Distributed optimizer (torch-Adam fallback) save -> load -> continue equals an uninterrupted run.

Run with torchrun (2 processes, DP=2). Exercises the CPU layer's DistributedOptimizer patch: without it
loading raises (empty state / KeyError 'step') or, worse, shares one 'step' tensor across params so Adam's
bias correction jumps and losses silently diverge. Also runs a MoE layer with the alltoall dispatcher.
Prints one JSON line on rank 0.
"""
import json
import os
import sys

from megatron.rl.runtime import setup_runtime


def build(moe: bool):
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(0)
    extra = dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
                 moe_aux_loss_coeff=0.0, moe_permute_fusion=False, moe_router_fusion=False,
                 add_bias_linear=False) if moe else {}
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                            normalization="RMSNorm", gated_linear_unit=True, bias_activation_fusion=False,
                            bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
                            gradient_accumulation_fusion=False, **extra)
    cfg.finalize_model_grads_func = finalize_model_grads
    spec = get_gpt_layer_local_spec(num_experts=4 if moe else None, moe_grouped_gemm=False, normalization="RMSNorm")
    model = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16,
                     position_embedding_type="rope")
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                     grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0,
                                                 use_distributed_optimizer=True), [ddp])
    return model, ddp, opt


def step(ddp, opt, data):
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.zero_grad_buffer()
    opt.zero_grad()
    pos = torch.arange(data.shape[1] - 1)[None].expand(data.shape[0], -1)

    def fwd(it, model):
        b = next(it)
        out = model(b[:, :-1], pos, None, labels=b[:, 1:])
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    out = get_forward_backward_func()(forward_step_func=fwd, data_iterator=iter([data]), model=ddp,
                                      num_microbatches=1, seq_length=data.shape[1] - 1,
                                      micro_batch_size=data.shape[0], forward_only=False)
    opt.step()
    loss = out[0]["loss"].clone()
    torch.distributed.all_reduce(loss)
    return loss.item() / torch.distributed.get_world_size()


def main(ckpt_dir):
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state

    setup_runtime()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    rank = dist.get_rank()
    data = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(rank))
    meta = {"distrib_optim_sharding_type": "fully_reshardable"}

    model, ddp, opt = build(moe=False)
    for _ in range(3):
        step(ddp, opt, data)
    state = {"model": model.sharded_state_dict()}
    state["optimizer"] = opt.sharded_state_dict(state["model"], metadata=meta)
    os.makedirs(ckpt_dir, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(state, ckpt_dir, content_metadata=meta)
    uninterrupted = [step(ddp, opt, data) for _ in range(3)]

    model2, ddp2, opt2 = build(moe=False)
    state2 = {"model": model2.sharded_state_dict()}
    state2["optimizer"] = opt2.sharded_state_dict(state2["model"], is_loading=True, metadata=meta)
    loaded = dist_checkpointing.load(state2, ckpt_dir)
    model2.load_state_dict(loaded["model"])
    opt2.load_state_dict(loaded["optimizer"])
    adam_states = [s for o in getattr(opt2, "chained_optimizers", [opt2]) for s in o.optimizer.state.values()]
    steps = sorted({float(s["step"]) for s in adam_states})
    distinct_step_tensors = len({id(s["step"]) for s in adam_states}) == len(adam_states)
    resumed = [step(ddp2, opt2, data) for _ in range(3)]

    _, moe_ddp, moe_opt = build(moe=True)
    moe_losses = [step(moe_ddp, moe_opt, data) for _ in range(3)]
    if rank == 0:
        print(json.dumps(dict(uninterrupted=uninterrupted, resumed=resumed, steps=steps,
                              distinct_step_tensors=distinct_step_tensors, moe_losses=moe_losses)))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # torch_dist saving spawns a subprocess
    main(sys.argv[1])
