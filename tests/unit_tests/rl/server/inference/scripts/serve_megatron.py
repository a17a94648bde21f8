"""Serve a tiny megatron-core GPT through the Megatron backend over HTTP (used by the server tests).

Usage: python serve_megatron.py PORT. Adds a test-only route ``POST /test/score`` returning the
teacher-forced log-probs of a token sequence from a plain training-style forward of the same model,
so the test can check served log-probs against a computation that does not use the engine.
"""
import sys

import uvicorn

from megatron.rl.server.inference import ServerConfig, create_app
from tests.unit_tests.rl.inference.scripts.megatron_common import init_distributed, teacher_forced_logprobs, tiny_gpt


def main() -> None:
    port = int(sys.argv[1])
    init_distributed(tp=1)
    from megatron.rl.inference.megatron import MegatronInference
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    model = tiny_gpt()
    backend = MegatronInference(model, ByteLevelTokenizer())
    app = create_app(backend, ServerConfig(model_name="tiny-gpt"))

    @app.post("/test/score")
    async def score(body: dict) -> dict:
        # runs on the server's loop thread, which set up the CPU runtime; generation is idle by now
        lp = teacher_forced_logprobs(model, body["token_ids"], body["prompt_length"], body["temperature"])
        return {"logprobs": lp.tolist()}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


if __name__ == "__main__":
    main()
