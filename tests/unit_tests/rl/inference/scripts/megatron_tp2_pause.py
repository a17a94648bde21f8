"""torchrun --nproc-per-node 2: the TP=2 engine paused across a weight update (asynchronous partial rollouts).

The ranks pause and resume at different times (as their trainers finish at different times): no rank steps
while paused or before its own resume, both return the same response, and the policy versions split it at the
same token on both ranks.
"""
from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.unit_tests.rl.inference.scripts.megatron_common import init_distributed, tiny_gpt  # noqa: E402


def main() -> None:
    init_distributed(tp=2)
    from megatron.rl.inference.api import GenerationArgs, InferenceRequest
    from megatron.rl.inference.megatron import MegatronInference
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    rank = dist.get_rank()
    model = tiny_gpt(tp=2)
    backend = MegatronInference(model, ByteLevelTokenizer())
    backend.enter_inference_mode()
    backend.set_policy_version(0)
    box = {}
    req = InferenceRequest(prompt="Once upon a time", generation_args=GenerationArgs(max_tokens=100, seed=3))
    thread = threading.Thread(target=lambda: box.update(out=asyncio.run(backend.agenerate([req]))))
    thread.start()
    while backend.engine_steps < 3:
        time.sleep(0.005)
    dist.barrier()  # the trainers reach the update at different times
    time.sleep(0.3 * rank)
    backend.pause_generation()
    held = backend.engine_steps
    time.sleep(0.3)
    assert backend.engine_steps == held, "stepped while paused"
    dist.barrier()
    with torch.no_grad():
        torch.manual_seed(rank)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    if rank == 1:  # rank 0 resumes first: rank 1 must not step before its own resume
        time.sleep(0.5)
        assert backend.engine_steps == held, "stepped before this rank's trainer resumed it"
    backend.resume_generation(1)
    thread.join(timeout=240)
    [resp] = box["out"]
    assert resp.finish_reason in ("stop", "length"), resp.error
    k = resp.policy_versions.index(1)
    assert k > 0 and resp.policy_versions == [0] * k + [1] * (len(resp.policy_versions) - k)
    gathered = [None, None]
    dist.all_gather_object(gathered, resp.model_dump())
    assert gathered[0] == gathered[1], "TP ranks returned different responses"
    backend.exit_inference_mode()
    print(f"rank {rank}: TP2 PAUSE OK (split at token {k} of {len(resp.policy_versions)})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
