"""pass@k evaluation: ``n`` samples plus one greedy decode per validation prompt.

The unbiased estimator of pass@k from ``n`` samples of which ``c`` are correct is
``1 - C(n - c, k) / C(n, k)``: the probability that a random size-``k`` subset of the samples contains at
least one correct one. It is computed as a product, ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``, which never
forms the (huge) binomial coefficients.
"""
from __future__ import annotations

import asyncio

from pydantic import Field

from megatron.rl.agent.api import EvaluationRequest, EvaluationResponse, EvaluationResult
from megatron.rl.agent.reward_only_agent import RewardOnlyAgent, derive_seed

__all__ = ["PassAtEvaluationAgent", "pass_at_k"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct (``0 <= c <= n``, ``1 <= k <= n``)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every size-k subset contains a correct sample
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


class PassAtEvaluationAgent(RewardOnlyAgent):
    """A :class:`RewardOnlyAgent` whose :meth:`evaluate` reports pass@k and greedy accuracy.

    correct_threshold: a sample counts as correct when it is ``ok`` and its reward is at least this.
    Metrics (means over this rank's validation prompts): ``pass@K`` for each K of the request,
    ``greedy_accuracy``, ``mean_reward`` (sampled), ``failed_fraction``, ``num_prompts``.
    """

    correct_threshold: float = Field(default=1.0)

    def _correct(self, rollout) -> bool:
        return rollout.ok and rollout.reward >= self.correct_threshold

    async def _evaluate_one(self, iface, index: int, request: EvaluationRequest) -> EvaluationResult:
        ga = request.generation_args
        seed = derive_seed(ga.seed if ga.seed is not None else self.seed, index)
        sampled = self._group(iface, index, True, ga, request.num_samples, seed)
        if request.greedy:
            greedy_args = ga.model_copy(update={"temperature": 0.0})
            greedy = self._group(iface, index, True, greedy_args, 1, seed)
            sampled_group, greedy_group = await asyncio.gather(sampled, greedy)
        else:
            sampled_group, greedy_group = await sampled, None
        rollouts = sampled_group.rollouts
        n, c = len(rollouts), sum(self._correct(r) for r in rollouts)
        result = EvaluationResult(problem_id=sampled_group.problem_id or str(index), rewards=sampled_group.rewards,
                                  num_correct=c, pass_at_k={k: pass_at_k(n, c, k) for k in request.resolved_ks},
                                  num_failed=sampled_group.num_failed)
        if greedy_group is not None:
            g = greedy_group.rollouts[0]
            result.greedy_reward = g.reward if g.ok else 0.0
            result.greedy_completion = g.completion
        return result

    async def evaluate(self, request: EvaluationRequest) -> EvaluationResponse:
        iface = self.resolve_inference(request)
        results = list(await asyncio.gather(*[self._evaluate_one(iface, i, request)
                                              for i in self.validation_indices(request)]))
        metrics: dict[str, float] = {"num_prompts": float(len(results))}
        if results:
            for k in request.resolved_ks:
                metrics[f"pass@{k}"] = sum(r.pass_at_k[k] for r in results) / len(results)
            samples = [x for r in results for x in r.rewards]
            metrics["mean_reward"] = sum(samples) / len(samples)
            metrics["failed_fraction"] = sum(r.num_failed for r in results) / len(samples)
            if request.greedy:
                metrics["greedy_accuracy"] = sum(
                    (r.greedy_reward or 0.0) >= self.correct_threshold for r in results) / len(results)
        return EvaluationResponse(env_id=self.name, results=results, metrics=metrics)
