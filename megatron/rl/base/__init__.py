"""The base layer every other ``megatron.rl`` package builds on; it imports nothing from them.

* :mod:`.registry`: :class:`~megatron.rl.base.registry.Registry`, the one name -> object registry (one rule
  for duplicate names) behind algorithm variants, packing algorithms, inference backends, tokenizers and
  agent types;
* :mod:`.type_lookupable`: :class:`~megatron.rl.base.type_lookupable.TypeLookupable`, pydantic models that
  round-trip through JSON as their registered subclass (agents, requests, rollouts);
* :mod:`.types`: the rollout types agents hand to the trainer (``Rollout``, ``TokenRollout``,
  ``RolloutGroup``);
* :mod:`.chat`: chat messages and the built-in chat template;
* :mod:`.optional`: importing an optional package, or one line naming the pip extra that installs it;
* :mod:`.dependency_warnings`: the known start-up warnings of megatron-core and torch said once, in one line
  (installed by :func:`megatron.rl.logging.quiet_dependencies`).

Import the submodules; this package imports none of them, so ``megatron.rl.base.registry`` stays free
of pydantic for the pure-math packages.
"""
