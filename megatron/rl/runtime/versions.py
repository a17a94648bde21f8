"""The megatron-core releases megatron-rl supports, which one is installed, and what differs between them.

The one place that names versions: ``setup.py``'s requirement, the patch registry's entries (each says the
releases it was written for), the runtime's version gate and the engine's construction all read from here.
Two release lines are supported: 0.16.1 (the newest for Python 3.10-3.11) and 0.19.x (Python >= 3.12; 0.17 and
0.18 are not supported). :data:`DIFFERENCES` lists what changed between them that megatron-rl meets.
"""
from __future__ import annotations

import functools
from importlib import metadata

MCORE_0_16 = ("0.16.1",)
MCORE_0_19 = ("0.19.0", "0.19.2")  # 0.19.1 was yanked
SUPPORTED = MCORE_0_16 + MCORE_0_19
BOTH = SUPPORTED  # an entry written and tested for every supported release

# What megatron-rl meets that differs between the release lines (the code handles each where it says).
DIFFERENCES = (
    ("engine construction", "0.16: DynamicInferenceContext(~28 keyword arguments), GPTInferenceWrapper(model, "
     "InferenceWrapperConfig, context), TextGenerationController(wrapper, tokenizer, pp_group), "
     "DynamicInferenceEngine(controller, context, random_seed); 0.19: DynamicInferenceContext(model_config, "
     "InferenceConfig), GPTInferenceWrapper(model, context), TextGenerationController(wrapper, tokenizer), "
     "DynamicInferenceEngine(controller, context)", "megatron.rl.inference.engine.construct"),
    ("controller step hooks", "0.19: _dynamic_step_sample_logits() and _dynamic_step_calculate_log_probs() take "
     "no logits (they read the controller's logits buffer); the latter returns (log-probs, tensor)",
     "megatron.rl.inference.engine.build:SamplingController"),
    ("prompt sharing", "0.19 has prefix caching (InferenceConfig.enable_prefix_caching): whole KV blocks of equal "
     "prompt prefixes shared by reference count; 0.16.1 has none (megatron-rl's SharedPromptPrefill copies them). "
     "With --rl-router-replay rollout it stays off on 0.19 (a cached block is not forwarded, so it has no routes)",
     "megatron.rl.inference.engine.shared_prefill"),
    ("chunked prefill", "0.16.1's engine prefills a prompt longer than a step in chunks by default; 0.19 refuses "
     "it unless InferenceConfig.enable_chunked_prefill", "megatron.rl.inference.engine.construct:make_context"),
    ("inference MoE dispatcher", "0.19's context allocates the buffers of an inference-only MoE token dispatcher "
     "(NVLS by default) with expert parallelism, whatever the model's layers; megatron-rl's layers use their "
     "training dispatcher", "megatron.rl.inference.engine.construct:make_context"),
    ("megatron.training", "0.19 wheels ship megatron/training, whose --perform-rl-step imports megatron.rl",
     "megatron.rl.rl_profiling"),
    ("version string", "0.19's package_info appends the git hash of any repository it is installed inside "
     "(0.19.2+abc1234); the release is read from the distribution's metadata", "installed_version"),
)


def release(version: str) -> str:
    """``"0.16"`` or ``"0.19"``: the release line of a version string (its local part ignored); ``""`` if neither."""
    base = version.split("+", 1)[0].strip()
    if base in MCORE_0_16:
        return "0.16"
    if base in MCORE_0_19:
        return "0.19"
    return ""


def base_version(version: str) -> str:
    """A version without its local part (``0.19.2+abc1234`` -> ``0.19.2``)."""
    return version.split("+", 1)[0].strip()


@functools.lru_cache(maxsize=1)
def installed_version() -> str:
    """The installed megatron-core release, e.g. ``"0.19.2"`` (from the distribution's metadata)."""
    try:
        return base_version(metadata.version("megatron-core"))
    except metadata.PackageNotFoundError:  # a source checkout on sys.path
        from megatron.core import package_info  # heavy: megatron-core

        return base_version(package_info.__version__)


def installed_release() -> str:
    """:func:`release` of the installed megatron-core."""
    return release(installed_version())


def is_0_19() -> bool:
    """Whether the installed megatron-core is of the 0.19 line (the newer APIs)."""
    return installed_release() == "0.19"


def written_for(versions: tuple[str, ...], version: str | None = None) -> bool:
    """Whether an entry written for ``versions`` covers ``version`` (default: the installed one)."""
    return base_version(version or installed_version()) in versions


__all__ = ["MCORE_0_16", "MCORE_0_19", "SUPPORTED", "BOTH", "DIFFERENCES", "release", "base_version",
           "installed_version", "installed_release", "is_0_19", "written_for"]
