"""``train_rl.py --rl-serve-inference [HOST:]PORT``: the trainer serves its current policy over HTTP.

The in-process engine is exposed through the OpenAI-compatible app on a background thread of global rank 0, so
remote environment servers and any OpenAI client generate with the policy being trained. Requests run only
inside the trainer's rollout phases (others wait up to ``--rl-serve-inference-wait-s``); a phase ends only after
every DP rank finished collecting and every admitted request is answered. Tensor/pipeline/expert parallelism is
refused (:class:`PolicyServingError`). ``$MEGATRON_RL_INFERENCE_API_KEY`` guards ``/v1/*``.

Usage, layouts and how model parallelism could be added: docs/server.md.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import torch.distributed as dist
from typing import Any, Iterator

from megatron.rl.inference.api import InferenceError, InferenceInterface, InferenceRequest, InferenceResponse
from megatron.rl.inference.control import control_of
from megatron.rl.inference.forwarding import ForwardingInference
from megatron.rl.runtime import keep_denormals

log = logging.getLogger(__name__)

__all__ = ["PolicyGate", "ServedPolicy", "PolicyServingError", "parse_address", "serve_policy"]

API_KEY_ENV = "MEGATRON_RL_INFERENCE_API_KEY"
_FLAG = "--rl-serve-inference"
_LOOPBACK = ("127.0.0.1", "localhost", "::1")


class PolicyServingError(InferenceError):
    """The policy cannot be served as asked (layout, address); the message names the flag."""


def parse_address(text: str) -> tuple[str, int]:
    """``"PORT"`` or ``"HOST:PORT"`` -> (host, port); host defaults to 127.0.0.1. Raises ValueError."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{_FLAG}={text!r}: expected PORT or HOST:PORT with a port in 1..65535")
    return host, int(port)


