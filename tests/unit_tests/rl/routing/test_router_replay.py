"""MoE routing replay end to end on one process: the engine records routes, the trainer's forward replays them.

A tiny MoE GPT (4 experts) generates GRPO-like groups (shared prompts prefilled once, long prompts prefilled in
chunks, requests of different lengths finishing at different steps); the rollouts are then scored as the trainer
does (packed rows, shared prompt prefixes, micro-batches cropped to their rows) with the routes replayed.

The sabotage check: with sigmoid scores and an expert bias (aux-loss-free balancing, as in DeepSeek-V3) the bias
only chooses the experts (the gates are the chosen experts' sigmoid scores, normalised), so perturbing it changes
which experts a token visits and nothing else. After such a perturbation the trainer's own routing leaves the
engine's log-probs far behind, while replaying the engine's routes gives them back to the dense bound.
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import needs_entry

from tests.unit_tests.rl.inference.scripts.megatron_common import (init_distributed, peaked_tiny_gpt,
                                                                   teacher_forced_logprobs)

MAX_GAP = 1e-5  # the dense model's fp32 train-inference bound (tests/unit_tests/rl/inference)



pytestmark = needs_entry("engine route recording")

@pytest.fixture(scope="module", autouse=True)
def _own_process_group():
    """Tear down the one-process world these tests start (later tests read the rank from $RANK without one)."""
    import torch.distributed as dist

    fresh = not dist.is_initialized()
    yield
    if fresh:
        from megatron.rl.training.initialize import destroy_megatron

        destroy_megatron()


def _requests(seed0: int = 0) -> list:
    """5 prompts x 4 rollouts (one prompt longer than an engine step: prefilled in chunks) + 2 lone prompts."""
    from megatron.rl.inference.api import GenerationArgs, InferenceRequest

    prompts = ["a", "Q: 12+7=? A:", "the quick brown fox jumps over the lazy dog " * 2, "xy", "hello world"]
    requests = [InferenceRequest(prompt=p, generation_args=GenerationArgs(temperature=1.0, max_tokens=4 + 5 * i,
                                                                          seed=seed0 + 10 * j + i))
                for j, p in enumerate(prompts) for i in range(4)]
    requests += [InferenceRequest(prompt=p, generation_args=GenerationArgs(temperature=1.0, max_tokens=9, seed=99))
                 for p in ("lone one", "another lone prompt")]
    return requests


def _engine(**moe):
    from megatron.rl.inference.megatron import EngineSettings, MegatronInference
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    model = peaked_tiny_gpt(hidden=64, layers=2, seq=128, experts=4, topk=2, **moe)
    # 48-token steps: the 88-token prompt is prefilled in two chunks
    settings = EngineSettings(block_size_tokens=16, max_tokens=48, max_requests=32, record_routes=True)
    return model, MegatronInference(model, ByteLevelTokenizer(), settings=settings)


@pytest.fixture(scope="module")
def top2():
    init_distributed(tp=1)
    model, backend = _engine()
    responses = backend.generate(_requests())
    backend.exit_inference_mode()
    assert all(r.finish_reason in ("stop", "length") for r in responses), [r.error for r in responses]
    return model, responses


def _trainer_logprobs(model, responses, replay: bool, micro_batch_size: int = 2) -> list[torch.Tensor]:
    """Each response's generated-token log-probs from the trainer's scoring forward: packed rows (rollouts of a
    group sharing their prompt), micro-batches cropped to their rows, routes replayed when ``replay``."""
    from megatron.rl.packing.microbatches import get_microbatch_dataloader
    from megatron.rl.packing.prefix_sharing import plan_shared_packing
    from megatron.rl.rl_loss import model_forward, vocab_parallel_logprobs
    from megatron.rl.sequence_packing_utils import build_packed_batch, distribute_bins

    tokens = [list(r.token_ids) for r in responses]
    masks = [[0] * r.prompt_length + [1] * (len(r.token_ids) - r.prompt_length) for r in responses]
    info = plan_shared_packing(tokens, masks, 128, 6)
    assert any(info.shared_prefix), "no rollout shares its prompt: the test would not exercise packed members"
    dist_plan = distribute_bins(info.num_bins, 1, micro_batch_size)
    routes = [r.routes.tensor().permute(1, 0, 2) for r in responses]
    batch = build_packed_batch(info, dist_plan.for_rank(0), tokens, masks, pad_token_id=0,
                               token_aligned={"routes": routes} if replay else None)
    batch.values["lp"] = torch.zeros(batch.tokens.shape)
    model.eval()
    with torch.no_grad():
        for mb in get_microbatch_dataloader(batch, micro_batch_size, dynamic_shapes=True):
            logits = model_forward(model, mb, torch.device("cpu"), use_thd=False)
            mb.values["lp"].copy_(vocab_parallel_logprobs(logits, mb.labels) * mb.loss_mask)
    model.train()
    out = []
    for s, r in enumerate(responses):  # a generated token's log-prob sits one position before it
        row = dist_plan.for_rank(0).index(info.seq_to_bin_idx[s])
        start = info.seq_starts[s] - info.skipped(s)
        out.append(batch.values["lp"][row, start + r.prompt_length - 1:start + len(r.token_ids) - 1])
    return out


def _max_gap(responses, logprobs) -> float:
    return max(float((lp - torch.tensor(r.logprobs)).abs().max()) for r, lp in zip(responses, logprobs))


def test_every_processed_token_has_its_route_and_only_the_last_has_none(top2):
    model, responses = top2
    for r in responses:
        routes = r.routes.tensor()
        assert routes.shape == (2, len(r.token_ids), 2) and r.routes.dtype == "int16"
        assert (routes[:, :-1] >= 0).all() and (routes[:, :-1] < 4).all(), "a processed token has no route"
        assert (routes[:, -1] == -1).all()  # sampled, never run through the model
        assert (routes[:, :-1].sort(-1).values.diff(dim=-1) > 0).all()  # top-2: two distinct experts
    # a group's followers (prefilled with their leader's prompt) carry the leader's prompt routes
    for g in range(5):
        group = responses[4 * g:4 * g + 4]
        n = group[0].prompt_length - 1
        assert all(torch.equal(m.routes.tensor()[:, :n], group[0].routes.tensor()[:, :n]) for m in group[1:])


def test_recorded_routes_are_the_routes_of_a_teacher_forced_forward(top2):
    """The same routes a plain one-sequence forward of the whole rollout records, row for row."""
    from megatron.rl.routing.replay import install_router_replay

    model, responses = top2
    replay_set = install_router_replay(model)
    differ = total = 0
    for r in responses:
        replay_set.record()
        teacher_forced_logprobs(model, r.token_ids, r.prompt_length, 1.0)
        own = torch.stack([t.reshape(-1, 2) for t in replay_set.recorded()])[:, :-1].sort(-1).values
        replay_set.stop()
        engine = r.routes.tensor()[:, :-1].long().sort(-1).values
        differ += int((own != engine).any(-1).sum())
        total += own.shape[0] * own.shape[1]
    assert total > 1000 and differ <= total // 200, f"{differ} of {total} routes differ"


def test_replayed_trainer_logprobs_match_the_engine_within_the_dense_bound(top2):
    from megatron.rl.routing.replay import router_replay_of

    model, responses = top2
    router_replay_of(model).take_disagreement()
    gap = _max_gap(responses, _trainer_logprobs(model, responses, replay=True))
    differ, compared = router_replay_of(model).take_disagreement()
    assert gap < MAX_GAP, f"max engine-trainer gap with replay {gap:.3g}"
    assert compared > 500 and differ <= compared // 200  # the trainer's own routers agree but for near ties


def test_a_routing_perturbation_shows_the_gap_without_replay_and_not_with_it():
    """Perturbing the expert bias after generation changes only which experts a token visits."""
    from megatron.rl.routing.replay import router_replay_of

    init_distributed(tp=1)
    model, backend = _engine(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    responses = backend.generate(_requests(seed0=7))
    backend.exit_inference_mode()
    assert all(r.finish_reason in ("stop", "length") for r in responses)
    g = torch.Generator().manual_seed(0)
    biases = [m.expert_bias for name, m in model.named_modules() if name.endswith("router")]
    assert len(biases) == 2 and all(b is not None for b in biases)
    for bias in biases:
        bias.copy_(torch.randn(bias.shape, generator=g))  # sigmoid scores are in (0, 1): this reorders them
    without = _max_gap(responses, _trainer_logprobs(model, responses, replay=False))
    router_replay_of(model).take_disagreement()
    with_replay = _max_gap(responses, _trainer_logprobs(model, responses, replay=True))
    differ, compared = router_replay_of(model).take_disagreement()
    assert differ / compared > 0.2, f"the perturbation moved only {differ} of {compared} routes"
    assert without > 100 * MAX_GAP, f"the trainer's own (perturbed) routing gave only a {without:.3g} gap"
    assert with_replay < MAX_GAP, f"max engine-trainer gap with replay {with_replay:.3g} (without {without:.3g})"


def test_a_request_held_across_an_update_keeps_each_positions_routing_from_the_step_that_computed_it():
    """Asynchronous partial rollouts: the expert bias changes while a request is paused. Positions computed before
    the pause carry the old routing, later ones the new; replaying that mix reproduces every engine log-prob,
    before and after the update, although the trainer's own routers (new bias) would route the early tokens
    elsewhere."""
    import time

    from megatron.rl.inference.api import GenerationArgs, InferenceRequest
    from megatron.rl.routing.replay import install_router_replay
    from tests.unit_tests.rl.inference.test_megatron_pause import _generate_in_thread

    init_distributed(tp=1)
    model, backend = _engine(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    biases = [m.expert_bias for name, m in model.named_modules() if name.endswith("router")]
    backend.enter_inference_mode()
    backend.set_policy_version(0)
    request = InferenceRequest(prompt="Once upon a time", generation_args=GenerationArgs(max_tokens=40, seed=3))
    thread, box = _generate_in_thread(backend, [request])
    start, deadline = backend.engine_steps, time.time() + 120
    while backend.engine_steps < start + 5 and time.time() < deadline:
        time.sleep(0.005)
    backend.pause_generation()
    old = [b.clone() for b in biases]
    g = torch.Generator().manual_seed(1)
    for bias in biases:  # the "update": only which experts each token visits changes
        bias.copy_(torch.randn(bias.shape, generator=g))
    backend.resume_generation(1)
    thread.join(timeout=300)
    backend.exit_inference_mode()
    [resp] = box["responses"]
    assert resp.finish_reason == "length", resp.error
    k = resp.policy_versions.index(1)  # token k was sampled by the first step after the update
    assert 0 < k < len(resp.policy_versions) - 5
    split = resp.prompt_length + k - 1  # positions before it were computed before the update
    recorded = resp.routes.tensor()[:, :-1].long().sort(-1).values
    replay_set = install_router_replay(model)
    new = [b.clone() for b in biases]
    own = {}
    for name, values in (("old", old), ("new", new)):  # each bias's own routing of the whole rollout
        for bias, value in zip(biases, values):
            bias.copy_(value)
        replay_set.record()
        teacher_forced_logprobs(model, resp.token_ids, resp.prompt_length, 1.0)
        own[name] = torch.stack([t.reshape(-1, 2) for t in replay_set.recorded()])[:, :-1].sort(-1).values
        replay_set.stop()
    assert torch.equal(own["old"][:, :split], recorded[:, :split])  # computed before the update: the old routing
    assert not torch.equal(own["new"][:, :split], recorded[:, :split])  # the new bias routes them otherwise
    assert not torch.equal(own["old"][:, split:], recorded[:, split:])  # and after the update, not the old routing
    # the trainer (new bias) replaying the mix reproduces the tokens of both versions
    with_replay = _max_gap([resp], _trainer_logprobs(model, [resp, resp], replay=True)[:1])
    without = _max_gap([resp], _trainer_logprobs(model, [resp, resp], replay=False)[:1])
    assert with_replay < MAX_GAP and without > 100 * MAX_GAP, (with_replay, without)
