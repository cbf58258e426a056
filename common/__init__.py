"""What two or more parallel-rl scripts share: config, envs, networks, buffers, processes, logging."""

import os

# Idle OpenMP threads must sleep rather than spin; spinning threads make every process on a
# shared machine crawl. Set before torch loads (and inherited by spawned workers).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
