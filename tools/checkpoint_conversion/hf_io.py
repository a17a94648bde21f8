"""Hugging Face checkpoint directories on disk: config, lazily read weights, sharded safetensors output, tokenizer.

Only local directories are read; nothing is downloaded.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Iterable

import torch

from tools.checkpoint_conversion.families import ConversionError

log = logging.getLogger(__name__)

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
# files that make up a Hugging Face tokenizer (plus generation_config.json, whose eos ids the tokenizer uses)
TOKENIZER_PATTERNS = ("tokenizer*", "vocab.*", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                      "*.model", "chat_template*", "generation_config.json")


def read_hf_config(hf_dir: str | Path, flag: str = "--hf-dir") -> dict:
    """The raw ``config.json`` of a local Hugging Face model directory; ConversionError naming ``flag`` if absent."""
    path = Path(hf_dir)
    if not path.is_dir():
        raise ConversionError(f"{flag}={hf_dir}: no such directory (a local Hugging Face model directory with "
                              f"config.json and *.safetensors is needed; nothing is downloaded)")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConversionError(f"{flag}={hf_dir}: no config.json in the directory; is it a Hugging Face model "
                              f"directory?")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ConversionError(f"{flag}={hf_dir}: config.json is not valid JSON ({e})") from e


class HFTensorReader:
    """Read tensors of a Hugging Face checkpoint by name, one at a time (safetensors are memory-mapped).

    Handles ``model.safetensors``, sharded safetensors with an index, and legacy ``pytorch_model*.bin``.
    """

    def __init__(self, hf_dir: str | Path, flag: str = "--hf-dir") -> None:
        self.dir = Path(hf_dir)
        self._where: dict[str, Path] = {}
        self._open: dict[Path, object] = {}
        self._bin: dict[Path, dict] = {}
        files = self._weight_files()
        if not files:
            raise ConversionError(f"{flag}={hf_dir}: no weights found (model.safetensors, {SAFE_INDEX}, "
                                  f"pytorch_model.bin or {BIN_INDEX})")
        for f in files:
            for name in self._keys(f):
                self._where[name] = f

    def _weight_files(self) -> list[Path]:
        for index in (SAFE_INDEX, BIN_INDEX):
            if (self.dir / index).is_file():
                weight_map = json.loads((self.dir / index).read_text())["weight_map"]
                return sorted({self.dir / f for f in weight_map.values()})
        safe = sorted(self.dir.glob("*.safetensors"))
        return safe or sorted(self.dir.glob("pytorch_model*.bin"))

    def _handle(self, f: Path):
        if f.suffix == ".safetensors":
            if f not in self._open:
                from safetensors import safe_open

                self._open[f] = safe_open(str(f), framework="pt", device="cpu")
            return self._open[f]
        if f not in self._bin:
            self._bin[f] = torch.load(f, map_location="cpu", weights_only=True)
        return self._bin[f]

    def _keys(self, f: Path) -> Iterable[str]:
        h = self._handle(f)
        return list(h.keys())

    def names(self) -> list[str]:
        return sorted(self._where)

    def get(self, name: str) -> torch.Tensor:
        if name not in self._where:
            raise ConversionError(f"the Hugging Face checkpoint in {self.dir} has no tensor {name!r}; the "
                                  f"weights do not match config.json")
        h = self._handle(self._where[name])
        return h.get_tensor(name) if hasattr(h, "get_tensor") else h[name]


def write_safetensors(save_dir: str | Path, tensors: dict[str, torch.Tensor],
                      max_shard_bytes: int = 5 * 1024 ** 3) -> list[Path]:
    """Write ``tensors`` as ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + index (HF's layout)."""
    from safetensors.torch import save_file

    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        path = save_dir / "model.safetensors"
        save_file(shards[0], str(path), metadata={"format": "pt"})
        return [path]
    paths, weight_map = [], {}
    for i, shard in enumerate(shards, start=1):
        path = save_dir / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        weight_map.update({name: path.name for name in shard})
        paths.append(path)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (save_dir / SAFE_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                  indent=2, sort_keys=True))
    return paths


def tokenizer_files(src: str | Path) -> list[Path]:
    """The tokenizer files of ``src``; empty when it holds none (a ``generation_config.json`` alone is no tokenizer)."""
    src = Path(src)
    found: set[Path] = set()
    for pattern in TOKENIZER_PATTERNS:
        found.update(p for p in src.glob(pattern) if p.is_file())
    return sorted(found) if any(p.name != "generation_config.json" for p in found) else []


def copy_tokenizer(src: str | Path, dst: str | Path) -> list[Path]:
    """Copy the tokenizer files of ``src`` into ``dst`` (created); returns the copies (empty if none)."""
    files = tokenizer_files(src)
    if not files:
        log.warning("no tokenizer files in %s; the checkpoint will carry no tokenizer", src)
        return []
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(f, dst / f.name)) for f in files]
