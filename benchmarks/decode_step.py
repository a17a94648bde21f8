"""One decode step at N rows: the in-process megatron-core engine next to Hugging Face ``generate``, in one run.

Both sides run a grpo_vs_trl shape (``--shape``; small: 4 layers, hidden 256, 4 heads / 2 KV groups, FFN 688;
vocabulary 384, fp32, random weights): ``MegatronInference`` over megatron-core's ``GPTModel`` (built as ``train_rl.py``
builds it) and ``transformers``' ``Qwen2ForCausalLM``. Each round submits N requests at once (prompts of 5-20
tokens, T = 1, ``--new-tokens`` each) and records every decode step that had all N rows:

- megatron: the engine's ``async_step`` (forward, our sampling, megatron-core's bookkeeping, the backend's
  per-step checks), timed around the call on the engine thread;
- huggingface: the time between consecutive logits-processor calls inside ``generate`` (forward, sampling,
  ``generate``'s own bookkeeping), run without the CPU layer's device-rewriting mode (``C.without_device_mode``),
  which building our trainer enters on the main thread and HF in a process of its own never pays.

It prints the median per step, in wall seconds and in CPU seconds of the process (all threads; steadier on a
shared machine), and the ratio. Sides alternate within every round, after one untimed round of each (first-touch
page faults of the KV cache, HF's first allocations).

``--paired``: each of the engine's decode steps is followed, on the engine's thread, by one HF decode step over the
same prompts (the model's forward with its KV cache, then softmax and multinomial: no ``generate`` bookkeeping, so
HF's side is the lighter), and the ratio is the median of the per-step ratios. A step and its pair run back to back
at the same batch and context length, so the ratio holds steadier than whole runs on a machine whose speed drifts
(figures: docs/benchmarks.md).

    python benchmarks/decode_step.py [--rows 128] [--new-tokens 24] [--rounds 3] [--threads 2] [--shape large]
        [--off packed_weights] [--paired]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_GROUPS, FFN, VOCAB, SEQ = 256, 4, 4, 2, 688, 384, 128
# grpo_vs_trl's model shapes: (hidden, layers, heads, KV groups, FFN)
SHAPES = {"small": (256, 4, 4, 2, 688), "large": (512, 8, 8, 4, 1376)}


def workload(rows: int, seed: int = 0, group_size: int = 1, lengths: tuple[int, int] = (5, 20)) -> list[list[int]]:
    """``rows`` prompts of ``lengths`` tokens (inclusive); ``group_size`` > 1: each prompt repeated that many times
    in a row, as a GRPO rollout phase submits a group."""
    g = torch.Generator().manual_seed(seed)
    count = -(-rows // group_size)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=g).tolist()
    prompts = [torch.randint(65, 91, (n,), generator=g).tolist() for n in sizes]
    return [p for p in prompts for _ in range(group_size)][:rows]


def build_megatron(settings=None):
    """The benchmark's backend; ``settings``: its ``EngineSettings`` (None: the defaults)."""
    argv = (C.model_flags(HIDDEN, LAYERS, HEADS, SEQ) + C.optim_flags(8, 8)
            + ["--group-query-attention", "--num-query-groups", str(KV_GROUPS), "--ffn-hidden-size", str(FFN)])
    trainer = C.build_trainer(argv)
    from megatron.core.inference.engines import DynamicInferenceEngine

    from megatron.rl.inference.megatron import MegatronInference
    from megatron.rl.inference.engine.build import SamplingController

    steps: list[tuple[int, float, float]] = []  # (rows, wall s, cpu s)
    rows = {"n": 0}
    sample = SamplingController._dynamic_step_sample_logits
    step = DynamicInferenceEngine.async_step

    def counting_sample(self, *logits):  # megatron-core 0.19 passes no logits (they are in the controller's buffer)
        context = self.inference_wrapped_model.inference_context
        rows["n"] = context.total_request_count - context.paused_request_count
        return sample(self, *logits)

    async def timed_step(self, *args, **kwargs):
        rows["n"] = 0
        w0, c0 = time.perf_counter(), time.process_time()
        result = await step(self, *args, **kwargs)
        steps.append((rows["n"], time.perf_counter() - w0, time.process_time() - c0))
        if AFTER_STEP:
            AFTER_STEP[0]()
        return result

    SamplingController._dynamic_step_sample_logits = counting_sample
    DynamicInferenceEngine.async_step = timed_step
    tokenizer = _NoEos(trainer.tokenizer)
    backend = MegatronInference(trainer.model[0], tokenizer, max_sequence_length=SEQ, settings=settings)
    return backend, tokenizer, steps


