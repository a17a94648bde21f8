"""Environment (agent) server: host any :class:`~megatron.rl.agent.api.Agent` over HTTP.

Run ``python -m megatron.rl.server.agent --help``; use it from training with
:class:`~megatron.rl.agent.remote_agent.RemoteAgent` (YAML ``type: remote``). See :mod:`.app` for the routes.
"""
from megatron.rl.server.agent.app import create_app

__all__ = ["create_app"]
