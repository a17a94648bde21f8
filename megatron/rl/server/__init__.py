"""HTTP servers: ``server.inference`` (OpenAI-compatible inference server) and ``server.agent`` (environments)."""
