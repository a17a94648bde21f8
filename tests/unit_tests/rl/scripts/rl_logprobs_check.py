"""torchrun script: megatron.rl.rl_loss.vocab_parallel_logprobs and vocab_parallel_entropy on vocab shards equals log_softmax / entropy of the full logits.

Checks TP=2 (each rank holds half the vocabulary) and then TP=1 (DP=2) on the same 2 processes, at
T=1, T=0.7 and T=0 (scored as T=1), values and gradients. Prints "OK <max abs diffs json>" on rank 0.
"""
import json
import sys

import torch
import torch.distributed as dist

from megatron.rl.runtime import setup_runtime


def main() -> int:
    setup_runtime()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps

    from megatron.rl.rl_loss import vocab_parallel_entropy as token_entropy, vocab_parallel_logprobs as token_logprobs

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1234)
    V = 48
    logits_full = (torch.randn(3, 5, V, generator=gen, dtype=torch.float64) * 3).float()
    labels = torch.randint(0, V, (3, 5), generator=gen)
    weights = torch.randn(3, 5, generator=gen)  # makes the gradient check non-trivial
    worst = {}
    for tp in (2, 1):
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        tp_rank = ps.get_tensor_model_parallel_rank()
        shard = V // tp
        for temp in (1.0, 0.7, 0.0):
            t_eff = 1.0 if temp == 0 else temp
            ref_full = logits_full.double().clone().requires_grad_(True)
            ref_lsm = torch.log_softmax(ref_full / t_eff, dim=-1)
            ref_lp = ref_lsm.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            ref_ent = -(ref_lsm.exp() * ref_lsm).sum(-1)
            ((ref_lp * weights).sum() + (ref_ent * weights).sum()).backward()
            ref_grad = ref_full.grad[..., tp_rank * shard:(tp_rank + 1) * shard]

            local = logits_full[..., tp_rank * shard:(tp_rank + 1) * shard].clone().requires_grad_(True)
            lp = token_logprobs(local, labels.clone(), temp)
            ent = token_entropy(local, temp)
            assert lp.shape == labels.shape and ent.shape == labels.shape, (lp.shape, ent.shape)
            assert lp.dtype == torch.float32
            ((lp * weights).sum() + (ent * weights).sum()).backward()
            diffs = {"lp": float((lp.double() - ref_lp.detach()).abs().max()),
                     "ent": float((ent.double() - ref_ent.detach()).abs().max()),
                     "grad": float((local.grad.double() - ref_grad).abs().max())}
            for k, v in diffs.items():
                key = f"tp{tp}/T{temp}/{k}"
                worst[key] = v
                if v > 1e-5:
                    print(f"rank {rank}: {key} differs by {v}", file=sys.stderr)
                    return 1
            # the temperature matters (so a function that ignored it would fail above)
            if temp == 0.7:
                plain = torch.log_softmax(logits_full.double(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
                assert float((plain - ref_lp.detach()).abs().max()) > 1e-2
        ps.destroy_model_parallel()
    if rank == 0:
        print("OK " + json.dumps(worst))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
