"""parallel_train_dqn.py's ``--learner ntuple``: the n-tuple value function of common/ntuple.py learned by TD
self-play in the main process and ``--num-workers`` workers over one table in shared memory, with the run's
checkpoints, metrics, evaluation and stop rules (docs/parallel_train_dqn.md, "The n-tuple learner")."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from common.evaluate import match
from common.ntuple import (
    EPSILON,
    FIRST_LOST,
    FIRST_WON,
    GAMES,
    LEARNING_RATE,
    PLIES,
    NTupleValue,
    SelfPlay,
    TrainConfig,
    count_row,
    random_walk_tuples,
    selfplay_worker,
)
from common.shm import SharedArrays
from common.supervisor import Supervisor

PLIES_PER_ITERATION = 32  # --learner ntuple: one iteration is this many plies of the main process's lockstep games


class NTupleTrainer:
    """--learner ntuple (ConnectFour-v0): an n-tuple value function learned by TD self-play (common/ntuple.py).

    There is no replay and no network to publish: every process plays its own lockstep games over one set
    of weights in shared memory and applies its TD updates there at once, so the main process plays and
    learns like the ``--num-workers`` worker processes beside it, and checkpoints, evaluates and writes the
    metrics between its plies. The learning rate and the exploration follow the run's budget.
    """

    def __init__(self, run, stop_at_targets: Callable[[Any, dict[str, float]], None]):
        cfg, resumed = run.cfg, run.resumed
        self.run, self.cfg, self.stop_at_targets = run, cfg, stop_at_targets
        self.train_config = ntuple_train_config(cfg)
        tuples = (resumed["model"]["tuples"].numpy() if resumed else
                  random_walk_tuples(cfg.ntuple_tuples, cfg.ntuple_length, cfg.seed))
        arrays = SharedArrays()
        run.defer(arrays.unlink_all)
        value = NTupleValue(tuples, arrays.create("weights", (2 * len(tuples) * 4 ** tuples.shape[1],), np.float32))
        if resumed:
            value.weights[:] = resumed["model"]["weights"].numpy()
        self.value, self.control = value, arrays.create("control", (2,), np.float64)
        self.counts = arrays.create("counts", (cfg.num_workers + 1, 5), np.int64)
        self.learning_rate, self.epsilon = self.schedule()
        run.counters.setdefault("iteration", 0)
        self.before = {key: run.counters[key] for key in ("global_step", "episodes", "updates")}
        self.results_before = np.array(run.counters.get("self_play_results", [0, 0, 0]), dtype=np.int64)
        iteration = run.counters["iteration"]  # a resumed run plays new games: its seeds move on
        self.play = SelfPlay(value, self.train_config, cfg.seed + 1_000_003 * iteration)
        specs = arrays.specs()
        supervisor = None

        def args_for(index: int) -> tuple:
            lives = supervisor.workers[index].restarts if supervisor is not None else 0
            return specs, tuples, self.train_config, cfg.seed + 1 + index + 1_000_003 * (iteration + lives)

        supervisor = self.supervisor = run.supervise(Supervisor(
            selfplay_worker, cfg.num_workers, args_for, name="worker", max_restarts=cfg.max_worker_restarts,
            start_timeout_s=max(cfg.worker_timeout_s, 120.0), hang_timeout_s=cfg.worker_timeout_s, logger=run.log))
        supervisor.start()
        supervisor.wait_ready(stop=lambda: run.graceful.requested)
        self.last_eval: dict[str, float] = {}
        self.final_eval: dict[str, float] | None = None
        run.start_duration()
        run.budget.mark_first_step()
        run.log.info("parallel_train_dqn: %s, n-tuple learner (%d random-walk %d-tuples, %s weights in shared "
                     "memory), self-play in the main process and %d worker(s), %d games in lockstep each, "
                     "run dir %s", cfg.env_id, len(tuples), tuples.shape[1], f"{value.weights.size:,}",
                     cfg.num_workers, self.train_config.games_in_lockstep, run.run_dir)

    def schedule(self) -> tuple[float, float]:
        """The learning rate and epsilon for the budget used so far, handed to the workers too."""
        fraction = self.run.budget_used()
        self.control[LEARNING_RATE] = self.train_config.learning_rate_at(fraction)
        self.control[EPSILON] = self.train_config.epsilon_at(fraction)
        return float(self.control[LEARNING_RATE]), float(self.control[EPSILON])

    def train(self) -> None:
        run, counters = self.run, self.run.counters
        while run.stop_reason() is None:
            started = time.perf_counter()
            games_before = counters["episodes"]
            self.learning_rate, self.epsilon = self.schedule()
            with run.budget.part("learn"):
                for _ in range(PLIES_PER_ITERATION):
                    self.play.ply(self.learning_rate, self.epsilon)
                    if run.graceful.requested:
                        break
            self.supervisor.poll(0.0)  # a worker's death is reported and it restarts; past the limit, raises
            self.count()
            counters["iteration"] += 1
            self.after_iteration()
            self.record(counters["episodes"] - games_before, time.perf_counter() - started)
            if run.checkpoint_due():
                run.save_checkpoint(self.state_dict())
        self.supervisor.stop()  # the weights stay as they are from here: the last checkpoint, the evaluation
        self.count()
        if run.stop_reason() != "interrupted":
            self.final_eval = self.evaluate()

    def count(self) -> None:
        """The run's plies (global_step), games (episodes) and updates (a process's lockstep ply applies one batch
        of TD updates): this process's, and every worker's."""
        self.counts[0] = count_row(self.play)
        totals = self.counts.sum(axis=0)
        counters = self.run.counters
        counters["global_step"] = self.before["global_step"] + int(totals[PLIES])
        counters["episodes"] = self.before["episodes"] + int(totals[GAMES])
        counters["updates"] = self.before["updates"] + int(totals[PLIES]) // self.train_config.games_in_lockstep
        counters["self_play_results"] = (self.results_before + totals[FIRST_WON:FIRST_LOST + 1]).tolist()

    def after_iteration(self) -> None:
        iteration = self.run.counters["iteration"]
        if self.cfg.eval_interval and iteration % self.cfg.eval_interval == 0:
            self.last_eval = self.evaluate()
            self.stop_at_targets(self.run, self.last_eval)

    def record(self, games: int, seconds: float) -> None:
        counters = self.run.counters
        won, drawn, lost = counters["self_play_results"]
        row = {"epsilon": self.epsilon, "learning_rate": self.learning_rate,
               "episodes_per_s": games / max(seconds, 1e-9), "iteration": counters["iteration"],
               "world_size": 1, "train_win_rate": won / max(1, won + drawn + lost), **self.last_eval}
        self.last_eval = {}
        self.run.write_metrics(row, {"games": counters["episodes"], "lr": round(row["learning_rate"], 3)})

    def evaluate(self) -> dict[str, float]:
        """The greedy policy (the best afterstate) from both seats against the game's fixed players, here."""
        cfg, out = self.cfg, {}
        opponents = self.run.env.extra["evaluation_opponents"]
        for opponent in opponents:
            rates = match(self.value, cfg.env_id, self.run.env_kwargs, opponent, cfg.eval_episodes, cfg.seed)
            out.update({f"eval_win_{opponent}_{seat}": rates[seat]["win"] for seat in ("first", "second")})
            out.update({f"eval_{what}_{opponent}": rates["both"][what] for what in ("win", "draw", "loss")})
        self.run.log.info("eval: win/draw/loss %% vs %s", ", ".join(
            f"{o} {100 * out[f'eval_win_{o}']:.0f}/{100 * out[f'eval_draw_{o}']:.0f}/{100 * out[f'eval_loss_{o}']:.0f}"
            for o in opponents))
        return out

    def state_dict(self) -> dict:
        return {"model": {"tuples": torch.from_numpy(self.value.tuples.copy()),
                          "weights": torch.from_numpy(self.value.weights.copy())},
                "policy": self.value.spec, "learner": "ntuple"}

    def summary(self) -> dict:
        won, drawn, lost = self.run.counters["self_play_results"]
        return {"final_eval": self.final_eval, "iterations": self.run.counters["iteration"], "learner": "ntuple",
                "weights": int(self.value.weights.size),
                "self_play_results": {"first_won": won, "drawn": drawn, "first_lost": lost}}


def ntuple_train_config(cfg) -> TrainConfig:
    """The self-play settings of parallel_train_dqn.py's ``ntuple_*`` config fields."""
    return TrainConfig(games_in_lockstep=cfg.ntuple_games_in_lockstep, learning_rate=cfg.ntuple_learning_rate,
                       final_learning_rate=cfg.ntuple_final_learning_rate, td_lambda=cfg.ntuple_td_lambda,
                       epsilon=cfg.ntuple_epsilon, final_epsilon=cfg.ntuple_epsilon,
                       random_opening=tuple(cfg.ntuple_random_opening))
