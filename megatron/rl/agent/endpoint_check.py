"""Reward endpoints reachable before a model is built.

A judge served over HTTP (``judge: {inference: {backend: openai, kwargs: {base_url: ...}}}``, at any depth of
the environment config) is asked ``GET <base_url>/models`` with a short timeout at start-up. Any HTTP answer,
even 401 or 404, shows the endpoint is there; a refused connection, an unknown host or a timeout is a
:class:`RewardEndpointError` (a one-line error, exit status 2) instead of a run that fails every rollout
after minutes of building and loading the model.
"""
from __future__ import annotations

import urllib.error
import urllib.request
from typing import Any, Iterator

from pydantic import BaseModel

from megatron.rl.agent.judge import JudgeConfig
from megatron.rl.base.errors import UserError

__all__ = ["RewardEndpointError", "reward_endpoints", "check_reward_endpoints"]

CHECK_TIMEOUT_S = 5.0


class RewardEndpointError(UserError, ConnectionError):
    """A judge or reward-model endpoint of the environment config does not answer."""


def _walk(obj: Any, where: str, seen: set[int]) -> Iterator[tuple[str, Any]]:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield where, obj
    if isinstance(obj, BaseModel):
        for name in type(obj).model_fields:
            yield from _walk(getattr(obj, name, None), f"{where}.{name}", seen)
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from _walk(item, f"{where}[{i}]", seen)
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from _walk(item, f"{where}.{key}", seen)


def reward_endpoints(agent: Any) -> list[tuple[str, str]]:
    """(where in the config, base URL) of every judge served over HTTP under ``agent``."""
    out = []
    for where, obj in _walk(agent, getattr(agent, "name", "agent"), set()):
        if isinstance(obj, JudgeConfig) and obj.inference is not None:
            url = obj.inference.kwargs.get("base_url")
            if isinstance(url, str) and url:
                out.append((f"{where}.inference.kwargs.base_url", url))
    return out


def check_reward_endpoints(agent: Any, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Raise :class:`RewardEndpointError` naming the first endpoint under ``agent`` that does not answer."""
    for where, url in reward_endpoints(agent):
        probe = url.rstrip("/") + "/models"
        try:
            with urllib.request.urlopen(urllib.request.Request(probe, method="GET"), timeout=timeout_s):
                pass
        except urllib.error.HTTPError:
            continue  # it answered: reachable (authorization and routes are the backend's business)
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            raise RewardEndpointError(f"{where}={url} does not answer ({probe}: {reason}); start the judge server, "
                                      f"fix the URL in the environment config, or remove the judge") from None
