"""Rollouts: sequences from groups, collection, the synchronous and asynchronous sources, the pipeline, the durable bank."""
