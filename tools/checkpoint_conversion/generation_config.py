"""The converted model's ``generation_config.json``: Hugging Face ``generate()`` stops where training stopped.

- ``eos_token_id``: the end-of-document id the model was trained to end a response with (the original
  generation config's or config's when there is one; else the trained tokenizer's);
- ``stop_strings``: the stop strings of the environment an RL run trained on, when it trained on exactly one:
  read from the environment config the checkpoint records (``--langrl-env-config``, see
  :mod:`megatron.rl.training.checkpoint.run_flags`). With several environments (each its own stop strings) or
  none recorded, there are none; pass them per call instead (``generate(..., stop_strings=[...],
  tokenizer=tok)``). Hugging Face applies stop strings only with the tokenizer at hand:
  ``model.generate(**inputs, tokenizer=tok)``.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Mapping

log = logging.getLogger(__name__)

__all__ = ["environment_stop_strings", "generation_config", "write_generation_config"]

FILENAME = "generation_config.json"


def environment_stop_strings(run_flags: Mapping[str, Any] | None) -> tuple[list[str], str]:
    """(the stop strings of the one environment a run trained on, why there are none when empty)."""
    flags = (run_flags or {}).get("flags") or {}
    path = flags.get("langrl_env_config")
    if not path:
        return [], "the checkpoint records no environment config (not an RL checkpoint, or saved before they did)"
    if not Path(path).is_file():
        return [], f"its environment config {path} no longer exists"
    from megatron.rl.agent.env_config import load_env_config
    from megatron.rl.base.errors import RLError

    try:
        entries = load_env_config(path, allow_imports=bool(flags.get("langrl_allow_imports")))
    except (RLError, ImportError) as e:
        return [], f"its environment config {path} does not load: {e}"
    trained = [e for e in entries if not e.evaluation_only and e.weight > 0]
    if len(trained) != 1:
        return [], f"the run trained on {len(trained)} environments ({', '.join(e.name for e in trained)})"
    return [str(s) for s in getattr(trained[0].agent, "stop", None) or []], f"{trained[0].name} has no stop strings"


def generation_config(base: Mapping[str, Any] | None, eos_token_id: int | list[int] | None,
                      pad_token_id: int | None, stop_strings: list[str]) -> dict[str, Any]:
    """``base`` (the original generation config, or {}) with the end-of-document id and stop strings added. Pure."""
    out = dict(base or {})
    if out.get("eos_token_id") is None and eos_token_id is not None:
        out["eos_token_id"] = eos_token_id
    if out.get("pad_token_id") is None and pad_token_id is not None:
        out["pad_token_id"] = pad_token_id
    if stop_strings:
        out["stop_strings"] = list(dict.fromkeys([*(out.get("stop_strings") or []), *stop_strings]))
    out.setdefault("_from_model_config", False)
    return out


def _trained_eod(cfg) -> int | None:
    from megatron.rl.training.tokenizer import build_tokenizer

    try:
        return int(build_tokenizer(cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model).eod)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot be built here: the config's id is all there is
        return None


def write_generation_config(save: Path, hf_cfg: Mapping[str, Any], original: Path | None, cfg,
                            run_flags: Mapping[str, Any] | None) -> str:
    """Write ``save/generation_config.json``; returns what it says, for the log. ``original``: the original
    model's generation config, if any; ``cfg``: the model's parsed TrainingConfig; ``run_flags``: the checkpoint's
    recorded run flags."""
    base = json.loads(original.read_text()) if original is not None and original.is_file() else {}
    eos = hf_cfg.get("eos_token_id")
    eos = eos if eos is not None else _trained_eod(cfg)
    stop, why = environment_stop_strings(run_flags)
    out = generation_config(base, eos, hf_cfg.get("pad_token_id"), stop)
    (save / FILENAME).write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    if stop:
        return f"end-of-document id {out.get('eos_token_id')}, stop strings {stop} (the run's environment)"
    log.info("%s: no stop strings (%s); pass them to generate(..., stop_strings=[...], tokenizer=tok)", FILENAME,
             why)
    return f"end-of-document id {out.get('eos_token_id')}"
