"""Former name of :mod:`common.parallel_manager`, kept while importers move to it."""

from common.parallel_manager import ExperienceBatch, ManagerConfig, ParallelManager, WorkerSpec  # noqa: F401
