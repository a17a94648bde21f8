"""Request seeds the trainer derives: valid for every backend and server, and stable."""
import hashlib

from megatron.rl.agent.reward_only_agent import derive_seed as agent_seed
from megatron.rl.inference.api import GenerationArgs
from megatron.rl.inference.validation import SEED_MAX
from megatron.rl.rollout.collection import derive_seed


def test_derived_request_seeds_validate_and_keep_the_bits_agents_use():
    for parts in [(1, "rollouts", b, r) for b in range(200) for r in range(4)] + [(7, "eval", r) for r in range(50)]:
        seed = derive_seed(*parts)
        assert 0 <= seed <= SEED_MAX
        assert GenerationArgs(seed=seed).seed == seed  # what a remote environment server validates too
        # agents derive per-sample seeds from the low 32 bits: those of the hash's first 60 bits, as written
        first60 = int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:15], 16)
        assert agent_seed(seed, 3) == agent_seed(first60, 3)
    assert derive_seed(1, "rollouts", 0, 0) == derive_seed(1, "rollouts", 0, 0)
    assert len({derive_seed(1, "rollouts", b, 0) for b in range(200)}) == 200
