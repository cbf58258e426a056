"""The run lifecycle every training script shares, written once.

A script declares its settings (a dataclass deriving from :class:`RunConfig`) and its
algorithm (a trainer class), and its ``main()`` is one call to :func:`run_training`, which
does, in this order and the same way for every mode:

1. **Config**: defaults < ``--config FILE.yaml`` < flags; a bad value, an unknown key, an env
   the mode cannot train, a ``--resume`` file that is missing, not a checkpoint, or from
   another script, env or network width, or an output directory that is a file: one line,
   exit 2, nothing written. ``--validate-only`` stops here and prints the resolved config.
2. **Run directory and lock**: ``runs/<script>/<env>__<seed>__<time>`` unless
   ``--output-dir``; a second run into a directory in use exits 3; a fresh run into a
   directory that holds checkpoints exits 2 (``--resume auto`` continues it).
3. **Logs, metrics, progress**: ``logs/main.log``, ``metrics.csv`` (the core columns first) and
   TensorBoard under CleanRL's tag names (``charts/episodic_return`` per finished episode),
   a tqdm bar on a terminal, otherwise a log line every ``log_interval_s``.
4. **Resume**: counters, RNG state and the recent returns come back with the model, so the
   step count and ``metrics.csv`` continue where the checkpoint left them.
5. **Signals**: the first Ctrl+C or SIGTERM lets the step in flight finish, then the run
   saves and exits 130 / 143; a second Ctrl+C exits at once (workers die with their parent).
6. **Checkpoints** every ``checkpoint_interval_s`` (the trainer says when it is at a safe
   point) and at the end, atomically, with everything needed to continue and to rebuild the
   policy.
7. **The end**: ``summary.json`` with the same keys in every script (and a time budget of the
   whole process), ``plots/training_curve.png``, exit status 0 (a budget, the deadline or the
   target reached), 1 (training failed), 2 (bad config), 3 (locked), 130 / 143 (signal).

A trainer is a class ``Trainer(run)`` with ``train()`` (the loop: it returns when
:meth:`Run.stop_reason` says so) and ``state_dict()`` (a checkpoint's content, or None when
there is nothing worth saving), and optionally ``summary()`` (extra summary keys) and
``plot(run)``. Whatever it starts (workers, shared memory) it hands to :meth:`Run.defer`, which
releases it at the end whatever happens, also when the trainer's own set-up fails halfway.

This module is the sequence; the settings, the env probe and the resume lookup of step 1 are in
:mod:`common.run_setup`, the :class:`~common.training_run.Run` a trainer is handed (steps 3 to 6)
in :mod:`common.training_run`.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.config import EXIT_BAD_CONFIG, ConfigError, config_yaml, parse_args, save_config, unusable_directory
from common.distributed import PeerFailure, PeerRefused
from common.run_setup import (  # noqa: F401  (RunConfig ... config_dict: what the scripts import from here)
    EnvInfo,
    FlatConfig,
    RunConfig,
    checkpoint_run_dir,
    config_dict,
    config_groups,
    load_resume,
    parse_env_kwargs,
    probe_env,
)
from common.runlog import EXIT_LOCKED, RunLock, default_run_dir, setup_logging, write_summary
from common.supervisor import WorkerConfigError, WorkerFailed
from common.tracking import check_tracking
from common.training_run import RECENT, Run, TimeBudget, TrainingDiverged  # noqa: F401  (RECENT: as above)

EXIT_OK, EXIT_FAILED = 0, 1


@dataclass
class Mode:
    """What the lifecycle needs to know about a script."""

    script: str  # file name without .py: runs/<script>/, checkpoint["script"]
    config: type | dict[str, type]  # the dataclass(es) at the top of the script
    trainer: Callable[[Run], Any]  # the algorithm
    description: str = ""
    actions: tuple[str, ...] = ("Discrete", "Box")  # action spaces the mode trains
    checkpoint_pattern: str = r".*\.pt"  # files --resume auto considers
    resume_requires: tuple[str, ...] = ("model",)  # keys a checkpoint to continue from must have
    resume_must_match: tuple[str, ...] = ()  # settings a checkpoint must share to be continued (beyond env, widths)
    metrics_columns: list[str] = field(default_factory=list)  # metrics.csv columns after the core ones
    env_kwargs: Callable[[Any], dict] = lambda cfg: {}  # gymnasium.make kwargs from the config (plain values)
    check: Callable[[Any, EnvInfo], None] | None = None  # the mode's own checks (RAM, /dev/shm ...): ConfigError
    probe: Callable[[Any], EnvInfo] | None = None  # replaces probe_env (e.g. to load a data cache once)
    distributed: bool = False  # under torchrun, every rank runs the trainer (DD-PPO); rank 0 writes
    # The ranks exchange CPU data only (common.rank_exchange's messages, the handshake): gloo between them, also
    # where the learner is on a GPU and the actor nodes have none (NCCL would need a GPU on every rank).
    cpu_collectives: bool = False
    # What a rank must share with rank 0 under torchrun (the code, the env, the settings that shape what the ranks
    # exchange): the handshake of common.rank_exchange refuses a rank whose fingerprint differs. None: the mode
    # runs no handshake.
    fingerprint: Callable[[Run], dict] | None = None
    # What common.evaluate plays from a run directory, before the latest file of its checkpoints/: the first of
    # these files that exists (a final model, a population's best agent) ...
    result_files: tuple[str, ...] = ()
    # ... and, for --member K, the latest checkpoint of population member K ({member} stands for K).
    member_checkpoints: str | None = None
    # The run's big buffers for a config (name -> bytes), computed with the function the script allocates them
    # with: what the launcher plans RAM and /dev/shm with. The env is the probed one, or None where the buffers do
    # not depend on it (probing would build them). None: the mode allocates nothing worth planning for.
    buffers: Callable[[Any, EnvInfo | None], dict[str, int]] | None = None
    shm_buffers: tuple[str, ...] = ()  # which of those buffers live in /dev/shm (where a config makes them)


def env_kwargs_of(mode: Mode, cfg: Any) -> dict[str, Any]:
    """What every env of the run is made with: the mode's own settings, then ``--env-kwargs``."""
    return {**mode.env_kwargs(cfg), **parse_env_kwargs(getattr(cfg, "env_kwargs", []))}


