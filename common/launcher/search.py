"""``--search FILE.yaml``: an Optuna study over a training script's config fields, each trial an ordinary run.

The search file names the script, the settings every trial shares, the ranges to search, the objective
(``time_to_target``: seconds of training until the mean of the last 100 returns reaches the target, lower is
better; ``final_return``: that mean at the end, higher is better), the number of trials and the seeds each is
scored over. A trial runs the script once per seed, side by side, each into its own run directory
(``trial_<n>/seed_<s>/``), and its value is the median (or mean) of its runs' scores. As the runs write
``metrics.csv`` the search reads it and reports the trial's mean of the last 100 returns to the pruner every
``prune_every_steps`` env steps; a trial the pruner calls hopeless is stopped with SIGINT, which its runs
answer as they answer Ctrl+C (checkpoint, summary, exit 130). How many trials run at once comes from the
launcher's plan: the cores and RAM one run takes (:func:`common.launcher.plan.runs_at_once`).

The study lives in a database: SQLite in the search's directory by default, or any RDB URL, or an Optuna
journal file (``journal:PATH``), which several processes, on several machines, share. Ctrl+C (or SIGTERM, or
``search_hours`` running out) stops the running trials as above; they are recorded as failed with the user
attribute ``interrupted`` and queued again, so the same command continues the study: a trial whose runs have
a step or episode budget continues from their checkpoints, one with a ``duration`` (hours per invocation)
starts again. After every finished trial the best trial's settings are written to ``best.yaml``, a file the
script's ``--config`` takes.
"""


from __future__ import annotations

import csv
import ctypes
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import script_modes, system
from common.launcher import ROOT, UsageError
from common.launcher.plan import cores_per_run, run_bytes, runs_at_once
from common.launcher.search_file import AGGREGATES, Search, encode, load_search, require_optuna

MAX_SHORTFALL = 2.0  # time_to_target: an unreached target costs at most 3x the run's time (see run_score)
POLL_S = 0.5
EXIT_INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}

# --------------------------------------------------------------------------- trials at once

