"""megatron-rl: RL post-training (GRPO/PPO) on Megatron Core.

Installs the ``megatron.rl`` packages (the built-in environments and their data included) into the
``megatron`` namespace shared with the ``megatron-core`` wheel; the repo's ``megatron/`` deliberately has no
``__init__.py``. ``train_rl.py`` is installed as the ``megatron-rl-train`` command (also
``python -m megatron.rl.train_rl``, which ``torchrun -m`` can launch).
"""
from setuptools import find_namespace_packages, setup

# The megatron-core releases the runtime layer is written and tested against (megatron/rl/runtime/versions.py
# says what differs between them). pip resolves this to 0.16.1 on Python 3.11 (0.17+ need Python >= 3.12)
# and to the newest 0.19.x on Python 3.12+.
MCORE_REQUIREMENT = "megatron-core>=0.16.1,<0.20,!=0.17.*,!=0.18.*"

setup(
    name="megatron-rl",
    version="0.1.0",
    description="Reinforcement-learning post-training (GRPO, PPO) for Megatron Core models",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_namespace_packages(include=["megatron.rl", "megatron.rl.*"]),
    include_package_data=True,
    # the built-in environments' data (megatron/rl/environments/data/*.jsonl) is read from the installed package
    package_data={"megatron.rl": ["**/*.json", "**/*.jsonl", "**/*.yaml"]},
    entry_points={"console_scripts": ["megatron-rl-train = megatron.rl.train_rl:main"]},
    install_requires=[
        MCORE_REQUIREMENT,
        "torch>=2.4",
        "pydantic>=2",
        "numpy",
        "pyyaml",
        "fastapi",
        "uvicorn",
        "httpx",
        "openai>=1.0",
        # megatron-core needs these but does not declare them: without psutil a torch_dist
        # checkpoint save hangs (its writer subprocess dies); tqdm is used by inference.
        "psutil",
        "tqdm",
        "einops",  # megatron-core's dynamic-inference attention calls einops.rearrange (undeclared too)
        "tensorboard",
    ],
    extras_require={
        "hf": ["transformers>=4.40", "tokenizers", "safetensors"],
        # apex is optional too but is not on PyPI; build it from source if you want it.
        # xxhash: checkpoint checksum manifests hash ~10x faster than the hashlib.blake2b fallback (large runs)
        "gpu": ["transformer-engine[pytorch]", "xxhash"],
        "wandb": ["wandb"],
        "math": ["sympy"],
        "data": ["datasets"],  # Parquet / Arrow / JSON files for HuggingFaceDatasetAgent (JSONL needs nothing)
        # environment libraries: reasoning-gym's generated tasks (type: reasoning_gym); OpenEnv environments
        # (type: openenv) pull gradio and fastmcp, so they have an extra of their own (not in dev)
        "envs": ["reasoning-gym>=0.1.25"],
        "openenv": ["openenv-core>=0.3.0"],
        "plot": ["matplotlib"],
        # benchmarks/grpo_vs_trl.py: TRL's GRPOTrainer as the peer (pulls datasets/accelerate; keeps torch)
        "bench": ["trl", "datasets"],
        "dev": ["pytest>=7", "hypothesis", "transformers>=4.40", "tokenizers", "safetensors", "sympy", "datasets",
                "matplotlib", "jinja2", "reasoning-gym>=0.1.25"],
    },
)
