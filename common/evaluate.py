"""Evaluate, watch, record or export what any run trained.

    python -m common.evaluate RUN_DIR_OR_CHECKPOINT [--episodes 10] [--json]
    python -m common.evaluate runs/ultra_parallel_train_dqn/... --video videos/      # MP4s (rgb_array)
    python -m common.evaluate runs/train_parallel_timed/... --render                # a window, where possible
    python -m common.evaluate runs/train_ppo_multiprocess/... --member 3            # one agent of a population
    python -m common.evaluate CHECKPOINT --export policy.onnx                       # ONNX, checked against torch
    python -m common.evaluate runs/parallel_train_dqn/... --search-depth 2          # ConnectFour: 2-ply lookahead
    python -m common.evaluate runs/parallel_train_dqn/... --grade                   # graded by a perfect player

The env and the policy are rebuilt from what the run saved (the checkpoint's ``env`` and
``policy`` entries), so no other flag is needed. Episodes are played greedily (or through a
lookahead, below) on seeds the training never used. Besides the return, a built-in env reports
its own score (ConnectFour win rates against the random and the heuristic player, GridCoverage
coverage, Market profit). A two-player
built-in whose module (or registered class: a PettingZoo game, common/envs/pettingzoo_games.py) names
``EVALUATION_OPPONENTS`` (ConnectFour: random, heuristic and the search players search1-4, which no
training mix may contain; tic-tac-toe: random, heuristic and minimax) is also played ``--episodes`` games against each,
from each seat, and reports win, draw and loss rates per seat and for both together.
``--random-opening N`` opens every episode and game of a two-player built-in with N uniformly random
moves (ConnectFour: at most 6), so that a deterministic policy and a search player, which would
repeat a handful of games, meet in many positions; the report says so (``random_opening``).
``--search-depth N`` (default 0: greedy) plays every episode and game of the report through a
depth-N lookahead over the run's Q-network instead, for a two-player built-in whose env module
offers one (its ``LookaheadPlayer``; ConnectFour: a negamax with the rules' wins and draws and the
network's values at the leaves); the report says the depth it played with (``search_depth``).
``--grade [N]`` (a game with a perfect player, common/grading.py: ConnectFour-v0, by BitBully from
requirements-extras.txt) also grades the player of the report by it, on N random positions per ply
(default 30; plies 0-30 for ConnectFour-v0) and in ``--episodes`` games against it from each seat
(``graded``); it is a flag, not automatic, because solving the positions takes a minute or two. The
report names the checkpoint it played, the script and step that wrote it and, for an agent of a
population, its member number. Exit status: 0, or 2 with one line for a path that holds no usable
checkpoint, an env that cannot be recorded (no rgb_array mode) or shown, a ``--search-depth`` above 0
for an env without lookahead or a policy that is not a Q-network, a ``--random-opening`` the env does not
offer, a ``--grade`` for a game without a perfect player or without its solver installed, or flags that
exclude each other.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np

EXIT_USAGE = 2
EVAL_SEED = 1_000_000  # far from every training seed (environment i of a run is seeded seed + i)
MAX_ENVS = 8  # episodes are played this many at a time
MATCH_ENVS = 100  # games against a fixed opponent are played this many at a time (search players batch them)
SEATS = (("first", True), ("second", False))


class EvaluationError(ValueError):
    """The path holds no checkpoint this command can use; the message is one line."""


def find_checkpoint(path: str | Path, member: int | None = None) -> Path:
    """The checkpoint to evaluate: the file itself, or what a run directory holds as its result.

    In a run directory: the first of the files its mode names as its result (``result_files``:
    ``ultra_final_model.pth``, a population's ``best.pt``); with ``member``, the latest checkpoint
    of that population member (``member_checkpoints``); else the latest file in checkpoints/.
    """
    from common.checkpoint import find_checkpoint as checkpoint_in
    from common.script_modes import declared_modes

    path = Path(path)
    if member is not None and path.is_file():
        raise EvaluationError(f"--member {member} picks an agent of a population run directory; "
                              f"{path} is a checkpoint file")
    modes = declared_modes() if path.is_dir() else ()
    if member is None:
        for name in dict.fromkeys(name for mode in modes for name in mode.result_files):
            if (path / name).is_file():
                return path / name
        pattern = r".*\.pth?"
    else:
        members = dict.fromkeys(m.member_checkpoints.replace("{member}", str(member)) for m in modes
                                if m.member_checkpoints)
        pattern = "|".join(f"(?:{p})" for p in members) or "(?!)"  # no mode with members: nothing matches
    try:
        found = checkpoint_in(path, pattern)
    except FileNotFoundError:
        raise EvaluationError(f"{path}: no such file or directory") from None
    if found is None and member is not None:
        raise EvaluationError(f"{path}: no checkpoint of population member {member}")
    if found is None:
        raise EvaluationError(f"{path}: not a run directory with a checkpoint (looked in {path / 'checkpoints'})")
    return found


def load(path: Path, device: str = "cpu") -> tuple[Any, dict, dict]:
    """The policy, the env description (``{"id", "kwargs"}``) and what else a checkpoint says about
    itself (``script``, ``global_step``, and ``member`` for an agent of a population)."""
    from common.checkpoint import CheckpointError, load_checkpoint
    from common.policy import policy_from_state

    try:
        state = load_checkpoint(path, map_location=device, required=("model", "policy"))
        policy = policy_from_state(state, device)
    except CheckpointError as err:
        raise EvaluationError(str(err)) from None
    except (KeyError, TypeError, ValueError, RuntimeError) as err:  # a spec or weights this code cannot build
        reason = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
        raise EvaluationError(f"{path}: cannot rebuild the policy ({reason})") from None
    env = state.get("env") or {"id": state.get("config", {}).get("env_id"), "kwargs": {}}
    if not env.get("id"):
        raise EvaluationError(f"{path}: the checkpoint does not say which env it was trained on")
    about = {"script": state.get("script"), "global_step": state.get("counters", {}).get("global_step")}
    if isinstance(state.get("worker"), int):
        about["member"] = state["worker"]
    return policy, env, {k: v for k, v in about.items() if v is not None}


def play(policy, env_id: str, env_kwargs: dict, episodes: int, seed: int, render: str | None = None,
         video_dir: str | None = None, max_envs: int = MAX_ENVS) -> tuple[list[dict], np.ndarray]:
    """``episodes`` episodes of ``policy.act`` (the greedy policy or a lookahead player), ``max_envs`` at a
    time; returns them and a batch of the observations seen (for export checks)."""
    from common.envs import make_vec_env, play_episodes

    seen: list[np.ndarray] = []

    def act(obs, masks):
        if len(seen) < 64:
            seen.append(np.array(obs))
        return policy.act(obs, masks)

    if video_dir and not render:
        os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # frames are drawn off screen: no display needed
    if render or video_dir:  # one env, wrapped, so that every frame is drawn or recorded
        mode = render or "rgb_array"
        vec = make_vec_env(env_id, 1, seed, vectorize=False, wrap=lambda env: _wrap(env, env_id, mode, video_dir),
                           **{**env_kwargs, "render_mode": mode})
    else:
        vec = make_vec_env(env_id, min(episodes, max_envs), seed, **env_kwargs)
    try:
        played, _ = play_episodes(vec, act, episodes)
    finally:
        vec.close()
    if video_dir:  # the env reset once more after the last episode: drop that stub of a recording
        for extra in videos(video_dir, env_id)[episodes:]:
            extra.unlink()
    return played, np.concatenate(seen)[:256]


def _video_prefix(env_id: str) -> str:
    return re.sub(r"[^\w.-]", "_", env_id)


def videos(video_dir: str | Path, env_id: str) -> list[Path]:
    """The recordings of ``env_id`` in ``video_dir``, in episode order."""
    found = Path(video_dir).glob(f"{_video_prefix(env_id)}-episode-*.mp4")
    return sorted(found, key=lambda p: int(re.findall(r"\d+", p.stem)[-1]))


def _wrap(env, env_id: str, mode: str, video_dir: str | None):
    """``env`` checked to render in ``mode``, and recording every episode into ``video_dir`` when given."""
    from gymnasium.wrappers import RecordVideo

    modes = env.metadata.get("render_modes", [])
    if mode not in modes:
        env.close()
        what = "recorded" if video_dir else "shown in a window"
        raise EvaluationError(f"{env_id} cannot be {what}: it renders {', '.join(modes) or 'nothing'}, not {mode}")
    if not video_dir:
        return env
    return RecordVideo(env, video_dir, episode_trigger=lambda _: True, name_prefix=_video_prefix(env_id),
                       disable_logger=True)


def report(episodes: list[dict], env_id: str, env_kwargs: dict, policy, seed: int) -> dict:
    from common.envs.registry import builtin_scores

    returns = np.array([e["return"] for e in episodes], dtype=np.float64)
    out = {"env_id": env_id, "episodes": len(episodes), "mean_return": float(returns.mean()),
           "std_return": float(returns.std()), "mean_length": float(np.mean([e["length"] for e in episodes]))}
    for name, (kwargs, score) in builtin_scores(env_id).items():
        scored = episodes if not kwargs else play(policy, env_id, {**env_kwargs, **kwargs}, len(episodes), seed)[0]
        out[name] = score(scored)
    opponents = evaluation_opponents(env_id)
    if opponents:
        out["opponents"] = {name: match(policy, env_id, env_kwargs, name, len(episodes), seed) for name in opponents}
    return out


def env_module(env_id: str):
    """The module that defines ``env_id``'s env (where a built-in keeps its players), or None."""
    import importlib

    import gymnasium as gym

    import common.envs  # noqa: F401  (registers the built-ins)

    entry = gym.spec(env_id).entry_point
    return importlib.import_module(entry.split(":")[0]) if isinstance(entry, str) else None


def declared(env_id: str, name: str):
    """What ``env_id`` declares as ``name``: the attribute of the class it is registered with (one class per
    game where one adapter plays several, common/envs/pettingzoo_games.py), else of its module, else None."""
    import gymnasium as gym

    try:
        module = env_module(env_id)
        entry = gym.spec(env_id).entry_point
    except gym.error.Error:  # not a registered id (an env the user's own factory makes): nothing declared here
        return None
    registered = getattr(module, entry.split(":")[1], None) if isinstance(entry, str) else entry
    return getattr(registered, name, getattr(module, name, None))


def evaluation_opponents(env_id: str) -> tuple[str, ...]:
    """The fixed players a two-player built-in is scored against: its ``EVALUATION_OPPONENTS``."""
    return tuple(declared(env_id, "EVALUATION_OPPONENTS") or ())


def lookahead_player(policy, env_id: str, depth: int, seed: int):
    """What plays the report: the greedy ``policy`` at depth 0, else the env module's
    ``LookaheadPlayer`` searching ``depth`` plies over the policy's Q-values (ties drawn with ``seed``)."""
    if depth == 0:
        return policy
    player = declared(env_id, "LookaheadPlayer")
    if player is None:
        raise EvaluationError(f"--search-depth {depth}: {env_id} offers no lookahead (its env module has no "
                              "LookaheadPlayer); only 0 (greedy) is allowed")
    if policy.spec["class"] != "QNetwork":
        raise EvaluationError(f"--search-depth {depth}: the lookahead searches over Q-values, and this checkpoint "
                              f"holds a {policy.spec['class']}; only 0 (greedy) is allowed")
    import torch

    @torch.no_grad()
    def q_values(obs: np.ndarray) -> np.ndarray:
        return policy(torch.as_tensor(obs, device=policy.obs_mean.device)).cpu().numpy()

    return player(q_values, depth, seed)


def grading_perfect_play(env_id: str, positions: int):
    """``--grade``'s perfect play of ``env_id`` (common/grading.py), or None without ``--grade``."""
    if not positions:
        return None
    from common.grading import perfect_play

    try:
        return perfect_play(env_id)
    except ValueError as err:  # no perfect player for this game, or its solver is not installed
        raise EvaluationError(f"--grade: {err}") from None


def opening_kwargs(env_id: str, plies: int) -> dict:
    """The env kwargs of ``--random-opening``: every game opens with ``plies`` uniformly random moves, for a
    two-player built-in whose env module says how many it allows (``MAX_RANDOM_OPENING``)."""
    if plies == 0:
        return {}
    most = declared(env_id, "MAX_RANDOM_OPENING")
    if most is None:
        raise EvaluationError(f"--random-opening {plies}: {env_id} has no random openings (its env module has no "
                              "MAX_RANDOM_OPENING); only 0 is allowed")
    if plies > most:
        raise EvaluationError(f"--random-opening {plies}: {env_id} opens games with at most {most} random plies")
    return {"random_opening": plies}


def match(policy, env_id: str, env_kwargs: dict, opponent: str, games: int, seed: int) -> dict:
    """``games`` games of ``policy`` (greedy, or a lookahead player) against ``opponent`` from each seat:
    ``{"first"|"second"|"both": {"win", "draw", "loss"}}`` rates."""
    results = {}
    for seat, learner_first in SEATS:
        kwargs = {**env_kwargs, "opponent": opponent, "learner_first": learner_first}
        played = play(policy, env_id, kwargs, games, seed, max_envs=MATCH_ENVS)[0]
        results[seat] = np.array([e["result"] for e in played], dtype=np.float64)
    results["both"] = np.concatenate([results["first"], results["second"]])
    return {seat: {"win": float(np.mean(r == 1)), "draw": float(np.mean(r == 0)), "loss": float(np.mean(r == -1))}
            for seat, r in results.items()}


def export_onnx(policy, observations: np.ndarray, path: str | Path, tolerance: float = 1e-5) -> dict:
    """Write the policy as ONNX (raw observation in, logits / means / Q-values out) and check it.

    The exported model runs under onnxruntime on real observations and must agree with
    PyTorch to ``tolerance``; otherwise the file is removed and RuntimeError raised.
    """
    import onnxruntime
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    example = torch.as_tensor(observations[:2])
    batch = torch.export.Dim("batch", min=1)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # the exporter's progress chatter
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        torch.onnx.export(policy.cpu(), (example,), str(path), input_names=["obs"], output_names=["out"],
                          dynamic_shapes={"obs": {0: batch}}, dynamo=True, verbose=False)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    obs = np.ascontiguousarray(observations, dtype=np.float32)
    got = session.run(None, {"obs": obs})[0]
    with torch.no_grad():
        want = policy(torch.as_tensor(obs)).numpy()
    error = float(np.abs(got - want).max())
    if not error <= tolerance:
        path.unlink(missing_ok=True)
        raise RuntimeError(f"ONNX and PyTorch outputs differ by {error:.2e} (> {tolerance:g})")
    return {"path": str(path), "max_abs_error": error, "checked_observations": len(obs)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m common.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a run directory of any script, or a checkpoint file")
    parser.add_argument("--episodes", type=int, default=10, help="greedy episodes to play (default 10)")
    parser.add_argument("--member", type=int, help="population runs: evaluate this worker's agent, not the best")
    parser.add_argument("--seed", type=int, default=EVAL_SEED, help="seed of the first episode's env")
    parser.add_argument("--render", action="store_true", help="show the episodes in a window (render_mode human)")
    parser.add_argument("--video", metavar="DIR", help="record every episode as an MP4 into DIR")
    parser.add_argument("--export", metavar="FILE.onnx", help="also write the policy as ONNX (checked)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--device", default="cpu", help="where the policy runs (default cpu)")
    parser.add_argument("--search-depth", type=int, default=0,
                        help="two-player built-ins: play through a lookahead of this many plies over the "
                             "Q-network (default 0 = greedy)")
    parser.add_argument("--random-opening", type=int, default=0, metavar="PLIES",
                        help="two-player built-ins: open every game with this many uniformly random moves, so that "
                             "deterministic players meet in many positions (default 0)")
    parser.add_argument("--grade", type=int, nargs="?", const=30, default=0, metavar="POSITIONS",
                        help="games with a perfect player (ConnectFour-v0): grade the policy by it on POSITIONS "
                             "random positions per ply (default 30) and in --episodes games against it from each "
                             "seat")
    parser.error = lambda message: _usage(message)
    args = parser.parse_args(argv)
    if args.episodes < 1:
        _usage(f"--episodes {args.episodes}: must be >= 1")
    if args.search_depth < 0:
        _usage(f"--search-depth {args.search_depth}: must be >= 0 (0 = greedy)")
    if args.random_opening < 0:
        _usage(f"--random-opening {args.random_opening}: must be >= 0")
    if args.grade < 0:
        _usage(f"--grade {args.grade}: must be >= 1 positions per ply (0 = no grading)")
    if args.render and args.video:
        _usage("--render and --video exclude each other (a video is drawn off screen)")
    return args


def _usage(message: str):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from common.envs.registry import EVALUATION_KWARGS

    try:
        path = find_checkpoint(args.path, args.member)
        policy, env, about = load(path, args.device)
        env_kwargs = {**env["kwargs"], **EVALUATION_KWARGS.get(env["id"], {}),
                      **opening_kwargs(env["id"], args.random_opening)}
        if args.export and policy.spec["class"] == "NTupleValue":
            raise EvaluationError(f"--export: {path} holds an n-tuple value function (look-up tables, "
                                  "parallel_train_dqn.py --learner ntuple), not a network to export")
        player = lookahead_player(policy, env["id"], args.search_depth, args.seed)
        perfect = grading_perfect_play(env["id"], args.grade)  # before anything is played: a refusal comes first
        episodes, observations = play(player, env["id"], env_kwargs, args.episodes, args.seed,
                                      "human" if args.render else None, args.video)
    except EvaluationError as err:
        _usage(str(err))
    result = {"checkpoint": str(path), **about, **report(episodes, env["id"], env_kwargs, player, args.seed),
              "search_depth": args.search_depth, "random_opening": args.random_opening}
    if perfect is not None:
        from common.grading import grade

        result["graded"] = grade(player.act, env["id"], env_kwargs, args.grade, args.episodes, args.seed, perfect)
    if args.video:
        result["videos"] = [str(p) for p in videos(args.video, env["id"])]
    if args.export:
        result["export"] = export_onnx(policy, observations, args.export)
    print(json.dumps(result, indent=2) if args.json else _text(result))
    return 0


def _text(result: dict) -> str:
    member = f" (population member {result['member']})" if "member" in result else ""
    played = (f"episodes through a depth-{result['search_depth']} lookahead over the Q-network"
              if result.get("search_depth") else "greedy episodes")
    if result.get("random_opening"):
        played += f", each opened by {result['random_opening']} random plies"
    lines = [f"{result['checkpoint']}{member}: {result['env_id']}, {result['episodes']} {played}",
             f"  return {result['mean_return']:.2f} ± {result['std_return']:.2f}, "
             f"mean length {result['mean_length']:.1f}"]
    skip = {"checkpoint", "member", "env_id", "episodes", "mean_return", "std_return", "mean_length", "videos",
            "export", "opponents", "search_depth", "random_opening", "graded"}
    for key, value in result.items():
        if key not in skip:
            shown = f"{value:.3f}" if isinstance(value, float) and math.isfinite(value) else value
            lines.append(f"  {re.sub('_', ' ', key)}: {shown}")
    if "opponents" in result:
        lines.append(f"  win / draw / loss, {result['episodes']} games from each seat:")
        for name, seats in result["opponents"].items():
            lines.append(f"  vs {name:<10}" + "  ".join(
                f"{seat} {r['win']:4.0%} / {r['draw']:4.0%} / {r['loss']:4.0%}" for seat, r in seats.items()))
    if "graded" in result:
        from common.grading import text

        lines += text(result["graded"])
    if "videos" in result:
        lines.append(f"  videos: {len(result['videos'])} file(s) in {Path(result['videos'][0]).parent}"
                     if result["videos"] else "  videos: none written")
    if "export" in result:
        lines.append(f"  ONNX: {result['export']['path']} (max |onnx - torch| = "
                     f"{result['export']['max_abs_error']:.1e} over {result['export']['checked_observations']} "
                     "observations)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
