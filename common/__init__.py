"""What two or more parallel-rl scripts share: config, envs, networks, buffers, processes, logging."""

import os

# Idle OpenMP threads must sleep rather than spin; spinning threads make every process on a
# shared machine crawl. Set before torch loads (and inherited by spawned workers).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# numpy's BLAS (OpenBLAS in the PyPI wheels) runs one thread per core for a matmul as small as a
# rollout step's MLP on 128 envs. On cores busy with the run's other processes those threads wait on
# each other: acting for 128 CartPole envs took 10.8 ms per step instead of 0.73 ms with one thread
# (docs/performance.md). This reaches the processes a script starts (the workers, which act in
# numpy, one process per core), and the script's own process where it imports common before numpy:
# train_parallel_timed.py, whose learner may run in numpy beside its workers.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
