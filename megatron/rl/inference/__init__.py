"""Inference backends behind one interface (see :mod:`megatron.rl.inference.api`).

Backends register by name: "megatron" (in-process Megatron Core engine), "openai" (any
OpenAI-compatible server), "huggingface" (local ``transformers`` model), "fake" (deterministic test
double). They are imported lazily by :func:`build_inference_interface`. The trainer's controls over the
backend it generates with are :class:`TrainerControl` (:mod:`megatron.rl.inference.control`); wrappers
derive from :class:`ForwardingInference`.
"""
from megatron.rl.inference.api import (ChatMessage, GenerationArgs, InferenceError, InferenceInterface,
                                       InferenceRequest, InferenceResponse, backend_class, build_inference_interface,
                                       expand_requests, registered_backends)
from megatron.rl.inference.control import TrainerControl, build_training_inference
from megatron.rl.inference.forwarding import ForwardingInference

__all__ = ["ChatMessage", "GenerationArgs", "InferenceError", "InferenceInterface", "InferenceRequest",
           "InferenceResponse", "backend_class", "build_inference_interface", "build_training_inference",
           "expand_requests", "registered_backends", "TrainerControl", "ForwardingInference"]
