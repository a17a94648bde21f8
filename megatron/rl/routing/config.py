"""``--rl-router-replay``: its modes and the checks that need no model (run before any model is built)."""
from __future__ import annotations

from megatron.rl.runtime import patches, versions
from megatron.rl.training.config import ConfigError
from megatron.rl.base.errors import RLError

__all__ = ["REPLAY_MODES", "RouterReplayConfigError", "RouterReplayError", "validate_router_replay"]

REPLAY_MODES = ("off", "rollout")


class RouterReplayError(RLError, RuntimeError):
    """Routing replay cannot run on this data or model (rollouts without routes, routes of another model)."""


class RouterReplayConfigError(ConfigError):
    """``--rl-router-replay`` asked for with flags it cannot work with (exit status 2 at the command line)."""


# The registry entry of the engine's route recording (megatron.rl.runtime.subclasses)
ENGINE_ROUTE_RECORDING = "engine route recording"


def validate_router_replay(mode: str, *, num_experts: int | None, inference_backend: str, records_routes: bool,
                           recompute_granularity: str | None, load_balancing: str) -> None:
    """Raise :class:`RouterReplayConfigError` for what ``--rl-router-replay rollout`` cannot work with: a dense model,
    a backend that records no routes (``records_routes``, the ability its class declares: false for HF, OpenAI,
    fake), full activation recomputation, sinkhorn routing."""
    if mode == "off":
        return
    flag = f"--rl-router-replay {mode}"
    problem = None
    if num_experts is None:
        problem = f"{flag} replays MoE routing, but the model is dense (no --num-experts): drop {flag}."
    elif not records_routes:
        problem = (f"{flag} needs the routes the in-process engine records, but --inference-backend="
                   f"{inference_backend} returns none: use --inference-backend megatron or drop {flag}.")
    elif recompute_granularity == "full":
        problem = (f"{flag} with --recompute-granularity full is not supported: the backward pass re-runs the routers "
                   f"after the replayed routes are cleared. Use --recompute-granularity selective or none.")
    elif load_balancing == "sinkhorn":
        problem = f"{flag} cannot replay --moe-router-load-balancing-type sinkhorn (not a top-k routing)."
    elif not patches.covers_installed(ENGINE_ROUTE_RECORDING):  # a release the recording was not written for
        written = ", ".join(patches.REGISTRY[ENGINE_ROUTE_RECORDING].versions)
        problem = (f"{flag} needs the in-process engine to record routes, which megatron-rl does on megatron-core "
                   f"{written} (installed: {versions.installed_version()}): install one of those releases or drop "
                   f"{flag}.")
    if problem:
        raise RouterReplayConfigError(problem)
