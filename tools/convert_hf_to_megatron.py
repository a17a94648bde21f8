#!/usr/bin/env python
"""CLI: see tools/checkpoint_conversion/hf_to_megatron.py (`python tools/convert_hf_to_megatron.py --help`)."""
import sys
from pathlib import Path

# runnable as a plain script from anywhere: make the repository root importable (tools.checkpoint_conversion)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.checkpoint_conversion.hf_to_megatron import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