AFTER_STEP: list = []  # --paired: called on the engine thread after each timed engine step


class HFSteps:
    """HF's decode one step at a time, for ``--paired``: the prompts left-padded as ``generate`` pads them, then per
    step the forward over the last tokens with the KV cache, softmax and multinomial sampling (T = 1)."""

    def __init__(self, model, prompts):
        self.model, self.prompts, self.times = model, prompts, []

    def prefill(self) -> None:
        ids, self.mask = left_padded(self.prompts)
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode(), C.without_device_mode():
            out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True)
        self.cache, self.logits, self.position = out.past_key_values, out.logits[:, -1], positions[:, -1:]

    def step(self) -> None:
        start = time.perf_counter()
        with torch.inference_mode(), C.without_device_mode():
            token = torch.multinomial(torch.softmax(self.logits.float(), -1), 1)
            self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.prompts), 1)], 1)
            self.position = self.position + 1
            out = self.model(input_ids=token, attention_mask=self.mask, position_ids=self.position,
                             past_key_values=self.cache, use_cache=True)
            self.cache, self.logits = out.past_key_values, out.logits[:, -1]
        self.times.append(time.perf_counter() - start)


def run_paired(backend, tokenizer, steps, hf, prompts, new_tokens: int, rows: int) -> list[tuple[float, float]]:
    """One generation of ours with an HF step after each of our steps: (our wall s, HF wall s) per decode step."""
    hf_steps = HFSteps(hf, prompts)
    ours_at: list[int] = []

    def after_step():
        if not ours_at:
            hf_steps.prefill()  # after the engine's first step, which prefilled
        else:
            hf_steps.step()
        ours_at.append(len(steps) - 1)

    AFTER_STEP[:] = [after_step]
    try:
        run_megatron(backend, tokenizer, steps, prompts, new_tokens, rows)  # leaves every step's record in ``steps``
    finally:
        AFTER_STEP.clear()
    # our step i (i >= 1) is paired with HF's step i - 1: both add token i + 1 to every row
    return [(steps[i][1], hf_steps.times[k]) for k, i in enumerate(ours_at[1:])
            if k < len(hf_steps.times) and steps[i][0] == rows]


class _NoEos:
    """The byte tokenizer without an end-of-sequence id: every request runs to ``max_tokens`` (as on the HF side)."""

    eod = None
    eos_token_ids = None

    def __init__(self, inner):
        self.inner = inner
        self.vocab_size = inner.vocab_size

    def tokenize(self, text):
        return self.inner.tokenize(text)

    def detokenize(self, ids):
        return self.inner.detokenize(ids)

    def offsets(self, ids, text):
        return self.inner.offsets(ids, text)


def run_megatron(backend, tokenizer, steps, prompts, new_tokens: int, rows: int):
    from megatron.rl.inference.api import GenerationArgs, InferenceRequest

    texts = [bytes(p).decode("ascii") for p in prompts]
    requests = [InferenceRequest(prompt=t, generation_args=GenerationArgs(temperature=1.0, max_tokens=new_tokens,
                                                                          seed=i)) for i, t in enumerate(texts)]
    backend.enter_inference_mode()
    steps.clear()
    out = asyncio.run(backend.agenerate(requests))
    backend.exit_inference_mode()
    failed = [r.error for r in out if r.finish_reason == "error"]
    assert not failed, failed[:3]
    return [(w, c) for n, w, c in steps[1:] if n == rows]  # the first full step still holds prefill work


def build_hf():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_GROUPS, max_position_embeddings=SEQ,
                      tie_word_embeddings=True, eos_token_id=None, pad_token_id=VOCAB - 1, bos_token_id=None)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).eval()


