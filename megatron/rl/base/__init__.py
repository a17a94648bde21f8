"""The base layer every other ``megatron.rl`` package builds on; it imports nothing from them.

Submodules: :mod:`.registry` (the one name -> object registry), :mod:`.type_lookupable` (pydantic models that
round-trip through JSON as their registered subclass), :mod:`.types` (rollout types), :mod:`.chat`,
:mod:`.optional` (optional imports naming their pip extra), :mod:`.dependency_warnings`.

Import the submodules; this package imports none of them, so ``megatron.rl.base.registry`` stays free of
pydantic for the pure-math packages.
"""
