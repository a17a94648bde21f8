"""A judge endpoint that does not answer is one line and exit status 2 before any model is built."""
from __future__ import annotations

import http.server
import subprocess
import sys
import threading

import pytest

from megatron.rl.agent.endpoint_check import RewardEndpointError, check_reward_endpoints, reward_endpoints
from megatron.rl.agent.env_config import build_agent_from_config
from megatron.rl.base.errors import UserError
from tests.conftest import REPO_ROOT, free_port

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3",
        "--tokenizer-type", "ByteLevelTokenizer", "--seed", "1", "--train-iters", "1"]


def _yaml(url: str) -> str:
    return ("environments:\n  - type: model_reward\n    name: judged\n    args:\n"
            "      env: {type: arithmetic}\n"
            f"      judge: {{inference: {{backend: openai, kwargs: {{base_url: \"{url}\"}}}}}}\n")


class _NotFound(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_error(404)

    def log_message(self, *args):
        pass


def test_a_dead_judge_is_named_and_a_live_one_passes(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/v1"
    (tmp_path / "dead.yaml").write_text(_yaml(dead))
    agent = build_agent_from_config(str(tmp_path / "dead.yaml"))
    assert [url for _, url in reward_endpoints(agent)] == [dead]
    with pytest.raises(RewardEndpointError, match=r"judge\.inference\.kwargs\.base_url=http://127\.0\.0\.1:\d+/v1 "
                                                  r"does not answer") as e:
        check_reward_endpoints(agent, timeout_s=2)
    assert isinstance(e.value, UserError)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "live.yaml").write_text(_yaml(f"http://127.0.0.1:{server.server_address[1]}/v1"))
        check_reward_endpoints(build_agent_from_config(str(tmp_path / "live.yaml")), timeout_s=2)  # 404 answers
    finally:
        server.shutdown()


def test_train_rl_with_a_dead_judge_exits_2_in_one_line(tmp_path):
    env = tmp_path / "env.yaml"
    env.write_text(_yaml(f"http://127.0.0.1:{free_port()}/v1"))
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "train_rl.py"), *TINY, "--langrl-env-config", str(env),
                           "--grpo-prompts-per-step", "2", "--grpo-group-size", "4", "--rl-max-new-tokens", "8"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "RewardEndpointError" in errors[0] and "does not answer" in errors[0]
    assert "Traceback" not in proc.stderr and "building" not in proc.stderr.lower()
