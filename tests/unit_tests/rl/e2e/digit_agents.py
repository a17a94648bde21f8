"""A user-defined agent living outside the library, as users write them: registered by decorator in their
own module and named in the YAML config (imported with --langrl-allow-imports).

Task: answer anything with digits. The reward is dense (the fraction of generated characters that are
digits), so even a randomly initialised byte-level GPT gets a learning signal from its first samples.
"""
from megatron.rl.agent import Agent, PassAtEvaluationAgent


@Agent.register_subclass("digits_please")
class DigitsPleaseAgent(PassAtEvaluationAgent):
    max_tokens: int | None = 6
    correct_threshold: float = 0.5

    def get_problem(self, index: int, validation: bool) -> dict:
        return {"prompt": f"Say a number #{index % 7}:", "id": f"{'val' if validation else 'train'}-{index}"}

    def dataset_size(self, validation: bool):
        return 16 if validation else None

    def compute_reward(self, problem: dict, completion: str) -> float:
        if not completion:
            return 0.0
        return sum(c.isdigit() for c in completion) / len(completion)