def prepare(mode: Mode, argv: list[str] | None,
            exit_on_error: bool = True) -> tuple[Any, EnvInfo, Path, Path | None, dict | None, bool]:
    """Steps 1 and the checks of step 2: everything that may exit 2 before anything is written."""
    parsed, actions = parse_args(mode.config, argv, mode.description, exit_on_error)
    cfg = FlatConfig(parsed) if isinstance(parsed, dict) else parsed
    if not (mode.distributed and torchrun_rank() > 0):  # rank 0 alone logs to the tracker
        check_tracking(getattr(cfg, "track", None))
    env = mode.probe(cfg) if mode.probe else probe_env(cfg.env_id, env_kwargs_of(mode, cfg), mode.actions, cfg.seed)
    if mode.check is not None:
        mode.check(cfg, env)
    if cfg.resume is None and mode.distributed and elastic_restarts() > 0:
        cfg.resume = "auto"  # torchrun restarted the job (--max-restarts): continue from its newest checkpoint
    resume_path, state = (None, None)
    if not (mode.distributed and torchrun_rank() > 0):  # rank 0 loads it and hands it to the others
        resume_path, state = load_resume(mode.script, cfg, mode.checkpoint_pattern, mode.resume_requires,
                                         mode.resume_must_match)
    if resume_path is not None and cfg.output_dir is None:
        cfg.output_dir = str(checkpoint_run_dir(resume_path))
    run_dir = Path(cfg.output_dir) if cfg.output_dir else default_run_dir(mode.script, cfg.env_id, cfg.seed)
    unusable = unusable_directory(run_dir) if torchrun_rank() == 0 else None  # rank 0 alone writes it
    if unusable:
        raise ConfigError("output_dir", str(run_dir), unusable)
    return cfg, env, run_dir, resume_path, state, actions.validate_only


