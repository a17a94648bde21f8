"""GRPO step time: ``train_rl.py`` next to TRL's ``GRPOTrainer`` on the same model shape and the same work, in one run.

Both sides train a Qwen2-shaped decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention, tied embeddings,
fp32, random weights) built locally, with the same byte-level vocabulary (nothing is downloaded), on the
arithmetic environment's prompts (``Q: 12+7=? A:``) and its strict reward, sampling at T = 1 with beta = 0
and one optimizer step per iteration (TRL: ``num_iterations=1``, ``steps_per_generation=1``; ours: one
``--global-batch-size`` of all rollouts, ``--grpo-iterations 1``). Each side runs in its own fresh process
with the same number of torch threads; the sides alternate within every round (order swapped each round)
so a shared machine's load hits them alike. The first step of every run is a warm-up and left out; the
table shows the median over the measured steps of all rounds, and a line under it the ratios of each round's
two runs (:func:`paired_line`), which a machine whose speed drifts over minutes moves less.

Identical work on both sides:

- **the same prompts**: TRL's dataset is the arithmetic agent's problems 0, 1, 2, ... in the order our agent draws
  them (``shuffle_dataset=False``), scored by the agent's own reward function;
- **the same number of generated tokens per rollout, forced on both sides**: every rollout generates exactly
  the shape's ``new_tokens``. TRL: ``min_new_tokens = max_completion_length`` (the end-of-sequence logit is
  masked until then). Ours: the environment's own budget and stop string are off (``max_tokens: null`` follows
  ``--rl-max-new-tokens``, ``stop: []``) and the end-of-document id does not end a rollout;
- **TRL at its fastest fair setting**: ``gradient_checkpointing=False`` (TRL's GRPOConfig defaults to True,
  which recomputes every forward during backward; ours recomputes nothing), fp32 on both sides, the same
  threads.

The benchmark counts generated tokens (completion tokens returned) and trained tokens (completion tokens in the
loss) per step on every side, and prints no TRL ratio for a side whose counts differ from TRL's by more than
2% (:func:`equal_work`).

Sides:

- ``trl``: ``GRPOTrainer`` on ``transformers``' ``Qwen2ForCausalLM`` (plain HF ``generate``). Phases:
  generate (``model.generate``), score (the rest of TRL's ``_generate_and_score_completions``: rewards,
  advantages, old log-probs when it needs them), train (forward + backward + optimizer).
- ``ours``: ``train_rl.py``'s driver (:func:`megatron.rl.rl_loop.run_rl`) with the in-process megatron-core
  engine, at its defaults: old-policy log-probs from the training forward, ``--micro-batch-size`` = all rollouts,
  and the default layout (``--rl-layout auto``, :mod:`megatron.rl.packing.layout_choice`): packed rows of one
  group each, so each group's prompt is computed once for all its rollouts (:mod:`megatron.rl.packing.prefix_sharing`;
  the column "prompt tokens shared" is the share of rollout tokens not computed), all rows in one micro-batch
  cropped to its rows. Phases: generate (rollouts + rewards), log-probs (the scoring pass; ~0 when skipped), train.
- ``ours-padded``: the same with ``--rl-layout padded``: one rollout per row, the default layout before
  ``--rl-layout``.
- ``ours-packed`` (only when named in ``--sides``): the hand-set recipe the default layout was chosen from:
  ``--rl-use-sequence-packing`` with ``--seq-length`` = :func:`group_row_length` (rows for a whole group, sized
  for this shape's prompts) and one micro-batch of one row per prompt. Figures under this name in
  docs/benchmarks.md before ``--rl-layout`` measured it.
- ``ours-fixed`` (only when named in ``--sides``): ``ours-padded`` with ``--rl-fixed-microbatch-shapes
  --rl-recompute-old-logprobs`` (every micro-batch at ``[micro-batch, seq-length]`` and a separate scoring pass:
  how the step ran before either), for the packing efficiency and the cost of those two choices.

CPU s/step is the process's CPU time (all threads) per step: steadier than wall time on a shared machine
(time spent descheduled is not counted), so its ratio is the fairer one under load.

TRL is optional (``pip install -e ".[bench]"``); without it the ``trl`` side prints "TRL not installed"
and is skipped.

The ``long`` shape puts a fixed 512-character block before every problem (:func:`long_prompt_block`): long
packed rows whose groups share ~525 prompt tokens. Every side's peak RSS (``ru_maxrss`` of its own process) is
printed too.

    python benchmarks/grpo_vs_trl.py [--shapes small large] [--rounds 2] [--steps 4] [--threads 2]
    python benchmarks/grpo_vs_trl.py --shapes small --threads auto --co-runners 1   # a shared machine
    python benchmarks/grpo_vs_trl.py --shapes long --sides ours trl [--group-size 16]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

SIDES = ("ours", "ours-padded", "ours-packed", "trl", "ours-fixed")
DEFAULT_SIDES = ("ours", "ours-padded", "trl")
EQUAL_WORK_TOLERANCE = 0.02  # generated / trained tokens per step may differ by this share, no more
BOS, EOD, PAD = 258, 256, 257  # megatron's ByteLevelTokenizer: bytes are ids 0..255
VOCAB = 384  # its 259 ids padded to a multiple of 128 (--make-vocab-size-divisible-by), on both sides


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_groups: int
    ffn: int
    prompts: int
    group_size: int
    new_tokens: int
    seq_length: int
    preamble_chars: int = 0  # a fixed block of this many characters before every problem (long_prompt_block)

    def describe(self) -> str:
        preamble = f"; a {self.preamble_chars}-character block before each problem" if self.preamble_chars else ""
        return (f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads / {self.kv_groups} KV groups, "
                f"FFN {self.ffn}; {self.prompts} prompts x {self.group_size} rollouts, <= {self.new_tokens} "
                f"new tokens{preamble}")


SHAPES = {
    "small": Shape(hidden=256, layers=4, heads=4, kv_groups=2, ffn=688, prompts=16, group_size=8, new_tokens=16,
                   seq_length=64),
    "large": Shape(hidden=512, layers=8, heads=8, kv_groups=4, ffn=1376, prompts=8, group_size=8, new_tokens=64,
                   seq_length=128),
    # the large model on ~525-token prompts (a 512-character block, then the problem): long packed rows
    "long": Shape(hidden=512, layers=8, heads=8, kv_groups=4, ffn=1376, prompts=4, group_size=8, new_tokens=64,
                  seq_length=640, preamble_chars=512),
    "tiny": Shape(hidden=64, layers=2, heads=4, kv_groups=2, ffn=128, prompts=2, group_size=4, new_tokens=8,
                  seq_length=32),  # smoke tests
}


def shape_of(name: str, group_size: int | None = None) -> Shape:
    """The named shape, with ``group_size`` rollouts per prompt where given."""
    return dataclasses.replace(SHAPES[name], group_size=group_size) if group_size else SHAPES[name]


def long_prompt_block(chars: int) -> str:
    """A fixed few-shot block of exactly ``chars`` characters (bytes: one token each) put before every problem of
    a shape with ``preamble_chars``: the same text on both sides, so each group shares a ~``chars``-token prefix."""
    examples = "".join(f"Q: {a}+{b}=? A: {a + b}\n" for a in range(10, 99, 7) for b in range(3, 60, 11))
    text = "Solve the sum after the examples; answer with the number only.\n" + examples * 4
    block = text[:text.rindex("\n", 0, chars) + 1]  # whole examples, then spaces up to ``chars``
    return block + " " * (chars - len(block)) if chars else ""


def add_prompt_block(chars: int) -> None:
    """Every arithmetic prompt, ours and TRL's (both ask ``make_prompt``), starts with :func:`long_prompt_block`."""
    if not chars:
        return
    from megatron.rl.environments.arithmetic import ArithmeticAgent

    block, make_prompt = long_prompt_block(chars), ArithmeticAgent.make_prompt
    ArithmeticAgent.make_prompt = lambda self, problem: block + make_prompt(self, problem)


