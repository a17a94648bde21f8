"""Inference backends behind one interface (see :mod:`megatron.rl.inference.api`).

Backends register by name: "megatron" (in-process Megatron Core engine), "openai" (any
OpenAI-compatible server), "huggingface" (local ``transformers`` model), "fake" (deterministic test
double). They are imported lazily by :func:`build_inference_interface`.
"""
from megatron.rl.inference.api import (ChatMessage, GenerationArgs, InferenceError, InferenceInterface,
                                       InferenceRequest, InferenceResponse, backend_class, build_inference_interface,
                                       build_training_inference, expand_requests, registered_backends)

__all__ = ["ChatMessage", "GenerationArgs", "InferenceError", "InferenceInterface", "InferenceRequest",
           "InferenceResponse", "backend_class", "build_inference_interface", "build_training_inference",
           "expand_requests", "registered_backends"]