def left_padded(prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's input ids and attention mask of ``prompts``, padded on the left as ``generate`` expects."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), VOCAB - 1, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


def run_hf(model, prompts, new_tokens: int):
    from transformers import LogitsProcessor, LogitsProcessorList

    ids, mask = left_padded(prompts)
    marks: list[tuple[float, float]] = []

    class Clock(LogitsProcessor):
        def __call__(self, input_ids, scores):
            marks.append((time.perf_counter(), time.process_time()))
            return scores

    with torch.no_grad(), C.without_device_mode():  # HF as in a process of its own (no CPU layer)
        model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                       max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=VOCAB - 1,
                       logits_processor=LogitsProcessorList([Clock()]))
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks[1:], marks[2:])]  # decode steps only


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="small", help="grpo_vs_trl's model shape")
    p.add_argument("--off", nargs="*", default=[], choices=["packed_weights", "decode_mirror"],
                   help="engine features to turn off (EngineSettings fields)")
    p.add_argument("--paired", action="store_true",
                   help="an HF decode step after each of ours, on the same thread; the median per-step ratio")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    global HIDDEN, LAYERS, HEADS, KV_GROUPS, FFN
    HIDDEN, LAYERS, HEADS, KV_GROUPS, FFN = SHAPES[args.shape]
    settings = None
    if args.off:
        import dataclasses

        from megatron.rl.inference.engine.build import EngineSettings

        settings = dataclasses.replace(EngineSettings.for_device("cpu"), **{f: False for f in args.off})
    backend, tokenizer, steps = build_megatron(settings)
    hf = build_hf()
    prompts = workload(args.rows)
    times: dict[str, list[tuple[float, float]]] = {"megatron": [], "huggingface": []}
    # An untimed round of each side first: the engine's first rollout writes KV-cache pages the process never
    # touched (a page fault each), HF's first generate allocates its cache; neither is a decode step's cost.
    run_megatron(backend, tokenizer, steps, prompts, args.new_tokens, args.rows)
    run_hf(hf, prompts, args.new_tokens)
    if args.paired:
        report_paired(backend, tokenizer, steps, hf, prompts, args)
        C.teardown()
        return
    for r in range(args.rounds):
        order = ["megatron", "huggingface"] if r % 2 == 0 else ["huggingface", "megatron"]
        for side in order:
            if side == "megatron":
                times[side] += run_megatron(backend, tokenizer, steps, prompts, args.new_tokens, args.rows)
            else:
                times[side] += run_hf(hf, prompts, args.new_tokens)
    med = {side: (statistics.median(w for w, _ in t) * 1e3, statistics.median(c for _, c in t) * 1e3)
           for side, t in times.items()}
    print(f"decode step at {args.rows} rows ({LAYERS} layers, hidden {HIDDEN}, {HEADS} heads / {KV_GROUPS} KV groups, "
          f"FFN {FFN}; {torch.get_num_threads()} threads; median of {args.rounds} rounds; engine features off: "
          f"{', '.join(args.off) or 'none'})")
    print("| side | steps | wall ms/step | CPU ms/step |")
    print("|---|---|---|---|")
    for side, t in times.items():
        print(f"| {side} | {len(t)} | {med[side][0]:.1f} | {med[side][1]:.1f} |")
    print(f"megatron / huggingface: wall {med['megatron'][0] / med['huggingface'][0]:.2f}x, "
          f"CPU {med['megatron'][1] / med['huggingface'][1]:.2f}x")
    C.teardown()


def report_paired(backend, tokenizer, steps, hf, prompts, args) -> None:
    print(f"decode steps at {args.rows} rows, paired ({LAYERS} layers, hidden {HIDDEN}, {HEADS} heads / {KV_GROUPS} KV "
          f"groups, FFN {FFN}; {torch.get_num_threads()} threads): each of ours followed by one of HF's")
    print("| round | steps | ours ms/step | HF ms/step | median of per-step ratios ours / HF |")
    print("|---|---|---|---|---|")
    ratios = []
    for r in range(args.rounds):
        pairs = run_paired(backend, tokenizer, steps, hf, prompts, args.new_tokens, args.rows)
        ratios.append(statistics.median(a / b for a, b in pairs))
        print(f"| {r + 1} | {len(pairs)} | {statistics.median(a for a, _ in pairs) * 1e3:.1f} | "
              f"{statistics.median(b for _, b in pairs) * 1e3:.1f} | {ratios[-1]:.3f} |")
    print(f"ours / HF per step: median {statistics.median(ratios):.3f} over {args.rounds} rounds "
          f"(range {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
