"""RewardOnlyAgent: the base class users subclass for a task defined by a dataset and a reward function.

A subclass provides ``dataset_size``, ``get_problem`` and ``compute_reward`` (and ``observe`` for multi-turn
episodes); this class draws prompts (deterministic, resumable, sharded by DP rank), generates concurrently and
builds :class:`~megatron.rl.base.types.TokenRollout` objects. Rewards and observations run in worker threads,
never on the event loop, bounded by ``reward_timeout_s``, unless the subclass sets ``inline_rewards = True``
(cheap, bounded rewards only).

Example subclass and reasons: docs/agents.md.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar, Sequence

from pydantic import BaseModel, Field, PrivateAttr

from megatron.rl.agent.api import (Agent, EvaluationRequest, EvaluationResponse, EvaluationResult,
                                   GroupedRolloutRequest, GroupedRolloutResponse)
from megatron.rl.agent.prompt_stream import PromptStream
from megatron.rl.inference.api import (ChatMessage, GenerationArgs, InferenceInterface, InferenceRequest,
                                       InferenceResponse)
from megatron.rl.base.routes import Routes
from megatron.rl.base.types import Rollout, RolloutGroup, TokenRollout
from megatron.rl.base.errors import RLError

logger = logging.getLogger(__name__)

__all__ = ["RewardOnlyAgent", "Turn", "merge_turn_tokens", "derive_seed"]

Problem = dict[str, Any]
Prompt = str | list[dict[str, str]]


class Turn(BaseModel):
    """One generated turn of an episode and the environment's reply to it (None: the episode ended)."""

    text: str
    finish_reason: str
    observation: str | None = None


def derive_seed(seed: int | None, *parts: int) -> int | None:
    """A reproducible per-(problem, sample, turn) seed from the request seed; None stays None (random)."""
    if seed is None:
        return None
    h = int(seed) & 0xFFFFFFFF
    for p in parts:
        h = (h * 1_000_003 + int(p) + 0x9E3779B9) & 0x7FFFFFFF
    return h


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n, limit = 0, min(len(a), len(b))
    while n < limit and a[n] == b[n]:
        n += 1
    return n


def merge_turn_tokens(prev_tokens: Sequence[int], prev_mask: Sequence[int], prev_logprobs: Sequence[float] | None,
                      response: InferenceResponse) -> tuple[list[int], list[int], list[float] | None, int]:
    """Combine the episode so far with the response to the next turn's prompt.

    The new turn's prompt (previous turns + observation, re-tokenized by the backend) normally starts with
    exactly the previous tokens; positions in the longest common prefix keep their mask and log-probs, the
    rest of the new prompt (the observation) gets mask 0, and the new generation gets mask 1. The returned
    sequence is the one the policy last conditioned on, so previously generated tokens that did not survive
    re-tokenization are dropped (mask 0): the trainer never trains on tokens the policy did not see.

    Returns ``(token_ids [L], mask [L], logprobs [L] or None, num_lost)``, ``num_lost`` counting previously
    generated tokens that were not found in the new prompt.
    """
    ids = list(response.token_ids)
    pl = response.prompt_length
    common = common_prefix(prev_tokens, ids[:pl])
    mask = list(prev_mask[:common]) + [0] * (pl - common) + [1] * (len(ids) - pl)
    num_lost = sum(prev_mask) - sum(prev_mask[:common])
    if prev_logprobs is None or response.logprobs is None:
        logprobs = None
    else:
        logprobs = list(prev_logprobs[:common]) + [0.0] * (pl - common) + list(response.logprobs)
    return ids, mask, logprobs, num_lost


