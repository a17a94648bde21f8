"""Checkpoints: save/load, paths, integrity (checksums), arguments, RNG state."""
