"""OpenAI-compatible HTTP backend: ``build_inference_interface("openai", base_url="http://host:port/v1")``.

Uses ``openai``'s ``AsyncOpenAI`` against any OpenAI-compatible server; text prompts go to ``/v1/completions``,
chat to ``/v1/chat/completions``. Log-probs and token ids are whatever the server returns (ours: always). Every
request is its own HTTP call, under ``max_concurrency``, on the backend's private event-loop thread. An
unreachable server raises :class:`InferenceError`; a rejected request becomes a ``finish_reason="error"``
response and fails alone.

What comes back from which server: docs/inference.md.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

from megatron.rl.inference.api import (CANCELLED, InferenceError, InferenceInterface, InferenceRequest,
                                       InferenceResponse)
from megatron.rl.inference.control import TrainerControl
from megatron.rl.inference.validation import request_error, sample_count

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
class OpenAIInference(InferenceInterface, TrainerControl):
    """Client of an OpenAI-compatible server. An RL run builds it from ``--inference-server-url``
    (:meth:`build_for_training`); its other trainer controls keep the defaults of a server the trainer cannot
    update.

    Args:
        base_url: e.g. "http://127.0.0.1:8000/v1".
        model: model id to request; default: the first id listed by ``GET /v1/models``.
        api_key: bearer token; default ``$OPENAI_API_KEY`` or "EMPTY" (servers without auth ignore it).
            :meth:`for_untrusted_spec` never reads the environment: a client-chosen URL gets no credential.
        timeout: seconds per HTTP attempt. max_retries: retries on connection errors / 429 / 5xx.
        max_concurrency: most HTTP requests in flight at once.
        request_token_ids: send ``return_token_ids=true`` (vLLM); set False for servers that reject
            unknown parameters (api.openai.com).
    """

    needs_server_url = True  # an RL run builds it from --inference-server-url

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None, timeout: float = 60.0,
                 max_retries: int = 2, max_concurrency: int = 64, request_token_ids: bool = True):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.max_concurrency = int(max_concurrency)
        self.request_token_ids = request_token_ids
        # The AsyncOpenAI client (its connection pool) belongs to the event loop it runs on, and callers may
        # come from many loops (each sync generate() or asyncio.run() makes a new one). So all HTTP work runs
        # on one private event-loop thread owned by this backend; agenerate() awaits it from any loop.
        self._io_lock = threading.Lock()
        self._io_loop: asyncio.AbstractEventLoop | None = None
        self._io_thread: threading.Thread | None = None
        self._client: Any = None
        self._semaphore: asyncio.Semaphore | None = None

    @classmethod
    def build_for_training(cls, cfg: Any, rl: Any, model: list, tokenizer: Any) -> "OpenAIInference":
        """An RL run's client of ``--inference-server-url``."""
        return cls(base_url=rl.inference_server_url)

    @classmethod
    def for_untrusted_spec(cls, **kwargs: Any) -> "OpenAIInference":
        """Built for a spec a remote client sent: only an ``api_key`` given in the spec is used, never ours."""
        kwargs.setdefault("api_key", "EMPTY")
        return super().for_untrusted_spec(**kwargs)

    def _io(self) -> asyncio.AbstractEventLoop:
        with self._io_lock:
            if self._io_loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="openai-inference-io", daemon=True)
                thread.start()
                self._io_loop, self._io_thread = loop, thread
            return self._io_loop

    def _state(self) -> tuple[Any, asyncio.Semaphore]:
        """The client and semaphore (created lazily, on the I/O loop)."""
        if self._client is None:
            from openai import AsyncOpenAI

            self._client = AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, timeout=self.timeout,
                                       max_retries=self.max_retries)
            self._semaphore = asyncio.Semaphore(self.max_concurrency)
        return self._client, self._semaphore

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

        problem = request_error(req)
        if problem is None and req.prefix_token_ids is not None:
            problem = ("prefix_token_ids (a token-in prompt) cannot be sent to an OpenAI-compatible server; "
                       "generate with an in-process backend (megatron, huggingface)")
        if problem is not None:  # never sent: fails alone, like on the in-process backends
            return [InferenceResponse.failed(f"invalid request: {problem}") for _ in range(sample_count(req))]
        if req.cancelled:  # its caller left before it was sent
            return [InferenceResponse.failed(CANCELLED) for _ in range(sample_count(req))]
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

    async def _agenerate_on_io(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        tasks = [asyncio.ensure_future(self._one(r)) for r in requests]
        try:
            results = await asyncio.gather(*tasks)
        finally:  # on an error (e.g. unreachable server) do not leave the other calls running
            for t in tasks:
                t.cancel()
        return [r for group in results for r in group]

    async def agenerate(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        future = asyncio.run_coroutine_threadsafe(self._agenerate_on_io(list(requests)), self._io())
        return await asyncio.wrap_future(future)

    async def aclose(self) -> None:
        """Close the HTTP client and stop the I/O thread (a later call starts them again)."""
        with self._io_lock:
            loop, thread, client = self._io_loop, self._io_thread, self._client
            self._io_loop = self._io_thread = self._client = self._semaphore = None
        if loop is None:
            return
        if client is not None:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(client.close(), loop))
        loop.call_soon_threadsafe(loop.stop)
        await asyncio.to_thread(thread.join)
        loop.close()


def _server_message(e: Any) -> str:
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "detail" in body:
            return str(body["detail"])
    return str(e)
