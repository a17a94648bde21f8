"""``--rl-router-replay``: what it cannot work with is a named error before any model is built, and the pure pieces
of the trainer's replay (token order of the routers, the disagreement count)."""
from __future__ import annotations

import pytest
import torch

from megatron.rl.routing.config import RouterReplayConfigError
from tests.conftest import needs_entry
from tests.unit_tests.rl.test_rl_config import BASE, _rl, env_yaml  # noqa: F401 (fixture)

MOE = ["--num-experts", "4", "--moe-router-topk", "2"]


@needs_entry("engine route recording")
def test_replay_on_a_moe_model_with_the_in_process_engine_is_valid(env_yaml):  # noqa: F811
    assert _rl(env_yaml, *MOE, "--rl-router-replay", "rollout").router_replay == "rollout"
    assert _rl(env_yaml).router_replay == "off"


@pytest.mark.parametrize("extra,words", [
    ([], ["dense", "--num-experts"]),
    ([*MOE, "--inference-backend", "huggingface"], ["--inference-backend=huggingface", "returns none"]),
    ([*MOE, "--inference-backend", "openai", "--inference-server-url", "http://x"], ["--inference-backend=openai"]),
    ([*MOE, "--inference-backend", "fake"], ["--inference-backend=fake"]),
    ([*MOE, "--recompute-granularity", "full"], ["--recompute-granularity full"]),
    ([*MOE, "--moe-router-load-balancing-type", "sinkhorn"], ["sinkhorn"]),
])
def test_what_replay_cannot_work_with_is_a_named_error(env_yaml, extra, words):  # noqa: F811
    with pytest.raises(RouterReplayConfigError) as e:
        _rl(env_yaml, *extra, "--rl-router-replay", "rollout")
    for word in ["--rl-router-replay rollout", *words]:
        assert word in str(e.value), str(e.value)


def test_train_rl_exits_2_before_building_a_model(env_yaml, capsys, monkeypatch):  # noqa: F811
    import importlib.util

    import megatron.rl.rl_loop as rl_loop
    from tests.conftest import REPO_ROOT

    spec = importlib.util.spec_from_file_location("train_rl_main", REPO_ROOT / "train_rl.py")
    train_rl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_rl)
    monkeypatch.setattr(rl_loop, "run_rl", lambda *a: pytest.fail("a model was built"))
    argv = [*BASE, "--langrl-env-config", str(env_yaml), "--grpo-prompts-per-step", "4", "--grpo-group-size", "4",
            "--rl-max-new-tokens", "8", "--rl-router-replay", "rollout"]
    assert train_rl.main(argv) == 2
    assert "train_rl.py: error: RouterReplayConfigError: --rl-router-replay rollout replays MoE routing, but the " \
           "model is dense" in capsys.readouterr().err


def test_router_token_order_of_packed_rows_thd_and_sequence_parallel_shares():
    from megatron.rl.routing.replay import router_token_order

    rows, s = 3, 4
    routes = torch.tensor([[[[10 * r + p]] for p in range(s)] for r in range(rows)])  # [rows, S, 1 layer, k=1]
    # [rows, S] micro-batches run as [S, rows]: position-major
    assert router_token_order(routes, thd=False)[:, 0, 0].tolist() == [10 * r + p for p in range(s)
                                                                         for r in range(rows)]
    assert router_token_order(routes, thd=True)[:, 0, 0].tolist() == [10 * r + p for r in range(rows)
                                                                        for p in range(s)]
    whole = router_token_order(routes, thd=False)
    shares = [router_token_order(routes, thd=False, sp_rank=i, sp_size=2) for i in range(2)]
    assert torch.equal(torch.cat(shares), whole)


def test_replayed_rows_keep_targets_and_count_where_the_router_differed():
    """One router call: rows with a target take it (gates gathered at it), rows of -1 keep the router's choice."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron.rl.routing.replay_slot import RolloutRouterReplay

    replay = RolloutRouterReplay()
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.3], [0.2, 0.8, 0.7, 0.1], [0.4, 0.3, 0.2, 0.1]])
    replay.set_target_indices(torch.tensor([[0, 2], [3, 0], [-1, -1]]))
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    probs, idx = replay.get_replay_topk(scores, 2, default_compute_topk=lambda x, k, **_: torch.topk(x, k, dim=1))
    assert idx.tolist() == [[0, 2], [3, 0], [0, 1]]
    assert torch.equal(probs, scores.gather(1, idx))
    assert (int(replay.differ), int(replay.compared)) == (1, 2)  # row 0 agreed with the router, row 1 did not


def test_rollout_replay_is_refused_where_the_engine_does_not_record_routes(monkeypatch):
    """On a megatron-core release the engine's route recording was not written for the flag is refused before any
    model is built, naming the releases it was written for and the installed one."""
    from megatron.rl.routing import config
    from megatron.rl.runtime import patches

    kwargs = dict(num_experts=4, inference_backend="megatron", records_routes=True, recompute_granularity=None, load_balancing="aux_loss")
    monkeypatch.setattr(patches, "covers_installed", lambda name: name != config.ENGINE_ROUTE_RECORDING)
    with pytest.raises(RouterReplayConfigError, match=r"--rl-router-replay rollout.*0\.16\.1, 0\.19\.0, 0\.19\.2 "
                       r"\(installed: .*drop --rl-router-replay rollout"):
        config.validate_router_replay("rollout", **kwargs)
    monkeypatch.setattr(patches, "covers_installed", lambda name: True)
    config.validate_router_replay("rollout", **kwargs)
