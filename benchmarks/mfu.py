"""Model FLOPs utilisation of a training step against the machine's measured fp32 matmul peak.

Peak: a large square fp32 ``torch.matmul`` (``--matmul-size`` n, ``2 n^3`` FLOPs), best of ``--rounds``.
Achieved: one training step (forward + backward + optimizer, megatron-core schedule, DDP, Adam; the path
of ``pretrain_gpt.py``) on full rows of random tokens with a causal mask, FLOPs by the standard formula
(:func:`_common.training_flops`):

    FLOPs/step = 6 * N * T + 12 * L * S * h * T

with T = tokens per step (batch x seq_length), N = matmul parameters (decoder weights + output layer;
the input embedding is a lookup), L layers, S sequence length, h hidden size. The optimizer's and the
norms' element-wise work is not counted (it is small and not "model" FLOPs). MFU = achieved / peak,
both taken as the best of the rounds so machine noise is treated alike; the matmul probe and the
model steps alternate within each round.

    python benchmarks/mfu.py [--models tiny small --rounds 3 --matmul-size 2048]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

# name: (layers, hidden, heads, seq_length, rows per step)
PRESETS = {
    "toy": (2, 64, 2, 64, 4),
    "tiny": (4, 128, 4, 128, 16),  # the quickstart's CPU model
    "small": (6, 384, 6, 256, 8),
}


def matmul_gflops(n: int) -> float:
    """GFLOP/s of one ``n x n @ n x n`` fp32 matmul (after the inputs exist)."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)  # first call: thread pool, allocation
    t0 = time.perf_counter()
    torch.matmul(a, b)
    return 2.0 * n ** 3 / (time.perf_counter() - t0) / 1e9


class ModelStep:
    """One preset's model + optimizer and a callable running one timed training step."""

    def __init__(self, name: str):
        import torch

        from megatron.rl.training.loop import gpt_forward_step, train_step

        layers, hidden, heads, seq, rows = PRESETS[name]
        self.name, self.layers, self.hidden, self.seq, self.rows = name, layers, hidden, seq, rows
        from megatron.rl.training.model_provider import padded_vocab_size

        tr = C.build_trainer(C.model_flags(hidden, layers, heads, seq) + C.optim_flags(rows, rows))
        self.tr = tr
        vocab = padded_vocab_size(tr.cfg, tr.tokenizer)
        self.n_matmul = C.matmul_params(tr.model, vocab, hidden)
        self.n_total = sum(p.numel() for c in tr.model for p in c.parameters())
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, tr.tokenizer.vocab_size, (rows, seq + 1), generator=g)
        self.batch = {"tokens": data[:, :-1], "labels": data[:, 1:], "loss_mask": torch.ones(rows, seq),
                      "position_ids": torch.arange(seq).expand(rows, -1),
                      "attention_mask": torch.ones(seq, seq, dtype=torch.bool).triu(1)[None, None]}
        self._train_step, self._fwd = train_step, gpt_forward_step
        self.flops = C.training_flops(self.n_matmul, rows * seq, layers, seq, hidden)

    def step(self) -> float:
        return C.timed(lambda: self._train_step(self._fwd, iter([self.batch]), self.tr.model, self.tr.optimizer,
                                                self.tr.scheduler, 1, self.seq, self.rows))


def run(a) -> dict:
    # One process holds one megatron initialisation: models are built one after another, each measured
    # in rounds alternating with the matmul probe, so probe and steps see the same machine state.
    peaks: list[float] = []
    results = {}
    for name in a.models:
        m = ModelStep(name)
        m.step()  # warm-up
        times = []
        for _ in range(a.rounds):
            peaks.append(matmul_gflops(a.matmul_size))
            times.append(m.step())
        results[name] = dict(model=m, times=times)
        C.teardown()
    peak = max(peaks)
    rows = [["matmul peak (fp32)", f"{a.matmul_size}^3", "", "", "", f"{peak:.1f}", "100%"]]
    out = {"peak_gflops": peak, "models": {}}
    for name, r in results.items():
        m, best = r["model"], min(r["times"])
        achieved = m.flops / best / 1e9
        out["models"][name] = dict(achieved_gflops=achieved, mfu=achieved / peak, step_s=best,
                                   flops_per_step=m.flops, n_matmul=m.n_matmul)
        rows.append([f"{name}: {m.layers}L h{m.hidden} S{m.seq}", f"{m.n_total / 1e6:.2f}M / {m.n_matmul / 1e6:.2f}M",
                     m.rows * m.seq, f"{m.flops / 1e9:.2f}", f"{best:.3f}", f"{achieved:.1f}",
                     f"{100 * achieved / peak:.1f}%"])
    print(C.machine_line())
    print(f"best of {a.rounds} rounds (matmul probe and training steps alternate); FLOPs/step = 6*N*T + 12*L*S*h*T")
    print(C.format_table(["model", "params total / matmul N", "tokens/step", "GFLOP/step", "step s (best)",
                          "GFLOP/s", "MFU"], rows, title="Model FLOPs utilisation (training step vs matmul peak)"))
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["tiny", "small"], choices=sorted(PRESETS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--matmul-size", type=int, default=2048)
    return p.parse_args(argv)


def main(argv=None) -> int:
    run(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