def size_trials(search: Search, machine: system.Machine) -> int:
    """Trials at once: the runs of the launcher's plan that fit side by side, divided by the seeds per trial."""
    cfg, env = search.sizing_config
    for name, entry in search.ranges.items():  # size for the largest value of every searched number
        if entry.largest() is not None:
            setattr(cfg, name, entry.largest())
    mode = script_modes.script_module(search.script).MODE
    workers = int(getattr(cfg, "num_workers", 0) or 0)
    buffers = mode.buffers(cfg, None if mode.probe else env) if mode.buffers else {}
    shm = sum(buffers.get(k, 0) for k in mode.shm_buffers)
    cuda = bool(machine.gpus) and str(getattr(cfg, "device", "cpu")) != "cpu"
    cores = cores_per_run(search.mode, workers, bool(getattr(cfg, "async_training", False)))
    runs, bound = runs_at_once(machine, cores, run_bytes(workers, buffers, cuda), shm)
    fitted = max(1, runs // search.seeds)
    search.sizing = (f"{runs} run(s) of {cores} core(s) fit side by side (bounded by {', '.join(bound)}); "
                     f"{search.seeds} seed(s) per trial")
    if search.trials_at_once is None:
        return fitted
    search.sizing = f"set to {search.trials_at_once} ({search.sizing}: {fitted} trial(s) at once)"
    return search.trials_at_once


# --------------------------------------------------------------------------- scores from a run's files

def read_rows(path: Path) -> list[dict[str, str]]:
    """The complete rows of ``metrics.csv`` so far (a row still being written is left for the next read)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    if not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    return list(csv.DictReader(text.splitlines()))


def _number(row: dict, key: str) -> float:
    try:
        return float(row.get(key) or "nan")
    except ValueError:
        return math.nan


def last_mean(rows: list[dict]) -> float | None:
    """The last mean of the last 100 returns in ``rows``, or before there were 100 the mean of every return so far
    (each row's mean return weighted by the episodes it counts); None before the first episode."""
    means = [m for m in (_number(r, "return_mean100") for r in rows) if math.isfinite(m)]
    if means:
        return means[-1]
    total = episodes = 0.0
    for row in rows:
        count, mean = _number(row, "episodes") - episodes, _number(row, "episodic_return")
        if math.isfinite(mean) and count > 0:
            total, episodes = total + count * mean, episodes + count
    return total / episodes if episodes else None


def run_score(rows: list[dict], objective: str, target: float | None, summary: dict | None = None) -> float | None:
    """One run's score from its metrics rows (and, once it has ended, its summary); None where it has none yet.

    ``final_return``: the mean of the last 100 returns at the end (the summary's ``final_mean_return``; a run with
    fewer episodes: the mean of them all). ``time_to_target``: the training seconds at the first row where that mean
    reached the target; a run that has not reached it scores its seconds so far times ``1 + shortfall``, the
    shortfall being how far its best mean stayed below the target in units of the target (at most MAX_SHORTFALL),
    so that any run that reached the target within a budget beats any that did not, and of those the one that
    came closer in as long wins.
    """
    if objective == "final_return":
        final = (summary or {}).get("final_mean_return")
        return float(final) if final is not None else last_mean(rows)
    means = [(_number(r, "wall_time"), _number(r, "return_mean100")) for r in rows]
    means = [(wall, mean) for wall, mean in means if math.isfinite(mean)]
    reached = next((wall for wall, mean in means if mean >= target), None)
    if summary and str(summary.get("stop_reason", "")).startswith("target return"):
        reached = min(reached or math.inf, float(summary["wall_time_s"]))
    if reached is not None:
        return reached
    walls = [_number(r, "wall_time") for r in rows]
    seconds = float(summary["wall_time_s"]) if summary and summary.get("wall_time_s") else max(walls, default=0.0)
    if not seconds:
        return None
    best = max((mean for _, mean in means), default=None) if means else last_mean(rows)
    shortfall = MAX_SHORTFALL if best is None else (target - best) / max(abs(target), 1.0)
    return seconds * (1.0 + min(MAX_SHORTFALL, max(0.0, shortfall)))


# --------------------------------------------------------------------------- the trials

@dataclass
class SeedRun:
    seed: int
    run_dir: Path
    output: Path  # its console output
    process: subprocess.Popen
    stopped: int = 0  # SIGINTs sent

    def exit_code(self) -> int | None:
        return self.process.poll()

    def stop(self) -> None:
        if self.exit_code() is None:
            try:
                os.kill(self.process.pid, signal.SIGINT)
            except ProcessLookupError:
                pass
        self.stopped += 1

    def rows(self) -> list[dict]:
        return read_rows(self.run_dir / "metrics.csv")

    def summary(self) -> dict | None:
        try:
            return json.loads((self.run_dir / "summary.json").read_text())
        except (OSError, ValueError):
            return None


@dataclass
class TrialRuns:
    """A trial in flight: its runs, and how far its scores have been reported to the pruner."""

    trial: Any  # optuna.Trial
    runs: list[SeedRun]
    next_report: int
    pruned_at: int | None = None
    interrupted: bool = False

    def ended(self) -> bool:
        return all(r.exit_code() is not None for r in self.runs)

    def stop(self) -> None:
        for r in self.runs:
            if r.stopped < 1:
                r.stop()


def die_with_search() -> None:
    """In a trial's run, before it starts: SIGTERM when the search process dies, however it dies (the run then
    saves a checkpoint and exits 143), so that no trial outlives its search."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Searcher:
    """Runs trials of one study from this process until it has its trials, or is stopped."""

    def __init__(self, search: Search, study: Any, trials_at_once: int, passthrough: list[str]):
        self.search, self.study, self.at_once, self.passthrough = search, study, trials_at_once, passthrough
        self.active: list[TrialRuns] = []
        self.stop_signal: int | None = None
        self.stop_reason: str | None = None
        self.signals = 0
        self.name = f"{socket.gethostname()}:{os.getpid()}"
        self.deadline = time.monotonic() + search.search_hours * 3600 if search.search_hours else math.inf
        self.best_number: int | None = None

    # -- signals
    def on_signal(self, signum: int, _frame: Any) -> None:
        self.signals += 1
        self.stop_signal = self.stop_signal or signum
        self.stop_reason = self.stop_reason or signal.Signals(signum).name
        if self.signals == 1:
            print(f"{signal.Signals(signum).name}: stopping the running trials (checkpoints, summaries); "
                  "run the same command again to continue the study", file=sys.stderr, flush=True)
        else:  # a second Ctrl+C: the runs' own second Ctrl+C ends them at once
            for trial in self.active:
                for r in trial.runs:
                    r.stop()

    # -- the loop
    def counted_trials(self) -> int:
        """Trials that count towards ``trials``: finished ones (pruned and failed too, but not those interrupted,
        which run again), of every process, and those this process runs."""
        from optuna.trial import TrialState

        done = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED,
                                                                           TrialState.FAIL))
                if not t.user_attrs.get("interrupted")]
        return len(done) + len(self.active)

    def run(self) -> int:
        handlers = {s: signal.signal(s, self.on_signal) for s in EXIT_INTERRUPTED}
        try:
            while True:
                if self.stop_reason is None and time.monotonic() >= self.deadline:
                    self.stop_reason = f"search_hours {self.search.search_hours:g} reached"
                    print(f"{self.stop_reason}: stopping the running trials", flush=True)
                if self.stop_reason is not None:
                    for trial in self.active:
                        if trial.pruned_at is None and not trial.interrupted and not trial.ended():
                            trial.interrupted = True
                            trial.stop()
                while self.stop_reason is None and len(self.active) < self.at_once and \
                        self.counted_trials() < self.search.trials:
                    self.active.append(self.start_trial())
                if not self.active:
                    break
                for trial in list(self.active):
                    self.follow(trial)
                time.sleep(POLL_S)
        finally:
            for trial in self.active:  # an error in the search itself: no run outlives it
                trial.stop()
                for r in trial.runs:
                    r.process.wait()
            for s, handler in handlers.items():
                signal.signal(s, handler)
        if self.stop_signal is not None:
            return EXIT_INTERRUPTED[self.stop_signal]
        return 0

    def start_trial(self) -> TrialRuns:
        distributions = {name: entry.distribution() for name, entry in self.search.ranges.items()}
        trial = self.study.ask(distributions)
        values = {name: self.search.ranges[name].value(trial.params[name]) for name in self.search.ranges}
        settings = {**self.search.settings, **values}
        trial_dir = self.search.output_dir / f"trial_{trial.number:04d}"
        continued = trial.user_attrs.get("run_dirs") if self.search.resumable else None
        seeds = [self.search.first_seed + i for i in range(self.search.seeds)]
        run_dirs = [Path(d) for d in continued] if continued else [trial_dir / f"seed_{s}" for s in seeds]
        trial_dir.mkdir(parents=True, exist_ok=True)
        settings_file = trial_dir / "settings.yaml"
        settings_file.write_text(settings_yaml(settings, f"trial {trial.number} of study {self.study.study_name}"))
        trial.set_user_attr("searcher", self.name)
        trial.set_user_attr("settings", settings)
        trial.set_user_attr("run_dirs", [str(d) for d in run_dirs])
        runs = []
        for seed, run_dir in zip(seeds, run_dirs):
            command = [sys.executable, str(ROOT / self.search.script), "--config", str(settings_file),
                       "--seed", str(seed), "--output-dir", str(run_dir), "--resume", "auto", *self.passthrough]
            output = trial_dir / f"seed_{seed}.out"
            with open(output, "a") as out:
                process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                           preexec_fn=die_with_search,
                                           env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                               filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
            runs.append(SeedRun(seed, run_dir, output, process))
        print(f"trial {trial.number} started ({len(runs)} run(s) in {trial_dir}): {shown(values)}", flush=True)
        return TrialRuns(trial, runs, self.search.prune_every_steps)

    def follow(self, trial: TrialRuns) -> None:
        """Report the trial's new scores to the pruner, stop it if hopeless, finish it once its runs have ended."""
        ended = trial.ended()
        if trial.pruned_at is None and not trial.interrupted:
            self.report(trial)
            if not ended and self.search.pruner != "none" and trial.trial.should_prune():
                trial.pruned_at = trial.next_report - self.search.prune_every_steps
                print(f"trial {trial.trial.number} pruned at {trial.pruned_at} env steps", flush=True)
                trial.stop()
        if ended:
            self.finish(trial)

    def report(self, trial: TrialRuns) -> None:
        """At every ``prune_every_steps`` env steps that all of its runs have passed (or ended before), the trial's
        mean of the last 100 returns there (the aggregate over its runs; negated where the study minimizes, as it
        does time to target), for the pruner to compare with other trials' at the same step."""
        search = self.search
        sign = 1.0 if search.direction == "maximize" else -1.0
        rows = [r.rows() for r in trial.runs]
        while True:
            step, means, ended = trial.next_report, [], 0
            for run_rows, r in zip(rows, trial.runs):
                if max((_number(row, "global_step") for row in run_rows), default=-1.0) >= step:
                    means.append(last_mean([row for row in run_rows if _number(row, "global_step") <= step]))
                elif r.exit_code() is None:
                    return  # this run has not got there yet
                else:  # it ended before this step (a budget, the target): its last mean stands
                    means.append(last_mean(run_rows))
                    ended += 1
            if ended == len(trial.runs):
                return
            if all(m is not None for m in means):  # no episode has ended yet: nothing to compare at this step
                trial.trial.report(sign * AGGREGATES[search.aggregate](means), step)
            trial.next_report += search.prune_every_steps

    def finish(self, trial: TrialRuns) -> None:
        from optuna.trial import TrialState

        self.active.remove(trial)
        t, number = trial.trial, trial.trial.number
        codes = [r.exit_code() for r in trial.runs]
        summaries = [r.summary() for r in trial.runs]
        t.set_user_attr("exit_codes", codes)
        if trial.interrupted:
            t.set_user_attr("interrupted", True)
            self.study.tell(t, state=TrialState.FAIL)
            again = {"continues": number, **({"run_dirs": t.user_attrs["run_dirs"]} if self.search.resumable else {})}
            self.study.enqueue_trial(t.params, user_attrs=again)
            print(f"trial {number} interrupted; queued to run again", flush=True)
            return
        if trial.pruned_at is not None and any(c == EXIT_INTERRUPTED[signal.SIGINT] for c in codes):
            t.set_user_attr("pruned_at_step", trial.pruned_at)
            self.study.tell(t, state=TrialState.PRUNED)
            return
        # (runs that had ended their budget before the stop came are scored as they are)
        failed = [(r, s) for r, c, s in zip(trial.runs, codes, summaries) if c != 0]
        scores = [run_score(r.rows(), self.search.objective, self.search.target, s)
                  for r, s in zip(trial.runs, summaries)]
        if failed or any(s is None for s in scores):
            r, s = failed[0] if failed else (trial.runs[scores.index(None)], summaries[scores.index(None)])
            why = (s or {}).get("stop_reason") or last_line(r.output)
            reason = f"seed {r.seed} exited {r.exit_code()}: {why}" if failed else f"seed {r.seed}: no score ({why})"
            t.set_user_attr("failure", reason)
            self.study.tell(t, state=TrialState.FAIL)
            print(f"trial {number} failed: {reason}", flush=True)
            return
        value = AGGREGATES[self.search.aggregate](scores)
        t.set_user_attr("scores", dict(zip([str(r.seed) for r in trial.runs], scores)))
        self.study.tell(t, value)
        print(f"trial {number} finished: {self.search.objective} {value:.4g} ({self.search.aggregate} of "
              f"{', '.join(f'{s:.4g}' for s in scores)})", flush=True)
        self.write_best()

    def write_best(self) -> None:
        """``best.yaml``: the best trial's settings (of every process), for the script's ``--config``."""
        try:
            best = self.study.best_trial
        except ValueError:  # no trial has finished
            return
        if best.number == self.best_number:
            return
        self.best_number = best.number
        seeds = best.user_attrs.get("scores", {})
        header = (f"the best trial of study {self.study.study_name} ({self.search.storage}): trial {best.number}, "
                  f"{self.search.objective} {best.value:.6g}, the {self.search.aggregate} over seed(s) "
                  f"{', '.join(seeds)}\nrun: python {self.search.script} --config "
                  f"{' '.join([str(self.search.output_dir / 'best.yaml'), *self.passthrough])}")
        (self.search.output_dir / "best.yaml").write_text(settings_yaml(best.user_attrs["settings"], header))


def shown(values: dict) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items())


def last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return "no output"
    return lines[-1] if lines else "no output"


def settings_yaml(settings: dict, header: str) -> str:
    import yaml

    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + yaml.safe_dump(settings, sort_keys=False, default_flow_style=None)


# --------------------------------------------------------------------------- the study

def open_storage(optuna: Any, url: str) -> Any:
    """The study's database: an Optuna journal file (``journal:PATH``) or an RDB URL; SQLite waits for a lock
    held by another searching process instead of failing."""
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        path = Path(url.removeprefix("journal:"))
        path.parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.JournalStorage(JournalFileBackend(str(path)))
    if url.startswith("sqlite:///"):
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        return optuna.storages.RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})
    return optuna.storages.RDBStorage(url)