# --------------------------------------------------------------------------- ours


def group_row_length(shape: Shape, prompt_tokens: int = 16) -> int:
    """A packed row that holds a whole group with its prompt shared: the prompt once, then every rollout's
    completion and the prompt's last token (megatron.rl.packing.prefix_sharing), rounded up to a multiple of 32."""
    return -(-(prompt_tokens + shape.group_size * (shape.new_tokens + 2)) // 32) * 32


def engine_buffer_flags(shape: Shape, prompt_tokens: int) -> list[str]:
    """A KV buffer that holds every rollout of a step at once, where the engine's CPU default (0.5 GB) does not.

    The engine's shared prefill copies a group's prompt into each rollout's own KV blocks, and shares it only
    among requests admitted in one step: rollouts that find no free blocks wait, and prefill their prompt again
    once admitted (the long shape at 16 rollouts: 64 x 9 one-MiB blocks of prompt against 512). TRL's
    ``generate`` has no such limit, so the benchmark sizes ours to the work (fp32 K and V, 64-token blocks)."""
    head_dim = shape.hidden // shape.heads
    blocks = -(-(prompt_tokens + shape.new_tokens) // 64) * shape.prompts * shape.group_size
    need_gb = blocks * 64 * shape.layers * 2 * shape.kv_groups * head_dim * 4 / 2 ** 30
    return [] if need_gb <= 0.4 else ["--inference-dynamic-batching-buffer-size-gb", str(-(-need_gb * 1.25 // 0.5) * 0.5)]


def equal_work_env_config(directory: str | Path) -> Path:
    """The arithmetic environment (as ``examples/rl/environment_configs/arithmetic.yaml``) with its own token
    budget and stop string off, so every rollout runs to ``--rl-max-new-tokens`` as TRL's do."""
    import yaml

    config = yaml.safe_load(C.ARITHMETIC_ENV.read_text())
    for entry in config["environments"]:
        entry.setdefault("args", {}).update(max_tokens=None, stop=[])
    path = Path(directory) / "arithmetic_equal_work.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def our_argv(shape: Shape, steps: int, side: str = "ours", env_config: Path | None = None) -> list[str]:
    """``train_rl.py``'s flags for one of our sides (see the module docstring)."""
    packed = side == "ours-packed"
    rollouts = shape.prompts * shape.group_size
    seq_length = group_row_length(shape, 16 + shape.preamble_chars) if packed else shape.seq_length
    micro_batch = shape.prompts if packed else rollouts  # packed: one row per group, every row in one micro-batch
    argv = (C.model_flags(shape.hidden, shape.layers, shape.heads, seq_length)
            + C.optim_flags(micro_batch, rollouts, train_iters=steps)
            + ["--group-query-attention", "--num-query-groups", str(shape.kv_groups),
               "--ffn-hidden-size", str(shape.ffn),
               "--langrl-env-config", str(env_config or C.ARITHMETIC_ENV), "--grpo-prompts-per-step",
               str(shape.prompts), "--grpo-group-size", str(shape.group_size), "--rl-max-new-tokens",
               str(shape.new_tokens), "--rl-default-temperature", "1.0", "--rl-prompts-per-eval", "0",
               "--inference-backend", "megatron"])
    argv += engine_buffer_flags(shape, 16 + shape.preamble_chars)
    if side in ("ours-padded", "ours-fixed"):
        argv += ["--rl-layout", "padded"]
    if side == "ours-fixed":
        argv += ["--rl-fixed-microbatch-shapes", "--rl-recompute-old-logprobs"]
    if packed:
        argv += ["--rl-use-sequence-packing"]
    return argv


def ignore_end_of_document() -> None:
    """The end-of-document id no longer ends a rollout of the in-process engine (TRL's ``min_new_tokens``)."""
    from megatron.rl.inference.engine.session import EosIds

    EosIds.of = classmethod(lambda cls, tokenizer: cls(-1, frozenset(), frozenset()))


def run_ours(shape: Shape, steps: int, side: str, workdir: str) -> list[dict]:
    from megatron.rl.rl_config import add_rl_args, rl_config_from_args
    from megatron.rl.rl_loop import run_rl
    from megatron.rl.training.config import parse_args

    C.quiet()
    ignore_end_of_document()
    add_prompt_block(shape.preamble_chars)
    argv = our_argv(shape, steps, side, env_config=equal_work_env_config(workdir))
    cfg = parse_args(argv, extra_args_providers=[add_rl_args], world_size=1)
    try:
        result = run_rl(cfg, rl_config_from_args(cfg))
    finally:
        C.teardown()
    # time_cpu_s: CPU seconds of the process (all threads) per iteration, from rl_iteration itself
    return [{"total": h["time_total_s"], "cpu": h["time_cpu_s"], "generate": h["time_generate_s"],
             "logprobs": h["time_logprobs_s"], "train": h["time_train_s"], "packing_efficiency": h["packing_efficiency"],
             "shared": h["prompt_tokens_shared"], "generated_tokens": h["generated_tokens"],
             "trained_tokens": h["loss_tokens"]} for h in result.history]


# --------------------------------------------------------------------------- TRL


def byte_tokenizer():
    """A ``transformers`` fast tokenizer with megatron's ByteLevelTokenizer ids (byte b -> id b), built locally."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(256)}
    vocab.update({"<eod>": EOD, "<pad>": PAD, "<bos>": BOS})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eod>", pad_token="<pad>", bos_token="<bos>",
                                   padding_side="left")


def hf_model(shape: Shape):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=shape.hidden, intermediate_size=shape.ffn,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_groups, max_position_embeddings=shape.seq_length,
                         tie_word_embeddings=True, bos_token_id=BOS, eos_token_id=EOD, pad_token_id=PAD,
                         attention_dropout=0.0, dtype=torch.float32)
    return Qwen2ForCausalLM(config).float()


def agent_problems(count: int) -> tuple[list[dict], object]:
    """The arithmetic agent's first ``count`` training problems, in the order our side draws them (a generated
    task draws problems 0, 1, 2, ...), with the prompt each is asked as, and the agent (its reward function)."""
    from megatron.rl.agent.env_config import build_agent_from_config

    agent = build_agent_from_config(C.ARITHMETIC_ENV).training_entries[0].agent
    problems = []
    for index in range(count):
        problem = agent.get_problem(index, validation=False)
        problems.append({**problem, "prompt": agent.make_prompt(problem)})
    return problems, agent


def run_trl(shape: Shape, steps: int, workdir: str) -> list[dict]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    C.quiet()
    add_prompt_block(shape.preamble_chars)
    problems, agent = agent_problems(shape.prompts * (steps + 1))
    dataset = Dataset.from_list([{"prompt": p["prompt"], "problem": json.dumps(p)} for p in problems])

    def reward(prompts, completions, problem, **_):
        return [agent.compute_reward(json.loads(p), c) for c, p in zip(completions, problem)]

    rollouts = shape.prompts * shape.group_size
    args = GRPOConfig(output_dir=workdir, per_device_train_batch_size=rollouts, gradient_accumulation_steps=1,
                      steps_per_generation=1, num_generations=shape.group_size, num_iterations=1, beta=0.0,
                      max_completion_length=shape.new_tokens, temperature=1.0, learning_rate=1e-5, max_steps=steps,
                      lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=10 ** 6, save_strategy="no",
                      report_to="none", use_cpu=True, bf16=False, disable_tqdm=True, seed=1,
                      dataloader_num_workers=0, shuffle_dataset=False,
                      # TRL's default (True) recomputes every forward in backward; ours recomputes nothing
                      gradient_checkpointing=False,
                      # every rollout generates exactly max_completion_length tokens (EOS masked until then)
                      generation_kwargs={"min_new_tokens": shape.new_tokens})
    model = hf_model(shape)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=byte_tokenizer())
    clock = {"generate": 0.0, "prepare": 0.0, "generated_tokens": 0, "trained_tokens": 0}

    def timed(fn, key):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                clock[key] += time.perf_counter() - t0
        return wrapper

    def counted(fn):
        def wrapper(*a, **k):
            out = fn(*a, **k)
            # completion_mask: the completion tokens up to and including EOS, those the loss reads
            mask = out["completion_mask"]
            clock["generated_tokens"] += int(out["completion_ids"].ne(trainer.processing_class.pad_token_id).sum())
            clock["trained_tokens"] += int(mask.sum())
            return out
        return wrapper

    model.generate = timed(model.generate, "generate")
    trainer._generate_and_score_completions = timed(counted(trainer._generate_and_score_completions), "prepare")
    records: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_a, **_k):
            clock.update(generate=0.0, prepare=0.0, generated_tokens=0, trained_tokens=0, start=time.perf_counter(),
                         cpu=time.process_time())

        def on_step_end(self, *_a, **_k):
            total = time.perf_counter() - clock["start"]
            records.append({"total": total, "cpu": time.process_time() - clock["cpu"], "generate": clock["generate"],
                            "logprobs": clock["prepare"] - clock["generate"], "train": total - clock["prepare"],
                            "generated_tokens": clock["generated_tokens"], "trained_tokens": clock["trained_tokens"]})

    trainer.add_callback(StepTimer())
    trainer.train()
    return records


def equal_work(side: dict, reference: dict, tolerance: float = EQUAL_WORK_TOLERANCE) -> str | None:
    """None when ``side`` did the same work per step as ``reference`` (generated and trained tokens within
    ``tolerance`` of the reference's), else why not (pure)."""
    problems = []
    for key in ("generated_tokens", "trained_tokens"):
        a, b = side.get(key), reference.get(key)
        if a is None or b is None:
            problems.append(f"{key} not measured")
        elif abs(a - b) > tolerance * max(abs(b), 1e-9):
            problems.append(f"{key} {a:.0f} vs {b:.0f}")
        elif b == 0:
            problems.append(f"{key} is 0")
    return "; ".join(problems) or None


# --------------------------------------------------------------------------- driver


def child(a) -> int:
    """One side, one run, in this process: per-step phase times, and the process's peak RSS, as JSON to ``--out``."""
    import resource

    import torch

    if a.threads != "auto":
        torch.set_num_threads(int(a.threads))
    shape = shape_of(a.shape, a.group_size)
    with tempfile.TemporaryDirectory() as work:
        if a.side == "trl":
            records = run_trl(shape, a.steps, work)
        else:
            records = run_ours(shape, a.steps, a.side, workdir=work)
    # ru_maxrss: the process's resident high-water mark in KiB (Linux), read the same way on every side
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(a.out).write_text(json.dumps([{**r, "peak_rss_mb": peak_mb} for r in records]))
    return 0


def trl_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None and importlib.util.find_spec("datasets") is not None


def run_side(side: str, shape: str, steps: int, threads: str, group_size: int | None = None) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "records.json"
        env = C.child_env(threads)
        cmd = [sys.executable, __file__, "--child", "--side", side, "--shape", shape, "--steps", str(steps),
               "--threads", str(threads), "--out", str(out)]
        cmd += ["--group-size", str(group_size)] if group_size else []
        proc = subprocess.run(cmd, cwd=C.REPO, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{side} on {shape} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
        return json.loads(out.read_text())[1:]  # the first step is a warm-up


def summarize(name: str, records: list[dict]) -> dict:
    out = {k: C.median([r[k] for r in records]) for k in ("total", "cpu", "generate", "logprobs", "train")}
    for key in ("packing_efficiency", "shared", "generated_tokens", "trained_tokens", "peak_rss_mb"):
        if records and key in records[0]:
            out[key] = C.median([r[key] for r in records])
    out["steps"] = len(records)
    return out


def run(a) -> dict:
    sides = [s for s in a.sides if s != "trl" or trl_available()]
    if "trl" in a.sides and "trl" not in sides:
        print("TRL not installed (pip install -e '.[bench]'): the trl column is skipped")
    if a.steps < 2:
        raise SystemExit(f"--steps={a.steps}: need >= 2 (the first step of each run is a warm-up)")
    results = {}
    co_runners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.co_runners)]
    try:
        for shape in a.shapes:
            results[shape] = run_shape(a, shape, sides)
    finally:
        for proc in co_runners:
            proc.kill()
            proc.wait()
    return results


def run_shape(a, shape: str, sides: list[str]) -> dict:
    """Every side on ``shape``, interleaved over the rounds; prints the table, returns the summary."""
    records: dict[str, list[dict]] = {s: [] for s in sides}
    rounds: dict[str, list[list[dict]]] = {s: [] for s in sides}  # each round's measured steps, per side
    for r in range(a.rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            rounds[side].append(run_side(side, shape, a.steps, a.threads, a.group_size))
            records[side] += rounds[side][-1]
            print(f"[{shape}] round {r + 1}/{a.rounds} {side}: "
                  f"{C.median([x['total'] for x in records[side]]):.3f} s/step so far", file=sys.stderr, flush=True)
    summary = {s: summarize(s, records[s]) for s in sides}
    busy = f", {a.co_runners} CPU-bound co-running process(es)" if a.co_runners else ""
    print(f"\nshape {shape}: {shape_of(shape, a.group_size).describe()}; {a.threads} threads{busy}; median of {a.rounds} "
          f"rounds x {a.steps - 1} measured steps")
    print(C.machine_line())
    rows, unequal = [], []
    for s in sides:
        m = summary[s]
        eff = f"{m['packing_efficiency']:.3f}" if "packing_efficiency" in m else "-"
        shared = f"{m['shared']:.2f}" if "shared" in m else "-"
        why = equal_work(m, summary["trl"]) if "trl" in summary else None
        if why:
            unequal.append(f"{s}: {why}")
        if "trl" not in summary or why:
            ratio = cpu_ratio = "-" if "trl" not in summary else "unequal work"
        else:
            ratio = f"{summary['trl']['total'] / m['total']:.2f}x"
            cpu_ratio = f"{summary['trl']['cpu'] / m['cpu']:.2f}x"
        tokens = [f"{m[k]:.0f}" if k in m else "-" for k in ("generated_tokens", "trained_tokens")]
        train_rate = f"{m['trained_tokens'] / m['train']:.0f}" if "trained_tokens" in m and m["train"] > 0 else "-"
        rows.append([s, f"{m['total']:.3f}", f"{m['generate']:.3f}", f"{m['logprobs']:.3f}", f"{m['train']:.3f}",
                     *tokens, train_rate, eff, shared, ratio, f"{m['cpu']:.3f}", cpu_ratio,
                     f"{m['peak_rss_mb']:.0f}" if "peak_rss_mb" in m else "-"])
    print(C.format_table(["side", "s/step (median)", "generate", "log-probs / score", "train (fwd+bwd+opt)",
                          "generated tokens", "trained tokens", "train tokens/s", "packing eff.",
                          "prompt tokens shared", "TRL s/step / this", "CPU s/step", "TRL CPU s / this",
                          "peak RSS MB"], rows, title=f"GRPO step, {shape} shape"))
    for line in unequal:
        print(f"no ratio to TRL for {line} per step (more than {EQUAL_WORK_TOLERANCE:.0%} apart)")
    if "trl" in summary:
        for s in sides:
            if s != "trl" and not any(line.startswith(f"{s}:") for line in unequal):
                print(paired_line(s, rounds[s], rounds["trl"]))
    return summary


def paired_line(side: str, ours: list[list[dict]], trl: list[list[dict]]) -> str:
    """The ratios of each round's medians, TRL's against ``side``'s run next to it: the machine's speed drifts
    over minutes, and the sides of one round ran within a minute or two of each other."""
    def per_round(key: str, inverse: bool = False) -> str:
        ratios = sorted((C.median([x[key] for x in o]) / C.median([x[key] for x in t])) if inverse else
                        (C.median([x[key] for x in t]) / C.median([x[key] for x in o])) for o, t in zip(ours, trl))
        return f"median {C.median(ratios):.2f}x (range {ratios[0]:.2f}-{ratios[-1]:.2f})"

    return (f"paired by round, {side}: TRL s/step / this {per_round('total')}; this generate / TRL's "
            f"{per_round('generate', inverse=True)}; {len(ours)} rounds")


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["small", "large"], choices=sorted(SHAPES))
    p.add_argument("--sides", nargs="+", default=list(DEFAULT_SIDES), choices=SIDES)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=4, help="steps per run (the first is a warm-up)")
    p.add_argument("--threads", default="2",
                   help="torch threads of every side (OMP_NUM_THREADS), or 'auto': no variable set, each side "
                        "chooses (ours: the CPU thread budget; TRL: torch's default)")
    p.add_argument("--co-runners", type=int, default=0,
                   help="CPU-bound processes ('while True: pass') running beside every side: a shared machine")
    p.add_argument("--group-size", type=int, default=None, help="rollouts per prompt (default: the shape's)")
    p.add_argument("--json", type=str, default=None, help="also write the summary here")
    # child mode (one side in a fresh process)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--shape", choices=sorted(SHAPES), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    if a.child:
        return child(a)
    results = run(a)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
