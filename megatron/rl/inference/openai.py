"""OpenAI-compatible HTTP backend: ``build_inference_interface("openai", base_url="http://host:port/v1")``.

Uses the official ``openai`` ``AsyncOpenAI`` client against any OpenAI-compatible server (our
:mod:`megatron.rl.server.inference`, vLLM, SGLang, OpenAI itself). Text prompts go to
``/v1/completions``, chat messages to ``/v1/chat/completions``; ``n`` is sent natively.

What comes back depends on the server:
* log-probs: requested always (``logprobs=1`` / ``logprobs=true``); ``InferenceResponse.logprobs`` is None
  when the server returns none. Their meaning is the server's: our server follows the API convention
  (temperature-scaled, before truncation); other servers may report untempered log-probs.
* token ids: read from the vLLM-style extension fields ``choices[i].token_ids`` (generated) and
  ``choices[i].prompt_token_ids`` (or top-level ``prompt_token_ids`` for chat), which our server always
  returns and vLLM returns with ``return_token_ids=true`` (sent when ``request_token_ids=True``). Without
  them ``token_ids`` is empty and ``prompt_length`` is 0.
* ``top_k`` is not an OpenAI parameter: it is sent (as an extra body field) only when > 0.

Concurrency: every request is its own HTTP call; all run at once under an ``asyncio.Semaphore`` of
``max_concurrency``, and the server batches them. Errors: an unreachable server or a timeout (after
``max_retries`` retries with backoff, done by the client) raises :class:`InferenceError` naming the URL;
a request the server rejects (4xx/5xx) becomes a ``finish_reason="error"`` response carrying the
server's message, without failing the other requests.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

from megatron.rl.inference.api import (InferenceError, InferenceInterface, InferenceRequest, InferenceResponse)

logger = logging.getLogger(__name__)

__all__ = ["OpenAIInference"]

_FINISH = {"stop": "stop", "length": "length"}


def _extra(obj: Any, name: str) -> Any:
    """Read a field the openai models do not declare (kept in ``model_extra``) or a declared one."""
    value = getattr(obj, name, None)
    if value is None and getattr(obj, "model_extra", None):
        value = obj.model_extra.get(name)
    return value


@InferenceInterface.register("openai")
class OpenAIInference(InferenceInterface):
    """Client of an OpenAI-compatible server.

    Args:
        base_url: e.g. "http://127.0.0.1:8000/v1".
        model: model id to request; default: the first id listed by ``GET /v1/models``.
        api_key: bearer token; default ``$OPENAI_API_KEY`` or "EMPTY" (servers without auth ignore it).
        timeout: seconds per HTTP attempt. max_retries: retries on connection errors / 429 / 5xx.
        max_concurrency: most HTTP requests in flight at once.
        request_token_ids: send ``return_token_ids=true`` (vLLM); set False for servers that reject
            unknown parameters (api.openai.com).
    """

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, timeout: float = 60.0,
                 max_retries: int = 2, max_concurrency: int = 64, request_token_ids: bool = True):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.max_concurrency = int(max_concurrency)
        self.request_token_ids = request_token_ids
        # An AsyncOpenAI client (its httpx pool) belongs to the event loop it was first used on; the sync
        # generate() runs a fresh loop per call, so keep one client (and semaphore) per loop.
        self._loop_state: dict[int, tuple[Any, Any, asyncio.Semaphore]] = {}

    def _state(self) -> tuple[Any, asyncio.Semaphore]:
        from openai import AsyncOpenAI

        loop = asyncio.get_running_loop()
        state = self._loop_state.get(id(loop))
        if state is None or state[0] is not loop:
            for key, (old_loop, _, _) in list(self._loop_state.items()):
                if old_loop.is_closed():
                    del self._loop_state[key]
            client = AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, timeout=self.timeout,
                                 max_retries=self.max_retries)
            state = (loop, client, asyncio.Semaphore(self.max_concurrency))
            self._loop_state[id(loop)] = state
        return state[1], state[2]

    def _unreachable(self, e: Exception) -> InferenceError:
        return InferenceError(f"inference server at {self.base_url} is unreachable or timed out "
                              f"({type(e).__name__}: {e}; timeout={self.timeout}s, retries={self.max_retries}). "
                              "Is the server running and the base_url (including /v1) right?")

    async def _model_name(self, client: Any) -> str:
        if self.model is None:
            import openai

            try:
                models = await client.models.list()
            except (openai.APIConnectionError, openai.APITimeoutError) as e:
                raise self._unreachable(e) from e
            if not models.data:
                raise InferenceError(f"inference server at {self.base_url} lists no models; pass model=...")
            self.model = models.data[0].id
        return self.model

    def _common_params(self, req: InferenceRequest) -> dict[str, Any]:
        ga = req.generation_args
        params: dict[str, Any] = {"temperature": ga.temperature, "top_p": ga.top_p, "max_tokens": ga.max_tokens,
                                  "n": ga.n}
        if ga.stop:
            params["stop"] = ga.stop
        if ga.seed is not None:
            params["seed"] = ga.seed
        extra: dict[str, Any] = {}
        if ga.top_k > 0:
            extra["top_k"] = ga.top_k
        if self.request_token_ids:
            extra["return_token_ids"] = True
        if extra:
            params["extra_body"] = extra
        return params

    async def _one(self, req: InferenceRequest) -> list[InferenceResponse]:
        import openai

        client, sem = self._state()
        model = await self._model_name(client)
        params = self._common_params(req)
        try:
            async with sem:
                if req.messages is not None:
                    resp = await client.chat.completions.create(
                        model=model, messages=[m.model_dump() for m in req.messages], logprobs=True, **params)
                else:
                    resp = await client.completions.create(model=model, prompt=req.prompt, logprobs=1, **params)
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            raise self._unreachable(e) from e
        except openai.APIStatusError as e:
            message = f"server {self.base_url} answered {e.status_code}: {_server_message(e)}"
            return [InferenceResponse.failed(message, prompt_text=req.prompt) for _ in range(req.generation_args.n)]
        return self._parse(req, resp)

    def _parse(self, req: InferenceRequest, resp: Any) -> list[InferenceResponse]:
        top_prompt_ids = _extra(resp, "prompt_token_ids")
        out = []
        for choice in sorted(resp.choices, key=lambda c: c.index):
            if req.messages is not None:
                text = choice.message.content or ""
                content = getattr(choice.logprobs, "content", None) if choice.logprobs else None
                logprobs = [c.logprob for c in content] if content else None
            else:
                text = choice.text
                logprobs = list(choice.logprobs.token_logprobs) if choice.logprobs and \
                    choice.logprobs.token_logprobs is not None else None
            gen_ids = _extra(choice, "token_ids")
            prompt_ids = _extra(choice, "prompt_token_ids") or top_prompt_ids
            if gen_ids is not None and prompt_ids is not None:
                token_ids, prompt_length = list(prompt_ids) + list(gen_ids), len(prompt_ids)
            else:
                token_ids, prompt_length = [], 0
            prompt_text = _extra(choice, "prompt_text") or req.prompt
            out.append(InferenceResponse(text=text, token_ids=token_ids, prompt_length=prompt_length,
                                         logprobs=logprobs, finish_reason=_FINISH.get(choice.finish_reason, "stop"),
                                         prompt_text=prompt_text))
        return out

    async def agenerate(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        results = await asyncio.gather(*(self._one(r) for r in requests))
        return [r for group in results for r in group]

    async def aclose(self) -> None:
        loop = asyncio.get_running_loop()
        state = self._loop_state.pop(id(loop), None)
        if state is not None and state[0] is loop:
            await state[1].close()


def _server_message(e: Any) -> str:
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "detail" in body:
            return str(body["detail"])
    return str(e)