def make_pruner(optuna: Any, search: Search) -> Any:
    if search.pruner == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=search.prune_startup_trials,
                                           n_warmup_steps=search.prune_warmup_steps)
    if search.pruner == "successive_halving":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=max(search.prune_warmup_steps, search.prune_every_steps))
    return optuna.pruners.NopPruner()


def open_study(optuna: Any, search: Search) -> Any:
    # TPE, its first third of the trials (3 to 10) drawn at random.
    sampler = optuna.samplers.TPESampler(n_startup_trials=min(10, max(3, search.trials // 3)))
    try:
        study = optuna.create_study(storage=open_storage(optuna, search.storage), study_name=search.study_name,
                                    direction=search.direction, sampler=sampler, pruner=make_pruner(optuna, search),
                                    load_if_exists=True)
    except Exception as err:  # an unreachable server, a file that is not a study, a missing driver
        raise UsageError(f"storage {search.storage}: {str(err).splitlines()[0]}") from None
    if study.direction.name.lower() != search.direction:
        raise UsageError(f"study {search.study_name} in {search.storage} {study.direction.name.lower()}s; "
                         f"objective {search.objective} {search.direction}s: use another study_name")
    for values in search.enqueue:
        study.enqueue_trial({k: encode(v) for k, v in values.items()}, skip_if_exists=True)
    return study


def print_table(search: Search, study: Any) -> None:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    print(f"study {search.study_name}: {len(trials)} trial(s) in {search.storage}")
    for t in trials:
        value = f"{t.value:.4g}" if t.state == TrialState.COMPLETE else "-"
        note = ("interrupted" if t.user_attrs.get("interrupted") else
                f"at {t.user_attrs['pruned_at_step']} steps" if "pruned_at_step" in t.user_attrs else
                t.user_attrs.get("failure", ""))
        params = shown({k: search.ranges[k].value(v) if k in search.ranges else v for k, v in t.params.items()})
        print(f"  {t.number:>4}  {t.state.name:<8} {value:>10}  {params}  {note}".rstrip())
    try:
        best = study.best_trial
        print(f"best: trial {best.number}, {search.objective} {best.value:.4g}; settings in "
              f"{search.output_dir / 'best.yaml'}")
    except ValueError:
        print("no trial has finished yet")


def search_main(path: str, overrides: dict[str, Any], passthrough: list[str], machine: system.Machine,
                dry_run: bool = False) -> int:
    """``launch_parallel_training.py --search FILE.yaml``: the exit status (0: the study has its trials, or
    ``search_hours`` ran out; 130/143: stopped by a signal; 1: it has its trials and none has a value, every one
    failed; refusals are UsageError)."""
    optuna = require_optuna()
    search = load_search(path, overrides, passthrough)
    at_once = size_trials(search, machine)
    print(f"search {search.study_name}: {search.script}, {search.objective} ({search.direction}, the "
          f"{search.aggregate} over {search.seeds} seed(s)), {search.trials} trial(s), {at_once} at once: "
          f"{search.sizing}; study in {search.storage}", flush=True)
    if dry_run:
        return 0
    study = open_study(optuna, search)
    search.output_dir.mkdir(parents=True, exist_ok=True)
    searcher = Searcher(search, study, at_once, passthrough)
    status = searcher.run()
    searcher.write_best()
    print_table(search, study)
    if status == 0 and searcher.best_number is None and searcher.stop_reason is None:
        return 1  # every trial failed: nothing to recommend
    return status
