"""MoE routing replay: the trainer routes rollout tokens to the experts the inference engine chose."""
