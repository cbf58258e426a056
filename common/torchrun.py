"""``torchrun`` itself, with a rendezvous that fails reported in one line instead of pages of trace.

    python -m common.torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 --rdzv-id job1 --rdzv-conf join_timeout=120 \\
        ultra_parallel_train_dqn.py --duration 1 --output-dir runs/apex

It takes exactly torchrun's arguments and runs torchrun's own ``main``: the same agent, rendezvous,
restarts and exit status. The one difference is what a node sees when nobody answers the
rendezvous (node 0 not started, a wrong address, a firewall): after ``join_timeout`` (or the store's
``read_timeout``) seconds, one line and exit status 1.
"""

from __future__ import annotations

import os
import sys

EXIT_RENDEZVOUS = 1


def _import_torch_quietly() -> None:
    """c10d's C++ layer logs each failed connection attempt with a stack dump. The level is read once,
    when torch loads, so this process (the agent) is quiet while its workers, started with the
    environment restored, keep the usual warnings."""
    previous = os.environ.get("TORCH_CPP_LOG_LEVEL")
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch  # noqa: F401
    finally:
        if previous is None:
            os.environ.pop("TORCH_CPP_LOG_LEVEL")
        else:
            os.environ["TORCH_CPP_LOG_LEVEL"] = previous


def _endpoint(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        for flag in ("--rdzv-endpoint", "--rdzv_endpoint"):
            if arg == flag and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith(flag + "="):
                return arg.split("=", 1)[1]
    return "the rendezvous endpoint"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Restarted ranks on several nodes otherwise read the old ranks' addresses from the agent's shared
    # store and cannot connect (pytorch/pytorch#135712).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    _import_torch_quietly()
    from torch.distributed.elastic.rendezvous.api import RendezvousError, RendezvousTimeoutError
    from torch.distributed.run import main as torchrun_main

    try:
        torchrun_main(argv)
    except RendezvousTimeoutError:
        print(f"error: rendezvous at {_endpoint(argv)}: not every node joined within join_timeout; start the "
              "same command on every node (--nnodes of them)", file=sys.stderr)
        return EXIT_RENDEZVOUS
    except RendezvousError as err:
        print(f"error: rendezvous at {_endpoint(argv)}: nobody answers ({type(err).__name__}); start node 0 "
              "first, and check that every node reaches that address and port", file=sys.stderr)
        return EXIT_RENDEZVOUS
    return 0


if __name__ == "__main__":
    sys.exit(main())
