"""Built-in environments: arithmetic (the embedded default), countdown, math and a multi-turn calculator.

Importing a module registers its agent type (``@Agent.register_subclass(...)``); the YAML env config loader
imports these built-in modules on demand (``type: arithmetic``; see ``BUILTIN_AGENT_MODULES`` in
:mod:`megatron.rl.agent.api`). They ship in the package; ``examples/rl/`` holds their configs.
"""
