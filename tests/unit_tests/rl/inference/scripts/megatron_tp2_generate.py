"""torchrun --nproc-per-node 2: the Megatron backend on a TP=2 tiny GPT.

Checks: log-probs equal a teacher-forced forward at T=1 and T=0.7; both ranks return identical
responses although their calls arrive at different times; a rank that submits a different request
gets an error for it (never another rank's completion); exit + re-enter works.
"""
from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.unit_tests.rl.inference.scripts.megatron_common import (  # noqa: E402
    init_distributed,
    teacher_forced_logprobs,
    tiny_gpt,
)


def main() -> None:
    init_distributed(tp=2)
    from megatron.rl.inference.api import GenerationArgs, InferenceRequest
    from megatron.rl.inference.megatron import MegatronInference
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    rank = dist.get_rank()
    model = tiny_gpt(tp=2)
    backend = MegatronInference(model, ByteLevelTokenizer())
    prompts = ["The quick brown fox", "1 + 1 =", "Once upon a time, in a land far away,"]
    reqs = [InferenceRequest(prompt=p, generation_args=GenerationArgs(temperature=t, max_tokens=10 + 2 * i, seed=i))
            for t in (1.0, 0.7, 0.0) for i, p in enumerate(prompts)]

    async def staggered(requests, delay):
        await asyncio.sleep(delay)
        return await backend.agenerate(requests)

    worst = 0.0
    for round_ in range(2):  # enter, generate, exit; twice
        with backend.inference_mode():
            # rank 1's requests arrive later than rank 0's, in two separate calls
            if rank == 0:
                out = backend.generate(reqs)
            else:
                async def two_calls():
                    a = await staggered(reqs[:4], 0.3)
                    b = await staggered(reqs[4:], 0.1)
                    return a + b
                out = asyncio.run(two_calls())
            for resp, req in zip(out, reqs):
                assert resp.finish_reason in ("stop", "length"), resp.error
                ref = teacher_forced_logprobs(model, resp.token_ids, resp.prompt_length,
                                              req.generation_args.temperature)
                worst = max(worst, float((torch.tensor(resp.logprobs) - ref).abs().max()))
            gathered = [None, None]
            dist.all_gather_object(gathered, [r.model_dump() for r in out])
            assert gathered[0] == gathered[1], "TP ranks returned different responses"
            # mismatched submissions: rank 1 asks something else -> an error on rank 1 only
            mine = InferenceRequest(prompt="abc" if rank == 0 else "xyz",
                                    generation_args=GenerationArgs(temperature=0, max_tokens=3))
            odd = backend.generate([mine])[0]
            if rank == 0:
                assert odd.finish_reason == "length", odd
            else:
                assert odd.finish_reason == "error" and "same requests" in odd.error, odd
        assert backend.context is None
    assert worst < 1e-5, worst
    print(f"rank {rank}: TP2 OK max|logp - teacher_forced| = {worst:.2e}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    t0 = time.time()
    main()
