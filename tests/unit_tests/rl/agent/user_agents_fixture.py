"""A user-defined agent in the user's own module, exactly as examples/rl/README.md shows (used by tests)."""
from megatron.rl.agent import Agent, PassAtEvaluationAgent

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "grape"]


@Agent.register_subclass("reverse_word")
class ReverseWordAgent(PassAtEvaluationAgent):
    """Reverse a word: "Reverse apple:" -> " elppa"."""

    stop: list[str] = ["\n"]
    max_tokens: int | None = 8

    def dataset_size(self, validation: bool) -> int:
        return len(WORDS)

    def get_problem(self, index: int, validation: bool) -> dict:
        word = WORDS[index]
        return {"prompt": f"Reverse {word}:", "answer": word[::-1], "id": word}

    def compute_reward(self, problem: dict, completion: str) -> float:
        return 1.0 if completion.strip() == problem["answer"] else 0.0
