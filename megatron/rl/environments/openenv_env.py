"""``type: openenv``: an OpenEnv environment (``reset`` / ``step`` with typed actions and observations, rubrics)
played by the policy over one or more turns, token-in/token-out.

:class:`OpenEnvAgent` runs the named ``Environment`` in-process, one instance per episode: the policy generates
from the episode's exact tokens, ``step(Action(**{action_field: text}))`` answers, until ``done`` or
``max_turns``; the reward is the observations' (summed, or ``reward: last``) and rubric scores go to
``metadata["reward_components"]``. Failures fail the rollout with their reason. It never imports the
environment's module itself (the env config's ``imports:`` does); ``openenv-core`` loads through
``import_optional``. Configuration and episode rules: docs/environments.md.
"""
from __future__ import annotations

import asyncio
import hashlib
import sys
import typing
from typing import Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, field_validator

from megatron.rl.agent.api import Agent
from megatron.rl.agent.pass_at_evaluation_agent import PassAtEvaluationAgent
from megatron.rl.agent.reward_only_agent import _clip, _RewardTimeout, derive_seed
from megatron.rl.agent.token_episode import TokenEpisode, TokenMismatchError
from megatron.rl.base.optional import import_optional
from megatron.rl.base.types import Rollout, RolloutGroup, TokenRollout
from megatron.rl.inference.api import GenerationArgs, InferenceInterface
from megatron.rl.base.errors import RLError

__all__ = ["OpenEnvAgent", "rubric_scores"]


def rubric_scores(env: Any) -> dict[str, float]:
    """``{"rubric": score, "<child path>": score, ...}`` from the environment's rubric tree (scored ones only)."""
    rubric = getattr(env, "rubric", None)
    if rubric is None:
        return {}
    named = [("rubric", rubric), *list(rubric.named_rubrics())] if hasattr(rubric, "named_rubrics") else \
        [("rubric", rubric)]
    return {name: float(r.last_score) for name, r in named if getattr(r, "last_score", None) is not None}


def _action_class(env: Any) -> type | None:
    """The Action type an Environment subclass declares as its first generic argument (None if it does not)."""
    for klass in type(env).__mro__:
        for base in getattr(klass, "__orig_bases__", ()):
            args = typing.get_args(base)
            if args and isinstance(args[0], type):
                return args[0]
    return None


class _EnvFailure(RLError):
    """The environment (or the policy's action for it) failed: the rollout fails with this reason."""


