"""Seeing what a run does: per-environment metrics, samples, warnings, the policy-gap check, their config."""
