"""OpenEnv environments written the way OpenEnv users write them (typed Action / Observation, a rubric tree),
for the type: openenv adapter's tests."""
from __future__ import annotations

import random
from typing import Any, Optional

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from openenv.core.rubrics.base import Rubric
from openenv.core.rubrics.containers import WeightedSum


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    prompt: str = ""


class _Correct(Rubric):
    def forward(self, action, observation) -> float:
        return float(observation.metadata.get("correct", False))


class _Short(Rubric):
    def forward(self, action, observation) -> float:
        return 1.0 if len(action.guess) <= 3 else 0.0


class GuessRubric(Rubric):
    def __init__(self):
        super().__init__()
        self.total = WeightedSum([_Correct(), _Short()], [0.8, 0.2])

    def forward(self, action, observation) -> float:
        return self.total(action, observation)


class GuessEnv(Environment[GuessAction, GuessObservation, State]):
    """Guess a number in 1..max_number; after a wrong guess the environment says "higher" or "lower".
    The episode ends at the right guess (rubric: 0.8 for correct + 0.2 for a guess of at most 3 characters)."""

    def __init__(self, max_number: int = 9):
        super().__init__(rubric=GuessRubric())
        self.max_number = max_number
        self._state = State()
        self._target = 1

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kw: Any) -> GuessObservation:
        self._target = random.Random(seed).randint(1, self.max_number)
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(prompt=f"Guess 1-{self.max_number}:")

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kw: Any) -> GuessObservation:
        self._state.step_count += 1
        text = action.guess.strip()
        if text == "boom":
            raise RuntimeError("the environment crashed on purpose")
        correct = text == str(self._target)
        hint = "" if correct else ("\nhigher:" if not text.isdigit() or int(text) < self._target else "\nlower:")
        obs = GuessObservation(prompt=hint, done=correct, metadata={"correct": correct})
        obs.reward = self.rubric(action, obs)
        return obs

    @property
    def state(self) -> State:
        return self._state
