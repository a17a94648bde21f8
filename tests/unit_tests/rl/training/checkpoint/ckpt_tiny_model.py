"""A tiny megatron-core GPT with Megatron DDP, megatron optimizer and LR scheduler for checkpoint tests.

Built directly on megatron-core (not the training package) so the checkpoint tests only depend on
checkpointing. Used in-process by the pytest files and by the torchrun scripts under scripts/.
"""
from __future__ import annotations

import dataclasses
import os
import socket

import torch

VOCAB, SEQ, GBS, MBS = 128, 16, 4, 2


@dataclasses.dataclass
class Arch:
    num_layers: int = 4
    hidden_size: int = 64
    num_attention_heads: int = 4
    dropout: float = 0.0

    def model_args(self) -> dict:
        return {"num_layers": self.num_layers, "hidden_size": self.hidden_size,
                "num_attention_heads": self.num_attention_heads, "vocab_size": VOCAB,
                "seq_length": SEQ, "normalization": "RMSNorm", "swiglu": True}


def init_single_process() -> None:
    """A 1-process gloo group (idempotent), for in-process tests."""
    from megatron.rl.runtime import setup_runtime

    setup_runtime()
    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def init_torchrun() -> None:
    from megatron.rl.runtime import setup_runtime

    setup_runtime()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo")


def set_layout(tp: int = 1, pp: int = 1, vpp: int | None = None, seed: int = 1234) -> None:
    """(Re)initialise megatron's parallel state for a layout and seed every generator."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 virtual_pipeline_model_parallel_size=vpp)
    reseed(seed)


def reseed(seed: int) -> None:
    import random

    import numpy as np
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def build(arch: Arch, distopt: bool, seed: int = 1234):
    """Model chunks (DDP-wrapped), optimizer and scheduler for the current parallel layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.transformer_config import TransformerConfig

    reseed(seed)
    tp, pp = ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    cfg = TransformerConfig(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size, num_attention_heads=arch.num_attention_heads,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        bf16=False, fp16=False, gradient_accumulation_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, cross_entropy_loss_fusion=False,
        hidden_dropout=arch.dropout, attention_dropout=arch.dropout,
        normalization="RMSNorm", gated_linear_unit=True,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, batch_p2p_comm=(vpp is None))
    cfg.finalize_model_grads_func = finalize_model_grads
    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    chunks = []
    for stage in (range(vpp) if vpp else [None]):
        kw = {} if stage is None else {"vp_stage": stage}
        m = GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope",
                     pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
                     post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage), **kw)
        chunks.append(m)
    ddp_cfg = DistributedDataParallelConfig(use_distributed_optimizer=distopt, grad_reduce_in_fp32=True)
    chunks = [DDP(config=cfg, ddp_config=ddp_cfg, module=m) for m in chunks]
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, clip_grad=1.0, weight_decay=0.01,
                        use_distributed_optimizer=distopt, bf16=False, fp16=False), chunks)
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-2, min_lr=1e-3, lr_warmup_steps=2,
                                    lr_decay_steps=20, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
                                    wd_incr_steps=20, wd_incr_style="constant")
    return chunks, opt, sched


def batch(step: int) -> torch.Tensor:
    """The global batch of a step: [GBS, SEQ + 1] token ids, a pure function of ``step``."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (GBS, SEQ + 1), generator=g)


def _run(chunks, tokens: torch.Tensor, forward_only: bool) -> float:
    """forward(+backward) over this DP rank's share of ``tokens``; returns the global mean loss."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    dp, dpr = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    local = tokens[dpr * GBS // dp:(dpr + 1) * GBS // dp]
    nmb = local.shape[0] // MBS
    mbs = [local[i * MBS:(i + 1) * MBS] for i in range(nmb)]
    pos = torch.arange(SEQ).unsqueeze(0).expand(MBS, -1)

    def fwd(it, model):
        b = next(it)
        out = model(b[:, :-1].contiguous(), pos, None, labels=b[:, 1:].contiguous())

        def loss_func(o):
            loss = o.float().mean()
            return loss, {"loss": loss.detach().clone()}
        return out, loss_func

    it = [iter(mbs) for _ in chunks] if len(chunks) > 1 else iter(mbs)
    out = get_forward_backward_func()(forward_step_func=fwd, data_iterator=it,
                                      model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=nmb,
                                      seq_length=SEQ, micro_batch_size=MBS, forward_only=forward_only)
    local_mean = sum(o["loss"].item() for o in out) / len(out) if out else 0.0
    t = torch.tensor([local_mean], dtype=torch.float64)
    torch.distributed.all_reduce(t)  # only last-stage ranks contribute: tp * dp of them
    return t.item() / (ps.get_tensor_model_parallel_world_size() * dp)


def train_step(chunks, opt, sched, step: int) -> float:
    for c in chunks:
        c.zero_grad_buffer()
    opt.zero_grad()
    loss = _run(chunks, batch(step), forward_only=False)
    ok, _, _ = opt.step()
    assert ok
    sched.step(increment=1)
    return loss


def eval_loss(chunks, step: int = 999) -> float:
    for c in chunks:
        c.eval()
    with torch.no_grad():
        loss = _run(chunks, batch(step), forward_only=True)
    for c in chunks:
        c.train()
    return loss


def full_params(chunks) -> dict[str, torch.Tensor]:
    """Parameters of a 1-process (TP=PP=1) model by name, cloned."""
    from megatron.core.utils import unwrap_model

    return {k: v.detach().clone() for c in unwrap_model(chunks) for k, v in c.named_parameters()}


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def adam_state_by_name(chunks, opt) -> dict[str, dict[str, torch.Tensor]]:
    """Adam's state of a 1-process model (plain megatron optimizer, chained or not) by parameter name, cloned:
    names rather than positions, so two megatron-core releases that group the parameters differently compare."""
    from megatron.core.utils import unwrap_model

    names = {id(p): k for c in unwrap_model(chunks) for k, p in c.named_parameters()}
    out = {}
    for o in getattr(opt, "chained_optimizers", [opt]):
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                out[names[id(p)]] = {k: torch.as_tensor(v).detach().clone() for k, v in o.optimizer.state[p].items()}
    return out
