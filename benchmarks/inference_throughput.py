"""Generation throughput: the Megatron backend vs the Hugging Face backend vs a plain static KV-cache loop.

One run, same model size for all three (a GPT with RoPE, RMSNorm, SwiGLU: megatron-core ``GPTModel``
for Megatron and the static loop, ``transformers`` ``LlamaForCausalLM`` built from an equivalent config
for HF), random weights, byte-level tokens whose end-of-sequence id cannot be sampled, so every request
generates exactly its ``max_tokens`` on every backend. For each concurrency level N, N requests with
mixed prompt lengths (8-64 tokens) and mixed output lengths (16-128 tokens) are submitted at once;
tokens/s = generated tokens / wall time (sampling at T=1, seeded; a warm-up run first; backends run
interleaved, ``--rounds`` times, best kept, so machine noise hits all of them alike).

- megatron: ``MegatronInference`` (megatron-core DynamicInferenceEngine: paged KV cache, continuous
  batching; a finished request frees its slot for the next step).
- huggingface: ``HuggingFaceInference`` (left-padded static batches with the transformers KV cache).
- megatron-throttled (only when asked for): the Megatron backend with the calling thread's OpenMP pool
  left in place, as before megatron/rl/runtime/openmp.py, to show what that costs side by side.
- static loop: megatron-core ``StaticInferenceContext`` + ``GPTModel.forward`` in one padded batch:
  prefill up to the shortest prompt, then one token per step for everyone, feeding prompt tokens to
  rows whose prompt is longer (classic Megatron static batching), until the longest request is done.

    python benchmarks/inference_throughput.py [--hidden 128 --layers 4 --heads 4 --concurrency 1 16 64 256]
        [--backends megatron huggingface static] [--buffer-gb 0.5 --block-size 64 --max-tokens 4096]
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

VOCAB = 384  # 256 byte ids + specials, padded to a multiple of 128
UNREACHABLE_EOS = 10**6  # an id outside the vocabulary: generation always runs to max_tokens


class BenchTokenizer:
    """Bytes as tokens, with both our Tokenizer interface and the bits of the HF one the HF backend uses."""

    vocab_size = 256
    eod = eos_token_id = UNREACHABLE_EOS
    pad = pad_token_id = 0  # what HF pads left-padded prompts with (masked out)
    bos = None
    eos_token_ids = {UNREACHABLE_EOS}

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    decode = detokenize

    def offsets(self, ids, text):
        return list(range(len(ids)))

    def __call__(self, text: str, **_unused):
        return {"input_ids": self.tokenize(text)}


def workload(n: int, seed: int = 0):
    """n (prompt, max_tokens) pairs: prompts of 8-64 bytes, outputs of 16-128 tokens, deterministic."""
    g = torch.Generator().manual_seed(seed + n)
    prompt_lens = torch.randint(8, 65, (n,), generator=g).tolist()
    out_lens = torch.randint(16, 129, (n,), generator=g).tolist()
    text = "The quick brown fox jumps over the lazy dog. " * 4
    return [(text[i % 7:i % 7 + p], o) for i, (p, o) in enumerate(zip(prompt_lens, out_lens))]


def init(cuda: bool):
    from megatron.rl.runtime import setup_runtime

    setup_runtime()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)


def build_megatron(args, cuda: bool):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            ffn_hidden_size=4 * args.hidden, use_cpu_initialization=not cuda,
                            params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                            normalization="RMSNorm", gated_linear_unit=True, bias_activation_fusion=False,
                            bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
                            gradient_accumulation_fusion=False, persist_layer_norm=False, add_bias_linear=False)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=VOCAB, max_sequence_length=args.max_seq, position_embedding_type="rope")
    return model.cuda() if cuda else model


def build_hf(args, cuda: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads, max_position_embeddings=args.max_seq,
                      tie_word_embeddings=False, eos_token_id=None, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to("cuda" if cuda else "cpu").eval()


def requests_for(work):
    from megatron.rl.inference.api import GenerationArgs, InferenceRequest

    return [InferenceRequest(prompt=p, generation_args=GenerationArgs(temperature=1.0, max_tokens=o, seed=i))
            for i, (p, o) in enumerate(work)]


def run_backend(backend, work) -> int:
    requests = requests_for(work)
    out = asyncio.run(backend.agenerate(requests))
    assert all(r.finish_reason == "length" for r in out), [r.error for r in out if r.finish_reason == "error"][:3]
    return sum(len(r.generated_token_ids) for r in out)


def timed(runner, work) -> tuple[float, float]:
    """tokens per wall second and per CPU second of this process (all threads); setup/teardown untimed."""
    run, setup, teardown = runner
    setup()
    try:
        tokens = []
        wall, cpu = C.timed_wall_cpu(lambda: tokens.append(run(work)))
        return tokens[0] / wall, tokens[0] / cpu
    finally:
        teardown()


@torch.inference_mode()
def static_loop(model, work, tok, max_batch: int) -> int:
    """Classic static batching on megatron-core's StaticInferenceContext (see the module docstring)."""
    from megatron.core.inference.contexts import StaticInferenceContext

    device = next(model.parameters()).device
    total = 0
    for start in range(0, len(work), max_batch):
        batch = work[start:start + max_batch]
        prompts = [tok.tokenize(p) for p, _ in batch]
        ends = torch.tensor([len(p) + o for p, (_, o) in zip(prompts, batch)], device=device)
        longest = int(ends.max())
        tokens = torch.zeros(len(batch), longest, dtype=torch.long, device=device)
        is_prompt = torch.zeros(len(batch), longest, dtype=torch.bool, device=device)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)] = torch.tensor(p, device=device)
            is_prompt[i, :len(p)] = True
        ctx = StaticInferenceContext(max_batch_size=len(batch), max_sequence_length=longest)
        gen = torch.Generator(device=device).manual_seed(0)
        pos = min(len(p) for p in prompts)
        chunk = tokens[:, :pos]
        while pos < longest:
            positions = torch.arange(pos - chunk.shape[1], pos, device=device)[None].expand(len(batch), -1)
            logits = model(chunk, positions, None, inference_context=ctx, runtime_gather_output=True)[:, -1].float()
            ctx.sequence_len_offset += chunk.shape[1]
            if not ctx.is_decode_only():
                ctx.enable_decode_mode()
            probs = torch.softmax(logits, -1)
            sampled = torch.multinomial(probs, 1, generator=gen)[:, 0]
            tokens[:, pos] = torch.where(is_prompt[:, pos], tokens[:, pos], sampled)
            chunk = tokens[:, pos:pos + 1]
            pos += 1
        total += sum(o for _, o in batch)
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--max-seq", type=int, default=256)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--backends", nargs="+", default=["megatron", "huggingface", "static"],
                        choices=["megatron", "huggingface", "static", "megatron-throttled"])
    parser.add_argument("--buffer-gb", type=float, default=None, help="Megatron KV buffer (default: EngineSettings)")
    parser.add_argument("--block-size", type=int, default=None, help="Megatron KV block tokens")
    parser.add_argument("--max-tokens", type=int, default=None, help="Megatron tokens per step")
    parser.add_argument("--max-requests", type=int, default=None, help="Megatron requests per step")
    parser.add_argument("--static-batch", type=int, default=256, help="static loop / HF batch size cap")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved repetitions per level (best is reported)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    warnings.filterwarnings("ignore")
    if args.threads:
        torch.set_num_threads(args.threads)

    cuda = torch.cuda.is_available() and os.environ.get("MEGATRON_RL_FORCE_CPU") != "1"
    init(cuda)
    from megatron.rl.inference.huggingface import HuggingFaceInference
    from megatron.rl.inference.megatron import EngineSettings, MegatronInference
    from megatron.rl.runtime.openmp import release_thread_pool

    tok = BenchTokenizer()
    mcore_model = build_megatron(args, cuda)
    settings = EngineSettings.for_device("cuda" if cuda else "cpu")
    for field, value in (("buffer_size_gb", args.buffer_gb), ("block_size_tokens", args.block_size),
                         ("max_tokens", args.max_tokens), ("max_requests", args.max_requests)):
        if value is not None:
            setattr(settings, field, value)
    params = sum(p.numel() for p in mcore_model.parameters())
    nothing = lambda: None  # noqa: E731
    runners = {}  # name -> (run, setup, teardown)
    if "megatron" in args.backends:
        mega = MegatronInference(mcore_model, tok, settings=settings, max_sequence_length=args.max_seq)
        # The engine (KV cache, engine thread) starts before and stops after each timed run, as around an RL
        # rollout phase. Left running, its idle thread would keep an OpenMP pool that slows the backends
        # timed after it (see megatron/rl/runtime/openmp.py).
        runners["megatron"] = (lambda work: run_backend(mega, work), mega.enter_inference_mode,
                               mega.exit_inference_mode)
    if "megatron-throttled" in args.backends:
        # The same backend with the caller's OpenMP pool left in place: what it cost before
        # megatron/rl/runtime/openmp.py (libgomp then throttles the engine thread's pool).
        import megatron.rl.inference.megatron as mega_module

        slow = MegatronInference(mcore_model, tok, settings=settings, max_sequence_length=args.max_seq)

        def throttled_setup():
            mega_module.release_thread_pool = lambda: False
            torch.ones(1 << 20).add_(1)  # a parallel op on this thread (as training would run): it gets a pool
            slow.enter_inference_mode()

        def throttled_teardown():
            slow.exit_inference_mode()
            mega_module.release_thread_pool = release_thread_pool

        runners["megatron-throttled"] = (lambda work: run_backend(slow, work), throttled_setup, throttled_teardown)
    if "huggingface" in args.backends:
        hf_model = build_hf(args, cuda)
        hf = HuggingFaceInference(model=hf_model, tokenizer=tok, max_batch_size=args.static_batch,
                                  max_seq_len=args.max_seq)
        runners["huggingface"] = (lambda work: run_backend(hf, work), nothing, nothing)
        hf_params = sum(p.numel() for p in hf_model.parameters())
    if "static" in args.backends:
        runners["static"] = (lambda work: static_loop(mcore_model, work, tok, args.static_batch), nothing, nothing)
    mcore_model.eval()

    print(f"device: {'cuda' if cuda else 'cpu'} ({torch.get_num_threads()} threads); model: hidden {args.hidden}, "
          f"{args.layers} layers, {args.heads} heads, vocab {VOCAB}: {params / 1e6:.2f}M params (megatron)"
          + (f", {hf_params / 1e6:.2f}M (HF)" if "huggingface" in runners else ""))
    print(f"megatron engine: {settings}")
    for runner in runners.values():  # warm-up: first calls pay one-time costs
        timed(runner, workload(4, seed=99))
    rows = []
    for n in args.concurrency:
        work = workload(n)
        result = {name: (0.0, 0.0) for name in runners}
        for _ in range(args.rounds):  # interleaved rounds, best of: a shared machine's noise hits all alike
            for name, runner in runners.items():
                wall, cpu = timed(runner, work)
                result[name] = (max(result[name][0], wall), max(result[name][1], cpu))
        rows.append((n, sum(o for _, o in work), result))
        print(f"  done: {n} requests: " + ", ".join(f"{k} {v[0]:.0f} tok/s ({v[1]:.0f} tok/CPU-s)"
                                                    for k, v in result.items()), flush=True)

    names = list(runners)
    for metric, label in ((0, "tokens per wall-clock second"), (1, "tokens per CPU second of the process")):
        header = "| requests | gen tokens | " + " | ".join(names)
        if "megatron" in names:
            header += "".join(f" | megatron / {k}" for k in names if k != "megatron")
        print(f"\n{label}:\n{header} |")
        print("|" + "---|" * (header.count("|")))
        for n, ntok, result in rows:
            line = f"| {n} | {ntok} | " + " | ".join(f"{result[k][metric]:.0f}" for k in names)
            if "megatron" in names:
                line += "".join(f" | {result['megatron'][metric] / result[k][metric]:.2f}x"
                                for k in names if k != "megatron")
            print(line + " |")


if __name__ == "__main__":
    main()
