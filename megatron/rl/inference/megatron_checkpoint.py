"""The Megatron inference backend on a saved checkpoint: what ``python -m megatron.rl.server.inference
--backend megatron -- --load CKPT`` builds.

The flags after ``--`` are ``pretrain_gpt.py`` / ``train_rl.py`` flags, and the engine's flags
(``--inference-dynamic-batching-max-requests`` / ``-buffer-size-gb``, ``--cuda-graph-impl local``: see
:mod:`megatron.rl.inference.engine.engine_flags`). Without model flags
(``--num-layers`` ...) they are read from the checkpoint (``--use-checkpoint-args`` is implied; see
:mod:`megatron.rl.training.checkpoint.args`), so a checkpoint saved by this version serves from its
directory alone; older checkpoints need their model flags. Only the model weights are loaded.
"""
from __future__ import annotations

import logging
import os
from typing import Sequence

from megatron.rl.base.flags import add_flags, from_namespace
from megatron.rl.inference.api import InferenceError, backend_class
from megatron.rl.inference.engine.engine_flags import EngineFlags, validate_engine_flags
from megatron.rl.runtime import setup_runtime
from megatron.rl.training.checkpoint.args import FLAG, has_model_flags
from megatron.rl.training.checkpoint.save_load import CheckpointError, load_checkpoint
from megatron.rl.training.config import ConfigError, parse_args
from megatron.rl.training.initialize import initialize_megatron
from megatron.rl.training.model_provider import build_model, checkpoint_model_args
from megatron.rl.training.tokenizer import build_tokenizer

log = logging.getLogger(__name__)

__all__ = ["megatron_backend_from_cli"]


def megatron_backend_from_cli(argv: Sequence[str]):
    """The ``megatron`` backend (:class:`~megatron.rl.inference.megatron.MegatronInference`, from the registry)
    serving the checkpoint named by ``argv``.

    Initialises torch.distributed / megatron-core for one process (the server's). Raises
    :class:`InferenceError` for flags that cannot serve (no checkpoint, several processes) with what to do.
    """

    argv = list(argv)
    if not any(a.split("=", 1)[0] in ("--load", "--pretrained-checkpoint") for a in argv):
        raise InferenceError("the megatron backend serves a checkpoint: pass `-- --load CKPT_DIR` (model flags are "
                             "read from the checkpoint; older checkpoints also need their model flags)")
    if not has_model_flags(argv) and FLAG not in argv:
        argv.append(FLAG)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise InferenceError(f"the megatron backend serves from one process (WORLD_SIZE={world}): start the "
                             "server without torchrun; for model-parallel serving use train_rl.py's "
                             "--rl-serve-inference or convert the checkpoint to Hugging Face and use vLLM")
    try:
        cfg = parse_args(argv, extra_args_providers=[lambda parser: add_flags(parser, EngineFlags)], world_size=1)
        engine = from_namespace(EngineFlags, cfg.extra)
        validate_engine_flags(engine, "megatron")
    except ConfigError as e:
        raise InferenceError(str(e)) from e
    initialize_megatron(cfg)
    tokenizer = build_tokenizer(cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model)
    model = build_model(cfg, wrap_with_ddp=False, tokenizer=tokenizer)
    path = cfg.checkpoint.load or cfg.checkpoint.pretrained_checkpoint
    try:
        loaded = load_checkpoint(path, model, None, None, load_optimizer=False, load_rng=False,
                                 model_args=checkpoint_model_args(cfg, tokenizer),
                                 newest=cfg.checkpoint.load_newest_checkpoint)
    except CheckpointError as e:
        raise InferenceError(f"cannot serve {path}: {e}") from e
    log.info("serving %s (iteration %s)", loaded.path, loaded.iteration)
    from megatron.rl.inference.engine.build import EngineSettings  # megatron-core's engine: after the checks

    settings = EngineSettings.from_flags(setup_runtime().device, engine)
    return backend_class("megatron")(model[0], tokenizer, settings=settings)