class RewardOnlyAgent(Agent):
    """Dataset + prompt + reward (+ optional observations); see the module docstring.

    max_turns: generated turns per episode (1 = single-turn; >1 needs :meth:`observe`).
    stop: stop strings added to every request's ``generation_args.stop``.
    max_tokens: per-turn cap on ``generation_args.max_tokens`` (None: the request's value).
    reward_timeout_s: seconds one reward (or observation) may take before the rollout fails (None: no limit).
    """

    max_turns: int = Field(default=1, ge=1)
    stop: list[str] = Field(default_factory=list)
    max_tokens: int | None = Field(default=None, ge=1)
    reward_timeout_s: float | None = Field(default=60.0, gt=0, allow_inf_nan=False)

    _streams: dict[str, PromptStream] = PrivateAttr(default_factory=dict)
    # True only where compute_episode_reward and observe are cheap and bounded whatever the completion: they run on
    # the event loop, without a worker thread and without reward_timeout_s (see the module docstring)
    inline_rewards: ClassVar[bool] = False

    # -- what subclasses provide -----------------------------------------------------------------------------
    def dataset_size(self, validation: bool) -> int | None:
        """Number of problems in the split, or None for a generated, unbounded task."""
        return None

    def get_problem(self, index: int, validation: bool) -> Problem:
        """Problem ``index`` of the split: a JSON-able dict with at least ``"prompt"``."""
        raise NotImplementedError(f"{type(self).__name__} must implement get_problem(index, validation)")

    def make_prompt(self, problem: Problem) -> Prompt:
        """The prompt text, or chat messages ``[{"role": ..., "content": ...}]``. Default: ``problem["prompt"]``."""
        return problem["prompt"]

    def compute_reward(self, problem: Problem, completion: str) -> float:
        """Reward of a single-turn completion (generated text without the prompt)."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute_reward(problem, completion)")

    def observe(self, problem: Problem, turns: list[Turn]) -> str | None:
        """Multi-turn hook: the text the environment appends after the last turn, or None to stop."""
        return None

    def compute_episode_reward(self, problem: Problem, turns: list[Turn]) -> float:
        """Reward of a (possibly multi-turn) episode; default: :meth:`compute_reward` on the transcript."""
        return self.compute_reward(problem, _transcript(turns))

    def problem_id(self, problem: Problem, index: int, validation: bool) -> str:
        return str(problem.get("id", f"{'val' if validation else 'train'}-{index}"))

    # -- prompt order ---------------------------------------------------------------------------------------
    def _stream(self, validation: bool) -> PromptStream:
        key = "validation" if validation else "train"
        if key not in self._streams:
            self._streams[key] = self.make_prompt_stream(self.dataset_size(validation), salt=key)
        return self._streams[key]

    def _on_data_parallel_change(self) -> None:
        states = {k: s.state_dict() for k, s in self._streams.items()}
        self._streams.clear()
        for k, st in states.items():
            self._stream(k == "validation").load_state_dict(st)

    def state_dict(self) -> dict[str, Any]:
        return {"train_stream": self._stream(False).state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "train_stream" not in state:
            raise ValueError(f"agent {self.name!r}: state has no 'train_stream' (keys: {sorted(state)})")
        self._stream(False).load_state_dict(state["train_stream"])

    # -- generation -----------------------------------------------------------------------------------------
    def _turn_args(self, ga: GenerationArgs, seed: int | None, n: int = 1) -> GenerationArgs:
        stop = list(dict.fromkeys([*ga.stop, *self.stop]))
        max_tokens = min(ga.max_tokens, self.max_tokens) if self.max_tokens else ga.max_tokens
        return ga.model_copy(update={"stop": stop, "max_tokens": max_tokens, "seed": seed, "n": n})

    @staticmethod
    def _request(prompt: Prompt, ga: GenerationArgs) -> InferenceRequest:
        if isinstance(prompt, str):
            return InferenceRequest(prompt=prompt, generation_args=ga)
        return InferenceRequest(messages=[ChatMessage(**m) for m in prompt], generation_args=ga)

    def _failed(self, problem: Problem, pid: str, prompt: Prompt, reason: str, completion: str = "",
                **metadata: Any) -> Rollout:
        logger.warning("%s: rollout for %s failed: %s", self.name, pid, reason)
        return Rollout(prompt=prompt, completion=completion, reward=0.0, status="failed", failure_reason=reason,
                       env_id=self.name, problem_id=pid, metadata=metadata)

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` in the reward thread pool; raises _RewardTimeout when it runs longer than
        ``reward_timeout_s`` (timed from when it starts, not while it waits behind other rewards), or when every
        pool thread is held by a reward that overran (threads cannot be killed). With ``inline_rewards``, here."""
        if self.inline_rewards:
            return fn(*args)
        loop = asyncio.get_running_loop()
        started = loop.create_future()
        state = {"finished": False, "overran": False}

        def run() -> Any:
            loop.call_soon_threadsafe(lambda: started.done() or started.set_result(None))
            try:
                return fn(*args)
            finally:
                with _OVERRUN_LOCK:
                    state["finished"] = True
                    if state["overran"]:
                        _overrunning[0] -= 1

        work = loop.run_in_executor(_reward_pool(), run)
        while not started.done() and not work.done():
            await asyncio.wait([started, work], timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
            if not started.done() and _overrunning[0] >= _POOL_THREADS:
                work.cancel()  # still queued: it will never start
                raise _RewardTimeout(f"every reward thread is held by a reward that overran reward_timeout_s="
                                     f"{self.reward_timeout_s}")
        work.add_done_callback(lambda f: f.cancelled() or f.exception())  # an overrun's late error is not lost
        try:
            return await asyncio.wait_for(asyncio.shield(work), timeout=self.reward_timeout_s)
        except asyncio.TimeoutError:
            if work.done():
                return work.result()  # the function itself raised TimeoutError: its own error, not an overrun
            with _OVERRUN_LOCK:
                if not state["finished"]:
                    state["overran"] = True
                    _overrunning[0] += 1
            raise _RewardTimeout(f"took longer than reward_timeout_s={self.reward_timeout_s}") from None

    async def _score(self, problem: Problem, pid: str, prompt: Prompt, turns: list[Turn], tokens: list[int],
                     mask: list[int], logprobs: list[float] | None, prompt_length: int, routes: Routes | None = None,
                     **metadata: Any) -> Rollout:
        completion = _transcript(turns)
        try:
            reward = float(await self._off_loop(self.compute_episode_reward, problem, turns))
            rollout = TokenRollout(prompt=prompt, completion=completion, reward=reward, env_id=self.name,
                                   problem_id=pid, token_ids=tokens, generation_mask=mask, logprobs=logprobs,
                                   prompt_length=prompt_length, routes=routes,
                                   metadata={"finish_reasons": [t.finish_reason for t in turns],
                                             "num_turns": len(turns), **metadata})
        except _RewardTimeout as e:
            return self._failed(problem, pid, prompt, f"scoring failed: the reward {e}", completion)
        except Exception as e:  # a broken reward function or a non-finite reward: explicit failure
            return self._failed(problem, pid, prompt, f"scoring failed: {type(e).__name__}: {_clip(str(e))}",
                                completion)
        return rollout

    async def _single_turn_group(self, iface: InferenceInterface, problem: Problem, pid: str, prompt: Prompt,
                                 ga: GenerationArgs, group_size: int, seed: int | None) -> list[Rollout]:
        # One request with n samples: the backend sees the whole group at once.
        responses = await iface.agenerate([self._request(prompt, self._turn_args(ga, seed, n=group_size))])
        if len(responses) != group_size:
            raise RuntimeError(f"inference backend returned {len(responses)} responses for n={group_size}")
        out = []
        for resp in responses:
            if resp.finish_reason == "error":
                failed = self._failed(problem, pid, prompt, f"inference error: {_clip(str(resp.error))}")
                out.append(self._async_value(failed))
                continue
            mask = [0] * resp.prompt_length + [1] * (len(resp.token_ids) - resp.prompt_length)
            logprobs = None if resp.logprobs is None else [0.0] * resp.prompt_length + list(resp.logprobs)
            turns = [Turn(text=resp.text, finish_reason=resp.finish_reason)]
            out.append(self._score(problem, pid, prompt, turns, list(resp.token_ids), mask, logprobs,
                                   resp.prompt_length, resp.routes))
        return list(await asyncio.gather(*out))  # the group's rewards are computed concurrently

    @staticmethod
    async def _async_value(value: Any) -> Any:
        return value

    async def _episode(self, iface: InferenceInterface, problem: Problem, pid: str, prompt: Prompt,
                       ga: GenerationArgs, seed: int | None) -> Rollout:
        """A multi-turn episode: generate, observe, extend the prompt, until done or ``max_turns``."""
        turns: list[Turn] = []
        current: Prompt = prompt
        tokens: list[int] = []
        mask: list[int] = []
        logprobs: list[float] | None = []
        routes: Routes | None = None
        prompt_length = 0
        lost = 0
        for turn in range(self.max_turns):
            [resp] = await iface.agenerate([self._request(current, self._turn_args(ga, derive_seed(seed, turn)))])
            if resp.finish_reason == "error":
                return self._failed(problem, pid, prompt, f"inference error in turn {turn}: {_clip(str(resp.error))}",
                                    _transcript(turns))
            if turn == 0:
                prompt_length = resp.prompt_length
            kept = common_prefix(tokens, resp.token_ids[:resp.prompt_length])
            tokens, mask, logprobs, n_lost = merge_turn_tokens(tokens, mask, logprobs, resp)
            # MoE routes: earlier turns' tokens keep the routing they were generated with (as their log-probs do)
            routes = Routes.merged(routes, resp.routes, kept)
            lost += n_lost
            turns.append(Turn(text=resp.text, finish_reason=resp.finish_reason))
            if turn == self.max_turns - 1:
                break
            try:
                obs = await self._off_loop(self.observe, problem, turns)
            except _RewardTimeout as e:
                return self._failed(problem, pid, prompt, f"observe() {e}", _transcript(turns))
            except Exception as e:
                return self._failed(problem, pid, prompt, f"observe() raised {type(e).__name__}: {_clip(str(e))}",
                                    _transcript(turns))
            if obs is None:
                break
            turns[-1].observation = obs
            if isinstance(prompt, str):
                current = prompt + _transcript(turns)
            else:
                current = list(current) + [{"role": "assistant", "content": resp.text},
                                           {"role": "user", "content": obs}]
        return await self._score(problem, pid, prompt, turns, tokens, mask, logprobs, prompt_length, routes,
                                 untrained_generated_tokens=lost)

    async def _group(self, iface: InferenceInterface, index: int, validation: bool, ga: GenerationArgs,
                     group_size: int, seed: int | None) -> RolloutGroup:
        problem = self.get_problem(index, validation)
        pid = self.problem_id(problem, index, validation)
        prompt = self.make_prompt(problem)
        if self.max_turns == 1:
            rollouts = await self._single_turn_group(iface, problem, pid, prompt, ga, group_size, seed)
        else:
            rollouts = list(await asyncio.gather(*[
                self._episode(iface, problem, pid, prompt, ga, derive_seed(seed, i)) for i in range(group_size)]))
        return RolloutGroup(rollouts=rollouts, env_id=self.name, problem_id=pid)

    async def generate_grouped_rollouts(self, request: GroupedRolloutRequest) -> GroupedRolloutResponse:
        iface = self.resolve_inference(request)
        draws = self._stream(False).take(request.num_groups)
        ga = request.generation_args
        # All groups run concurrently so the backend can batch them.
        groups = await asyncio.gather(*[
            self._group(iface, index, False, ga, request.rollouts_per_group, derive_seed(ga.seed, position))
            for index, position in draws])
        return GroupedRolloutResponse(groups=list(groups))

    # -- evaluation (simple mean reward; PassAtEvaluationAgent adds pass@k and greedy) -----------------------
    def validation_indices(self, request: EvaluationRequest) -> list[int]:
        """This DP rank's share of the validation prompts, in a fixed order."""
        size = self.dataset_size(True)
        n = request.num_prompts if request.num_prompts is not None else size
        if n is None:
            raise ValueError(f"agent {self.name!r} generates its problems: EvaluationRequest.num_prompts is required")
        if size is not None:
            n = min(n, size)
        return list(range(self._dp_rank, n, self._dp_world_size))

    async def evaluate(self, request: EvaluationRequest) -> EvaluationResponse:
        iface = self.resolve_inference(request)
        ga = request.generation_args
        groups = await asyncio.gather(*[
            self._group(iface, i, True, ga, request.num_samples, derive_seed(ga.seed, i))
            for i in self.validation_indices(request)])
        results = [EvaluationResult(problem_id=g.problem_id or "", rewards=g.rewards, pass_at_k={},
                                    num_correct=sum(r.reward > 0 for r in g.rollouts if r.ok),
                                    num_failed=g.num_failed) for g in groups]
        mean = sum(g.mean_reward for g in groups) / len(groups) if groups else 0.0
        return EvaluationResponse(env_id=self.name, results=results,
                                  metrics={"mean_reward": mean, "num_prompts": float(len(groups))})


class _RewardTimeout(RLError, asyncio.TimeoutError):
    """A reward or observation overran ``reward_timeout_s`` (or could not start: see ``_off_loop``)."""


_POOL: ThreadPoolExecutor | None = None
_POOL_THREADS = 32  # rewards are short; more threads than cores keep one overrunning reward from starving the rest
_OVERRUN_LOCK = threading.Lock()
_overrunning = [0]  # rewards still running past their timeout: each holds a pool thread until it returns


def _reward_pool() -> ThreadPoolExecutor:
    """The process-wide pool rewards and observations run in (threads are created on demand)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=_POOL_THREADS, thread_name_prefix="reward")
    return _POOL


def _clip(text: str, limit: int = 300) -> str:
    """Error text from user code on untrusted output can be huge: keep messages bounded."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _transcript(turns: list[Turn]) -> str:
    return "".join(t.text + (t.observation or "") for t in turns)
