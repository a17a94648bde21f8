"""Fixtures that start real inference-server processes on loopback and always stop them."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import REPO_ROOT, free_port


class ServerProcess:
    """A server subprocess on a free loopback port: the CLI with ``args``, or ``[python, script, PORT]``."""

    def __init__(self, args: list[str], api_key: str | None = None, startup_timeout: float = 60.0,
                 script: str | os.PathLike | None = None):
        self.port = free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        if script is not None:
            cmd = [sys.executable, str(script), str(self.port), *args]
        else:
            cmd = [sys.executable, "-m", "megatron.rl.server.inference", "--port", str(self.port),
                   "--log-level", "warning", *args]
            if api_key:
                cmd += ["--api-key", api_key]
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.proc.stdout.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not come up within {startup_timeout}s")
            time.sleep(0.1)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc.stdout:
            self.proc.stdout.close()


@pytest.fixture(scope="module")
def fake_server():
    server = ServerProcess(["--backend", "fake", "--backend-arg", "delay_s=0.1", "--backend-arg", "max_seq_len=200"],
                           api_key="test-key")
    try:
        yield server
    finally:
        server.stop()