class PolicyGate:
    """Admits HTTP requests only while a rollout phase is open; ``close`` waits for the admitted ones."""

    def __init__(self, wait_s: float):
        self.wait_s = wait_s
        self._cond = threading.Condition()
        self._open = False
        self._in_flight = 0
        self.phases = 0  # rollout phases opened so far (a diagnostic)

    def open(self) -> None:
        with self._cond:
            self._open = True
            self.phases += 1

    def close(self) -> None:
        """Stop admitting; return once every admitted request has left."""
        with self._cond:
            self._open = False
            self._cond.wait_for(lambda: self._in_flight == 0)

    async def enter(self) -> None:
        """Wait (polling: no thread is held while waiting) until open, then count this request in."""
        deadline = time.monotonic() + self.wait_s
        while True:
            with self._cond:
                if self._open:
                    self._in_flight += 1
                    return
            if time.monotonic() > deadline:
                raise PolicyServingError(
                    f"the trainer ran no rollout phase for {self.wait_s:.0f}s (it serves its policy only while it "
                    f"collects rollouts or evaluates); retry later or raise --rl-serve-inference-wait-s")
            await asyncio.sleep(0.02)

    def leave(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()


class _GatedBackend(ForwardingInference):
    """What the HTTP app sees: the trainer's engine, reachable only through the gate."""

    continuous_batching = True  # the dynamic engine batches concurrent requests itself

    def __init__(self, backend: InferenceInterface, gate: PolicyGate):
        super().__init__(backend)
        self.gate = gate

    async def agenerate(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        await self.gate.enter()
        try:
            return await self.inner.agenerate(requests)
        finally:
            self.gate.leave()

    async def aclose(self) -> None:
        """The trainer owns the engine: stopping the server must not touch it."""


class ServedPolicy(ForwardingInference):
    """The trainer's backend, with its rollout phases opening and closing the HTTP server's gate.

    Everything but :meth:`rollout_phase`, :meth:`pause_generation` and :meth:`aclose` goes to the wrapped
    backend. Every rank wraps its backend (the phase-end barrier is collective); only the rank given a
    ``server`` serves.

    Asynchronous rollouts: a phase that ends with requests in flight (partial rollouts) pauses the engine
    instead of leaving the phase, so the gate stays open; the requests admitted then wait in the paused engine
    and continue with the updated weights. The pause waits at the same barrier as a phase end: rank 0's engine
    serves every data-parallel rank's remote environments, and must not pause while another rank still
    collects its batch.
    """

    continuous_batching = True

    def __init__(self, backend: InferenceInterface, gate: PolicyGate, server: "_ServerThread | None",
                 barrier_group: Any = None):
        super().__init__(backend)
        self.gate = gate
        self.server = server
        self._barrier_group = barrier_group

    @contextlib.contextmanager
    def rollout_phase(self) -> Iterator["ServedPolicy"]:
        with self.inner.rollout_phase():
            self.gate.open()
            try:
                yield self
            finally:
                self._wait_for_other_ranks()
                self.gate.close()

    def pause_generation(self) -> None:
        self._wait_for_other_ranks()
        super().pause_generation()

    def _wait_for_other_ranks(self) -> None:
        if self._barrier_group is not None:  # other DP ranks' rollouts may still call this server

            dist.barrier(group=self._barrier_group)

    @property
    def url(self) -> str | None:
        return self.server.url if self.server is not None else None

    async def aclose(self) -> None:
        if self.server is not None:
            await asyncio.to_thread(self.server.stop)
        await self.inner.aclose()


class _ServerThread:
    """uvicorn on a daemon thread (the trainer's main thread keeps training)."""

    def __init__(self, app: Any, host: str, port: int):
        import uvicorn

        from megatron.rl.server.guard import MAX_CONNECTIONS  # fastapi: only when serving

        self.url = f"http://{host}:{port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                     timeout_graceful_shutdown=5, limit_concurrency=MAX_CONNECTIONS))
        self._thread = threading.Thread(target=self._run, name="policy-server", daemon=True)

    def _run(self) -> None:
        keep_denormals()  # started inside the run's flush-to-zero scope: a client's 5e-324 must not validate as 0
        self._server.run()

    def start(self, timeout_s: float = 30.0) -> None:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise PolicyServingError(f"{_FLAG}: the policy server could not listen on {self.url} (port in use "
                                         f"or address not available on this host?)")
            time.sleep(0.02)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


def serve_policy(backend: InferenceInterface, address: str, wait_s: float = 600.0,
                 model_name: str = "megatron-rl") -> ServedPolicy:
    """Wrap the trainer's in-process ``backend`` and, on global rank 0, serve it at ``address``. Collective.

    Raises :class:`PolicyServingError` for a model-parallel layout or an address that cannot be bound.
    """

    from megatron.rl.server.inference.app import ServerConfig, create_app  # fastapi: only when serving

    host, port = parse_address(address)
    lockstep = control_of(backend).lockstep_size
    if lockstep != 1:
        raise PolicyServingError(
            f"{_FLAG} serves from one rank's engine, but this engine runs in lockstep over "
            f"{lockstep} tensor/pipeline/expert-parallel ranks, which is not supported yet: train with "
            f"TP=PP=EP=1 (any data-parallel size), or serve a saved checkpoint with python -m "
            f"megatron.rl.server.inference --backend megatron -- --load CKPT")
    world = dist.get_world_size() if dist.is_initialized() else 1
    group = dist.new_group(backend="gloo") if world > 1 else None  # collective: every rank creates it
    gate = PolicyGate(wait_s)
    server, status = None, [None]
    if group is None or dist.get_rank() == 0:
        api_key = os.environ.get(API_KEY_ENV) or None
        if host not in _LOOPBACK and api_key is None:
            log.warning("%s=%s without $%s: anyone who can reach this port can generate with the policy", _FLAG,
                        address, API_KEY_ENV)
        app = create_app(_GatedBackend(backend, gate), ServerConfig(model_name=model_name, api_key=api_key))
        server = _ServerThread(app, host, port)
        try:
            server.start()
            log.info("serving the policy at %s/v1 (model %r) during rollout phases", server.url, model_name)
        except PolicyServingError as e:
            status = [str(e)]
    if group is not None:  # every rank fails together rather than waiting for rank 0 in a collective
        dist.broadcast_object_list(status, src=0, group=group)
    if status[0] is not None:
        raise PolicyServingError(status[0])
    return ServedPolicy(backend, gate, server, group)