@Agent.register_subclass("openenv")
class OpenEnvAgent(PassAtEvaluationAgent):
    """An OpenEnv environment as a (multi-turn) agent (see the module docstring).

    environment: ``module:attr``, an Environment subclass or a factory (its module already imported).
    env_args: keyword arguments for it. action_class: ``module:attr`` of the Action type (default: the
    environment's declared one). action_field / observation_field: the text fields. reward: ``sum`` of the
    step rewards or the ``last`` one. validation_size: episodes per evaluation.
    """

    environment: str
    env_args: dict[str, Any] = Field(default_factory=dict)
    action_class: str | None = None
    action_field: str = "text"
    observation_field: str = "text"
    max_turns: int = Field(default=4, ge=1)
    reward: Literal["sum", "last"] = "sum"
    validation_size: int = Field(default=100, ge=1)

    _factory: Any = PrivateAttr(default=None)
    _action_type: type | None = PrivateAttr(default=None)

    @field_validator("environment", "action_class")
    @classmethod
    def _import_path(cls, v: str | None) -> str | None:
        if v is not None and (v.count(":") != 1 or not all(v.split(":"))):
            raise ValueError(f"{v!r} must be 'module:attribute' (e.g. my_envs.guessing:GuessEnv)")
        return v

    def model_post_init(self, context: Any) -> None:
        import_optional("openenv.core.env_server.interfaces", "openenv", "type: openenv")
        self._factory = _resolve(self.environment, "environment")
        if self.action_class is not None:
            self._action_type = _resolve(self.action_class, "action_class")

    def dataset_size(self, validation: bool) -> int | None:
        return self.validation_size if validation else None

    def get_problem(self, index: int, validation: bool) -> dict:
        split = "val" if validation else "train"
        seed = int(hashlib.sha256(f"openenv:{self.seed}:{split}:{index}".encode()).hexdigest()[:8], 16)
        return {"prompt": "", "id": f"{split}-{index}", "seed": seed}

    # -- episodes ----------------------------------------------------------------------------------------------
    async def _group(self, iface: InferenceInterface, index: int, validation: bool, ga: GenerationArgs,
                     group_size: int, seed: int | None) -> RolloutGroup:
        problem = self.get_problem(index, validation)
        rollouts = await asyncio.gather(*[self._play(iface, problem, ga, derive_seed(seed, i))
                                          for i in range(group_size)])
        return RolloutGroup(rollouts=list(rollouts), env_id=self.name, problem_id=problem["id"])

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """An environment call, off the event loop and bounded by reward_timeout_s; failures become _EnvFailure."""
        name = getattr(fn, "__name__", "call")
        try:
            return await self._off_loop(lambda: fn(*args, **kwargs))
        except _RewardTimeout as e:
            raise _EnvFailure(f"openenv: {name}() {e}") from None
        except Exception as e:  # noqa: BLE001 - user environment code: its failure fails this rollout only
            raise _EnvFailure(f"openenv: {name}() raised {type(e).__name__}: {_clip(str(e))}") from None

    def _text(self, observation: Any) -> str:
        if not hasattr(observation, self.observation_field):
            raise _EnvFailure(f"openenv: the observation ({type(observation).__name__}) has no field "
                              f"{self.observation_field!r} (observation_field)")
        return str(getattr(observation, self.observation_field) or "")

    def _action(self, env: Any, text: str) -> Any:
        action_type = self._action_type or _action_class(env)
        if action_type is None:
            raise _EnvFailure(f"openenv: {type(env).__name__} declares no Action type; set action_class")
        try:
            return action_type(**{self.action_field: text})
        except (ValidationError, TypeError) as e:
            raise _EnvFailure(f"openenv: {action_type.__name__}({self.action_field}=...) rejected the completion: "
                              f"{_clip(str(e))}") from None

    async def _play(self, iface: InferenceInterface, problem: dict, ga: GenerationArgs,
                    seed: int | None) -> Rollout:
        episode, texts, rewards = TokenEpisode(), [], []
        prompt, components, done = "", {}, False
        try:
            env = await self._call(self._factory, **self.env_args)
            observation = await self._call(env.reset, seed=problem["seed"])
            prompt = text = self._text(observation)
            finish = []
            for turn in range(self.max_turns):
                [resp] = await iface.agenerate([episode.next_request(text, self._turn_args(ga, derive_seed(seed, turn)))])
                if resp.finish_reason == "error":
                    raise _EnvFailure(f"inference error in turn {turn}: {_clip(str(resp.error))}")
                episode.add(resp)
                finish.append(resp.finish_reason)
                observation = await self._call(env.step, self._action(env, resp.text))
                rewards.append(getattr(observation, "reward", None))
                components = rubric_scores(env) or components
                done = bool(getattr(observation, "done", False))
                text = self._text(observation)
                texts += [resp.text, text if not done else ""]
                if done:
                    break
        except (_EnvFailure, TokenMismatchError) as e:
            return self._failed(problem, problem["id"], prompt, str(e), "".join(texts))
        given = [float(r) for r in rewards if r is not None]
        reward = (sum(given) if self.reward == "sum" else (given[-1] if given else 0.0))
        return TokenRollout(prompt=prompt, completion="".join(texts), reward=reward, env_id=self.name,
                            problem_id=problem["id"], token_ids=episode.token_ids,
                            generation_mask=episode.generation_mask, logprobs=episode.logprobs,
                            prompt_length=episode.prompt_length,
                            metadata={"finish_reasons": finish, "num_turns": episode.turns, "done": done,
                                      "reward_components": components})


def _resolve(path: str, what: str) -> Any:
    module_name, _, attr = path.partition(":")
    module = sys.modules.get(module_name)
    if module is None:
        raise ValueError(f"{what}: module {module_name!r} is not imported; list it under the env config's "
                         "'imports:' (with --langrl-allow-imports) or import it before building the agent")
    obj = getattr(module, attr, None)
    if obj is None or not callable(obj):
        raise ValueError(f"{what}: {module_name!r} has no class or factory {attr!r}")
    return obj
