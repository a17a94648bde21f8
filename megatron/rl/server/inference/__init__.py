"""OpenAI-compatible inference server over any :class:`~megatron.rl.inference.api.InferenceInterface`.

Run: ``python -m megatron.rl.server.inference --backend NAME [options] [-- backend flags]``
(see :mod:`megatron.rl.server.inference.__main__`); embed: ``create_app(backend, ServerConfig(...))``.
"""
from megatron.rl.server.inference.app import RequestBatcher, ServerConfig, create_app

__all__ = ["create_app", "ServerConfig", "RequestBatcher"]
