"""What megatron-core's own trainer finds when it looks for Megatron-LM's RL: a refusal that names train_rl.py.

megatron-core wheels from 0.17 on ship ``megatron.training``, whose ``training.py`` imports ``megatron.rl.rl_utils``
and this module when it is imported (an ``ImportError`` there means "no RL package") and, with
``--perform-rl-step``, drives Megatron-LM's RL functions from its own loop. megatron-rl's RL is a program of its own
(``train_rl.py``), so this module never imports: without ``--perform-rl-step`` megatron-core's trainer carries on
without RL, and with it the process stops here, before any model is built, with one line saying what to run.
Nothing in megatron-rl imports this module.
"""
from __future__ import annotations

import sys

REFUSAL = ("megatron-rl does not run inside megatron-core's trainer (megatron.training --perform-rl-step): "
           "launch RL with train_rl.py and the same Megatron flags, e.g. "
           "torchrun --nproc-per-node 8 train_rl.py <flags> --langrl-env-config envs.yaml")

if "--perform-rl-step" in sys.argv[1:]:
    print(REFUSAL, file=sys.stderr)
    raise SystemExit(2)
raise ImportError("megatron.rl.rl_profiling is not importable: megatron-rl runs RL through train_rl.py, "
                  "not through megatron.training")