def elastic_restarts() -> int:
    """How many times torchrun has restarted this job's workers (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def torchrun_rank() -> int:
    from common.distributed import launched_by_torchrun

    return int(os.environ["RANK"]) if launched_by_torchrun() else 0


def _held_by_another_run(run_dir: Path) -> bool:
    lock_file = run_dir / ".lock"
    if not lock_file.exists():
        return False
    probe = RunLock(run_dir)
    if not probe.acquire(create=False):
        return True
    probe.release()
    return False


def open_run(mode: Mode, cfg: Any, env: EnvInfo, run_dir: Path, resume_path: Path | None, state: dict | None,
             budget: TimeBudget) -> Run:
    """Step 2 and 3: the run directory, its lock (exit 3), logs and metrics."""
    from common.checkpoint import latest_checkpoint

    if _held_by_another_run(run_dir):
        print(f"error: another run holds the lock on {run_dir} (see {run_dir / '.lock'})", file=sys.stderr)
        sys.exit(EXIT_LOCKED)
    if state is None and latest_checkpoint(run_dir / "checkpoints", mode.checkpoint_pattern) is not None:
        raise ConfigError("output_dir", str(run_dir), "holds checkpoints of an earlier run; pass --resume auto to "
                                                      "continue it, or choose another directory")
    for sub in ("logs", "checkpoints", "plots"):
        (run_dir / sub).mkdir(parents=True, exist_ok=True)
    lock = RunLock(run_dir)
    if not lock.acquire():
        print(f"error: another run holds the lock on {run_dir} (see {lock.path})", file=sys.stderr)
        sys.exit(EXIT_LOCKED)
    setup_logging(run_dir / "logs" / "main.log", f"prl.{mode.script}", console=True)
    save_config(config_groups(cfg), run_dir / "config.yaml")
    return Run(mode.script, cfg, env, run_dir, lock, resume_path, state, budget, mode.metrics_columns,
               env_kwargs=env_kwargs_of(mode, cfg))


def run_training(mode: Mode, argv: list[str] | None = None) -> int:
    """The whole lifecycle of one run of ``mode``; returns the exit status."""
    from common.distributed import StartRefused, launched_by_torchrun

    # Under torchrun a refused value is raised, not exited on, so that its line can reach the other ranks.
    with_peers = mode.distributed and launched_by_torchrun() and os.environ["WORLD_SIZE"] != "1"
    try:
        run = open_any_run(mode, argv, exit_on_error=not with_peers)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        _tell_the_other_ranks(mode, argv, str(err))
        return EXIT_BAD_CONFIG
    except StartRefused as err:  # another rank's configuration, or rank 0's run directory
        print(f"error: {err}", file=sys.stderr)
        return err.status
    except SystemExit as exit_:  # argparse refused the command line, in one line already
        if exit_.code == EXIT_BAD_CONFIG:
            _tell_the_other_ranks(mode, argv, "its command line is refused (its own line says why)")
        raise
    return EXIT_OK if run is None else execute(mode, run)


def _tell_the_other_ranks(mode: Mode, argv: list[str] | None, reason: str) -> None:
    """Under torchrun the other ranks wait for this one at their first collective: they end with exit
    status 2 too (common.distributed.refuse_start). Not with --validate-only, where no rank meets another."""
    from common.distributed import refuse_start

    args = sys.argv[1:] if argv is None else [str(a) for a in argv]
    if mode.distributed and "--validate-only" not in args:
        device = next((args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--device"),
                      getattr(mode.config, "device", "cpu"))
        refuse_start(reason, "cpu" if mode.cpu_collectives else device)


def open_any_run(mode: Mode, argv: list[str] | None, exit_on_error: bool = True,
                 budget: TimeBudget | None = None) -> Run | None:
    """Steps 1 to 3 (None for --validate-only, after printing the config); ConfigError for a bad one."""
    budget = budget or TimeBudget()
    cfg, env, run_dir, resume_path, state, validate_only = prepare(mode, argv, exit_on_error)
    if validate_only:
        print(config_yaml(config_groups(cfg)), end="")
        return None
    from common.shm import reclaim_stale_segments

    reclaim_stale_segments()
    if mode.distributed:
        return open_distributed_run(mode, cfg, env, run_dir, resume_path, state, budget)
    return open_run(mode, cfg, env, run_dir, resume_path, state, budget)


def train_in_process(mode: Mode, config: Any, env_factory: Callable | None = None) -> dict:
    """The Python entry point (``train(config)`` in every script): the same run as the command line.

    ``config`` is the script's ``Config`` (or, for a grouped script, a dict of its group
    dataclasses); it goes through the same checks as a ``--config`` file. ``env_factory``: the
    user's env class or env-making function, trained without registering it: the run's
    ``env_id`` becomes its ``"module:name"`` (:func:`common.envs.env_factory_id`; a lambda or
    a closure is refused in one line), which every process registers on first use and
    ``config.yaml``, checkpoints and ``--resume`` keep; ``env_kwargs`` reach it. Returns what
    ``summary.json`` holds, plus ``run_dir``. A bad config raises ValueError (nothing written),
    a directory locked by another run RuntimeError; a run that fails returns its summary with
    ``exit_code`` 1 and ``stop_reason`` saying why. Ctrl+C (KeyboardInterrupt in a notebook) stops
    the run as on the command line: a checkpoint, then the summary is returned with
    ``stop_reason`` "interrupted" and ``exit_code`` 130. Nothing outlives the call: workers,
    shared memory, signal handlers and log files are all released, so it can be called again.
    """
    import tempfile

    budget = TimeBudget(started=time.time())
    if env_factory is not None:
        from common.envs import env_factory_id

        config = _with_env_id(config, env_factory_id(env_factory))
    with tempfile.TemporaryDirectory(prefix="prl_config_") as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(config_yaml(config_groups(config)))
        try:
            run = open_any_run(mode, ["--config", str(path)], exit_on_error=False, budget=budget)
        except ConfigError as err:
            raise ValueError(str(err).replace(f"--config {str(path)!r}: ", "")) from None
        except SystemExit as exit_:
            raise RuntimeError(f"cannot start the run (exit status {exit_.code}); see the line above") from None
    execute(mode, run)
    return {**run.final_summary, "run_dir": str(run.run_dir)}


def _with_env_id(config: Any, env_id: str) -> Any:
    """A copy of ``config`` (a dataclass, or a grouped script's groups) with ``env_id`` set; the caller's stays."""
    import copy

    groups = config if isinstance(config, dict) else config_groups(config)
    if isinstance(groups, dict):
        config = FlatConfig({name: copy.deepcopy(group) for name, group in groups.items()})
    else:
        config = copy.deepcopy(config)
    config.env_id = env_id
    return config


def open_distributed_run(mode: Mode, cfg: Any, env: EnvInfo, run_dir: Path, resume_path: Path | None,
                         state: dict | None, budget: TimeBudget) -> Run:
    """Under torchrun: rank 0 opens the run as usual; the other ranks continue its checkpoint and
    log to stderr, tagged with their rank, and write no file."""
    from common import distributed

    dist = distributed.from_environment("cpu" if mode.cpu_collectives else getattr(cfg, "device", "cpu"))
    # torchrun restarts the ranks of every node, but only the node whose rank failed counts a restart
    # (TORCHELASTIC_RESTART_COUNT): rank 0 may be one that does not know the job is continuing.
    restarted = distributed.start_together(dist, elastic_restarts() > 0)  # StartRefused: a rank's config is bad
    if restarted and dist.is_main and cfg.resume is None:
        cfg.resume = "auto"
        resume_path, state = load_resume(mode.script, cfg, mode.checkpoint_pattern, mode.resume_requires,
                                         mode.resume_must_match)
        if resume_path is not None and cfg.output_dir is None:
            run_dir = checkpoint_run_dir(resume_path)
    resume_path, state = dist.broadcast_object((resume_path, state))
    run_dir = dist.agree_on_path(run_dir)
    if resume_path is not None:
        cfg.output_dir = str(run_dir)
    if dist.is_main:
        try:
            run = open_run(mode, cfg, env, run_dir, resume_path, state, budget)
        except (ConfigError, SystemExit) as err:  # another run's checkpoints (2) or lock (3): every rank ends so
            distributed.rank_0_opened(dist, refused=err)
            raise
        distributed.rank_0_opened(dist)
        run.dist, run.is_main = dist, True
        return run
    distributed.rank_0_opened(dist)
    distributed.log_to_stderr(dist.rank)
    return Run(mode.script, cfg, env, run_dir, None, resume_path, state, budget, mode.metrics_columns, dist,
               env_kwargs_of(mode, cfg))


def execute(mode: Mode, run: Run) -> int:
    """Steps 4 to 7: build the trainer, train, save, summarize; every failure has its exit status.
    The run's Ctrl+C and SIGTERM handlers are in place for exactly this long, however it ends (a
    program that calls train() again, or goes on, gets its own handlers back)."""
    from common.plots import Plotter

    run.graceful.install()
    # The plotter imports matplotlib while this process starts its workers, imports torch and trains.
    run.plotter = Plotter.start() if run.is_main else None
    try:
        return _train_save_summarize(mode, run)
    finally:
        if run.plotter is not None:
            run.plotter.close()
        run.graceful.uninstall()


def _train_save_summarize(mode: Mode, run: Run) -> int:
    from common.checkpoint import set_rng_state

    log = run.log
    trainer, exit_code, reason, save = None, EXIT_OK, "finished", True
    try:
        if run.resumed is not None:
            set_rng_state(run.resumed["rng"])
            log.info("resumed from %s at step %d", run.resume_path, run.counters["global_step"])
        trainer = mode.trainer(run)
        run.start_clock()
        trainer.train()
        reason = run.stop_reason() or "finished"
    except (WorkerConfigError, PeerRefused) as err:  # the configuration is at fault, not the training: exit 2
        refused = isinstance(err, PeerRefused)
        log.error("%s" if refused else "a worker cannot run with this configuration: %s", err)
        print(f"error: {err}", file=sys.stderr)
        exit_code, reason, save = EXIT_BAD_CONFIG, f"{'refused' if refused else 'bad configuration'}: {err}", False
    except (WorkerFailed, PeerFailure) as err:
        log.error("training failed: %s", err)
        # A worker given up on leaves the learner's state whole, worth saving; a lost peer leaves it unknown.
        exit_code, reason, save = EXIT_FAILED, f"failed: {err}", isinstance(err, WorkerFailed)
    except TrainingDiverged as err:
        log.error("training failed: %s; stopping without saving. Last good checkpoint: %s", err,
                  run.last_good_checkpoint or "none (no checkpoint was written yet)")
        exit_code, reason, save = EXIT_FAILED, f"diverged: {err}", False
    except Exception as err:
        log.exception("training failed")
        exit_code, reason, save = EXIT_FAILED, f"failed: {type(err).__name__}: {err}", False
    if run.graceful.requested and exit_code == EXIT_OK:
        exit_code, reason = run.graceful.exit_code, "interrupted"
    return finish(run, trainer, exit_code, reason, save)


def finish(run: Run, trainer: Any, exit_code: int, reason: str, save: bool) -> int:
    log = run.log
    extra: dict = {}
    try:
        with run.budget.part("shutdown"):
            if trainer is not None and save and (run.counters["global_step"] > 0 or run.resumed is not None):
                run.save_checkpoint(trainer.state_dict())
            if trainer is not None:
                extra = dict(trainer.summary()) if hasattr(trainer, "summary") else {}
    except Exception:
        log.exception("could not save the final checkpoint")
        exit_code = exit_code or EXIT_FAILED
    finally:
        with run.budget.part("shutdown"):
            run.close_resources()
    log.info("stopping after update %d: %s", run.counters["updates"], reason)
    summary = run.summary(reason, exit_code, extra)
    if run.is_main:
        write_summary(run.run_dir, summary)
        _plot(run, trainer)
        if run.metrics.tracker is not None:  # --track: the summary, plots and checkpoint, then the tracked run ends
            run.metrics.tracker.end(exit_code)
    budget = summary["time_budget"]
    log.info("summary: %d steps in %.1f s (%s steps/s), final mean return %s, best %s; process %.1f s: %s -> %s",
             summary["global_step"], summary["wall_time_s"], summary["sps"], summary["final_mean_return"],
             summary["best_mean_return"], budget["process_s"],
             ", ".join(f"{k[:-2]} {v:.1f}" for k, v in budget.items() if k != "process_s"), run.run_dir)
    log.info("exit status %d", exit_code)
    run.final_summary = summary
    run.close()
    run.dist.close(abort=exit_code == EXIT_FAILED)
    return exit_code


def _plot(run: Run, trainer: Any) -> None:
    """``plots/training_curve.png`` and the trainer's own plots (``trainer.plots(run)``), drawn by the
    run's plotter (common/plots.py); a plot that fails is logged and the run goes on."""
    metrics = str(run.run_dir / "metrics.csv")
    plots = [{"plot": "training_curve", "metrics": metrics, "out": str(run.run_dir / "plots" / "training_curve.png"),
              "title": f"{run.script}: {run.cfg.env_id}"}]
    try:
        if trainer is not None and hasattr(trainer, "plots"):
            plots += [{"metrics": metrics, **plot} for plot in trainer.plots(run)]
        errors = run.plotter.draw(plots)
    except Exception:  # a plot is never worth failing a finished run
        run.log.exception("could not draw the plots")
        return
    for error in errors:
        run.log.error("could not draw the plots:\n%s", error.rstrip())
