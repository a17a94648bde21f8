"""Built-in environments: arithmetic (the embedded default), countdown, math and a multi-turn calculator.

Importing a module registers its agent type (``@Agent.register_subclass("name")`` at the start of a line). Every
module here with such a line is a built-in agent type: :func:`megatron.rl.agent.api.discover_agent_modules` finds
it without importing it, and the YAML env config loader imports it on first use of its name (``type:
arithmetic``); adding a module needs no entry elsewhere. Optional dependencies load through
:func:`megatron.rl.base.optional.import_optional`. They ship in the package; ``examples/rl/`` holds their configs.
"""
