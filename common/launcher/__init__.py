"""What ``launch_parallel_training.py`` does, one job per module.

- :mod:`.modes`: the modes it offers, each over its training script's own declaration (``MODE``);
- :mod:`.dependencies`: the installed packages against ``requirements.txt``, the optional extras, torch's build;
- :mod:`.plan`: a plan per mode for this machine (workers, threads, devices, memory) and the recommendation;
- :mod:`.command`: the chosen script's command line (the plan's flags, budgets translated, the user's flags);
- :mod:`.tune`: ``--tune``, short real trials and their cache;
- :mod:`.multinode`: ``--nnodes``, the torchrun command of every node and the SLURM batch script;
- :mod:`.report`: the report ``--check-only`` prints and ``--json`` writes.

Until a plan is made only the standard library and :mod:`common.system` are imported, so that
``--help`` answers at once and missing packages are reported rather than crashed on. Planning
imports the training scripts (numpy, gymnasium), never torch.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the project: the scripts and the requirements files


class UsageError(ValueError):
    """A bad flag or flag value: the launcher prints the message as one line and exits 2."""
