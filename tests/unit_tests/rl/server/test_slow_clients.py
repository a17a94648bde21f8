"""Slow clients are bounded: bodies that stall after the headers are answered 408 and their connections closed
within the body timeout, on both servers (live uvicorn on loopback), and others are still served."""
from __future__ import annotations

import selectors
import socket
import threading
import time

import pytest
import uvicorn

from megatron.rl.inference.fake import FakeInference
from megatron.rl.inference.validation import RequestLimits
from megatron.rl.server.agent import create_app as create_env_app
from megatron.rl.server.agent.app import EnvServerConfig
from megatron.rl.server.inference.app import ServerConfig, create_app as create_inference_app
from tests.unit_tests.rl.agent.user_agents_fixture import ReverseWordAgent

TIMEOUT_S = 1


def _serve(app, stalled: int):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", limit_concurrency=4 * stalled))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    return server, thread, sock.getsockname()[1]


def _stall(port: int, path: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
              "{\"prompt\"".encode())  # 9 of the 1000 declared body bytes, then nothing
    return s


def _closed(s: socket.socket) -> bytes | None:
    """Everything the server sent until it closed the connection, or None when it is still open."""
    out = b""
    s.settimeout(0.05)
    try:
        while chunk := s.recv(65536):
            out += chunk
    except socket.timeout:
        return None
    except OSError:
        pass
    return out


def _wait_closed(sockets: list[socket.socket], seconds: float) -> dict[int, bytes]:
    """What the server sent on each socket it closed within ``seconds`` (an epoll wait on all of them: a poll
    per socket would visit hundreds of still-open sockets before seeing the first answer)."""
    answers: dict[int, bytes] = {}
    with selectors.DefaultSelector() as sel:
        for i, s in enumerate(sockets):
            sel.register(s, selectors.EVENT_READ, i)
        deadline = time.monotonic() + seconds
        while len(answers) < len(sockets) and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(timeout=min(left, 0.5)):
                got = _closed(key.fileobj)
                if got is not None:
                    answers[key.data] = got
                    sel.unregister(key.fileobj)
    return answers


@pytest.mark.parametrize("stalled", [100, pytest.param(500, marks=pytest.mark.slow)])
@pytest.mark.parametrize("server", ["inference", "environment"])
def test_stalled_bodies_are_closed_within_the_timeout(server, stalled):
    limits = RequestLimits(body_timeout_s=TIMEOUT_S)
    if server == "inference":
        app, path = create_inference_app(FakeInference(), ServerConfig(limits=limits)), "/v1/completions"
    else:
        app, path = create_env_app(ReverseWordAgent(), inference=FakeInference(),
                                   config=EnvServerConfig(limits=limits)), "/request"
    srv, thread, port = _serve(app, stalled)
    sockets = []
    try:
        sockets = [_stall(port, path) for _ in range(stalled)]
        answers = _wait_closed(sockets, TIMEOUT_S + 10)
        assert len(answers) == stalled, f"{stalled - len(answers)} stalled connections still open"
        assert all(a.startswith(b"HTTP/1.1 408") and b"body_timeout_s" in a for a in answers.values())
        with socket.create_connection(("127.0.0.1", port), timeout=10) as ok:  # the server still serves others
            ok.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert ok.recv(100).startswith(b"HTTP/1.1 200")
    finally:
        for s in sockets:
            s.close()
        srv.should_exit = True
        thread.join(timeout=10)
