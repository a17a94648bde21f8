"""megatron-core's dynamic engine in process: build, session, lockstep, shared prefill, KV reuse."""
