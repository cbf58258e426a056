"""The chosen script's command line: the plan's flags, the launcher's budgets in the script's own
terms, then every flag the launcher does not know, untouched (the user's flags win)."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from datetime import datetime
from pathlib import Path

from common import system
from common.launcher import ROOT
from common.launcher.modes import MODES, LaunchMode

DEFAULT_DURATION_H = 0.16  # the no-argument run: about 10 minutes


def has_flag(args: list[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def flag_value(args: list[str], flag: str) -> str | None:
    """The value of the last ``flag`` in ``args`` (the one argparse keeps), or None."""
    for i in range(len(args) - 1, -1, -1):
        if args[i] == flag and i + 1 < len(args):
            return args[i + 1]
        if args[i].startswith(flag + "="):
            return args[i].split("=", 1)[1]
    return None


def merge_flags(base: list[str], overrides: list[str]) -> list[str]:
    """``--flag value`` pairs of ``base`` with those of ``overrides`` replacing or added."""
    merged = dict(zip(base[::2], base[1::2]))
    merged.update(zip(overrides[::2], overrides[1::2]))
    return [item for pair in merged.items() for item in pair]


def build_command(mode: LaunchMode, rec_args: list[str], opts: argparse.Namespace, passthrough: list[str],
                  run_dir: Path | None, ranks: int = 1) -> list[str]:
    """The script's command line: the plan's flags, translated budgets, then the user's flags
    (``ranks``: how many ranks run it, each with the workers it names)."""
    command = [sys.executable, str(ROOT / mode.script)]
    user_flags = {a.split("=", 1)[0] for a in passthrough if a.startswith("--")}
    for flag, value in zip(rec_args[::2], rec_args[1::2]):  # the user's own flags win over the plan
        if flag not in user_flags:
            command += [flag, value]
    if opts.episodes is not None:
        command += translate_episodes(mode, opts.episodes, command[2:] + passthrough, ranks)
    if opts.duration is not None:
        command += [mode.duration_flag, str(opts.duration)]
    elif opts.episodes is None and not has_flag(passthrough, mode.duration_flag):
        command += [mode.duration_flag, str(DEFAULT_DURATION_H)]
    if run_dir is not None:
        command += ["--output-dir", str(run_dir)]
    return command + passthrough


def translate_episodes(mode: LaunchMode, episodes: int, args: list[str], ranks: int = 1) -> list[str]:
    """``--episodes N`` in the script's own terms (``args``: the flags it gets, the user's last; ``ranks``:
    how many ranks run them, each with ``--num-workers`` workers)."""
    if mode.episodes_flag:
        return [mode.episodes_flag, str(episodes)]
    # The population trains fixed-length Market episodes per worker: convert to steps per worker.
    defaults = mode.defaults
    episode_length = int(flag_value(args, "--episode-length") or defaults.episode_length)
    workers = int(flag_value(args, mode.workers_flag) or defaults.num_workers) * ranks
    return ["--max-steps-per-worker", str(math.ceil(episodes / workers) * episode_length)]


def plan_args(report: dict) -> list[str]:
    """The selected mode's flags: the plan's, a measured ``--tune`` setting replacing the guess."""
    rec_args = report["plans"][report["selected"]]["args"]
    return merge_flags(rec_args, report["tuned"]["args"]) if report["tuned"] else rec_args


def default_run_dir(mode: LaunchMode, passthrough: list[str], run_name: str) -> Path | None:
    """``runs/<script>/<env>__<seed>__<run_name>``, or None where the user named one (or a checkpoint's)."""
    if has_flag(passthrough, "--output-dir") or has_flag(passthrough, "--resume"):
        return None
    seed = flag_value(passthrough, "--seed") or mode.defaults.seed
    env_id = flag_value(passthrough, "--env-id") or mode.default_env
    return Path("runs") / Path(mode.script).stem / f"{env_id.replace('/', '_')}__{seed}__{run_name}"


def plan_command(report: dict, opts: argparse.Namespace, passthrough: list[str]) -> tuple[list[str], Path | None]:
    """The command for the selected mode's plan, and the run directory it names."""
    mode = MODES[report["selected"]]
    run_dir = default_run_dir(mode, passthrough, datetime.now().strftime("%Y%m%d-%H%M%S"))
    # A flag the script does not know is left for the script's own parser to refuse (exit 2),
    # before it starts anything.
    return build_command(mode, plan_args(report), opts, passthrough, run_dir), run_dir


def quote(arg: str) -> str:
    """``arg`` as one shell word."""
    return arg if re.fullmatch(r"[\w@%+=:,./-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


def shell_line(command: list[str]) -> str:
    """The command as one shell line, with the assumed facts it depends on."""
    assume = os.environ.get(system.ASSUME_ENV)
    prefix = [f"{system.ASSUME_ENV}={quote(assume)}"] if assume else []
    return " ".join(prefix + [quote(c) for c in command])
