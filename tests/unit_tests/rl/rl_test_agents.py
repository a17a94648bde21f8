"""User-defined agents for the train_rl.py tests (named in env configs as ``module:Class``).

HashReward: a reward that varies between samples even for a random-weight model (a function of the
completion's bytes), so advantages, losses and gradients are non-zero from the first iteration.
NaNReward: a broken reward function. LongPrompt: prompts longer than any tiny --seq-length.
EmptyDataset: a dataset with no problems. HashPassAt: HashReward with pass@k evaluation (correct: reward >= 0.5).
ConstantAnswer: HashReward whose every rollout records the answer "7" (a collapse to a constant answer).
"""
from megatron.rl.agent import PassAtEvaluationAgent, RewardOnlyAgent


class HashReward(RewardOnlyAgent):
    stop: list[str] = []

    def get_problem(self, index: int, validation: bool) -> dict:
        return {"prompt": f"Q{index % 97}:", "id": f"{'v' if validation else 't'}{index}"}

    def compute_reward(self, problem: dict, completion: str) -> float:
        return (sum(completion.encode("utf-8", "replace")) % 11) / 10.0


class NaNReward(HashReward):
    def compute_reward(self, problem: dict, completion: str) -> float:
        return float("nan")


class LongPrompt(HashReward):
    def get_problem(self, index: int, validation: bool) -> dict:
        return {"prompt": "x" * 300 + f"{index}:", "id": f"long{index}"}


class EmptyDataset(HashReward):
    def dataset_size(self, validation: bool) -> int:
        return 0


class NearLimitPrompt(HashReward):
    """Prompts that fit --seq-length 64 but leave less room than --rl-max-new-tokens."""

    def get_problem(self, index: int, validation: bool) -> dict:
        return {"prompt": "y" * 57 + f"{index % 10}:", "id": f"near{index}"}


class HalfConstant(HashReward):
    """Problems with an odd index get the same reward for every sample (a group without signal)."""

    def get_problem(self, index: int, validation: bool) -> dict:
        return {"prompt": f"Q{index % 97}:", "id": f"h{index}", "constant": index % 2 == 1}

    def compute_reward(self, problem: dict, completion: str) -> float:
        return 0.5 if problem["constant"] else super().compute_reward(problem, completion)


class HashPassAt(PassAtEvaluationAgent, HashReward):
    correct_threshold: float = 0.5


class ConstantAnswer(HashReward):
    """Every rollout records the same answer (``metadata["extracted_answer"]``): a policy collapsed to a constant
    answer, as the per-environment health checks see it."""

    async def _score(self, *args, **metadata):
        return await super()._score(*args, extracted_answer="7", **metadata)
