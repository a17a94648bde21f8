"""torchrun --nproc-per-node 2: load converted checkpoints at TP=2 and compare logits with the Hugging Face model.

argv: OUT_JSON (HF_DIR CKPT_DIR)...  Rank 0 writes {ckpt: {"max_abs_diff": float, "qkv_rows": [...]}} to OUT_JSON.
Each loaded model is also saved as a training checkpoint (iteration 5, TP=2) to CKPT_DIR + "_tp2_trained", so the
test can convert a TP=2 checkpoint back to Hugging Face.
The model is built by the training code path (parse_args -> initialize_megatron -> build_model) from the
checkpoint's megatron_args.txt, and loaded with load_checkpoint(model_args=...), as a training run would.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from megatron.rl.runtime import setup_runtime

    setup_runtime()
    from megatron.core import parallel_state as ps
    from transformers import AutoModelForCausalLM

    from megatron.rl.training.checkpoint.save_load import load_checkpoint, save_checkpoint
    from megatron.rl.training.initialize import initialize_megatron
    from megatron.rl.training.model_provider import build_model, unwrap_model
    from tiny_hf_models import hf_logits, megatron_logits
    from tools.checkpoint_conversion.hf_to_megatron import parse_megatron_flags
    from tools.checkpoint_conversion.megatron_to_hf import read_flags_file

    out_json, pairs = sys.argv[1], sys.argv[2:]
    results = {}
    for hf_dir, ckpt in zip(pairs[0::2], pairs[1::2]):
        cfg = parse_megatron_flags(read_flags_file(Path(ckpt) / "megatron_args.txt"), tp=2, pp=1)
        initialize_megatron(cfg)
        model = unwrap_model(build_model(cfg, wrap_with_ddp=False))[0]
        load_checkpoint(ckpt, [model], load_optimizer=False, load_rng=False, model_args=cfg.model_args())
        torch.manual_seed(0)
        tokens = torch.randint(0, cfg.tokenizer.vocab_size, (2, 11))
        local = megatron_logits(model, tokens)                       # [b, s, padded_vocab / 2]
        parts = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(parts, local.contiguous(), group=ps.get_tensor_model_parallel_group())
        full = torch.cat(parts, dim=-1)[..., :cfg.tokenizer.vocab_size]
        ref = hf_logits(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(), tokens)
        qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
        rows = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
        dist.all_gather(rows, torch.tensor([qkv.shape[0]]))
        results[ckpt] = {"max_abs_diff": float((full - ref).abs().max()), "ref_abs_max": float(ref.abs().max()),
                         "qkv_rows": [int(r) for r in rows]}
        save_checkpoint(ckpt + "_tp2_trained", 5, [model], model_args=cfg.model_args())
    if dist.get_rank() == 0:
        Path(out_json).write_text(json.dumps(results))
    dist.barrier()


if __name__ == "__main__":
    main()
