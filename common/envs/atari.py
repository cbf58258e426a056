"""Atari games (``ALE/<Game>-v5`` ids, from ale-py) with the standard preprocessing.

What an agent sees is what the DQN papers and CleanRL's Atari scripts feed their networks:
the last 4 frames, grey, 84 x 84, as uint8 ``(4, 84, 84)``; up to 30 no-op actions at the start
of an episode, each action repeated for 4 frames (the observation is the maximum of the last two,
which removes flicker), sticky actions with probability 0.25 (as the v5 ids), an episode ends with
the game or after 108,000 frames. Rewards are the game's own (``reward_clipping=True`` clips them to
their sign, as the DQN papers did for training), so the returns logged are the game's score.

Many copies step in ale-py's own vector env (C++, same-step autoreset, ``num_threads`` threads;
one by default, since this project's parallelism is its worker processes). A single copy (the
lifecycle's probe of the spaces, evaluation, videos) is Gymnasium's ``AtariPreprocessing`` and
``FrameStackObservation`` around the same game, the same preprocessing (it needs opencv).
ale-py and opencv are optional extras (``requirements-extras.txt``).
"""

from __future__ import annotations

import re

import gymnasium as gym
from gymnasium.vector import AutoresetMode

FRAME_STACK, SCREEN, FRAME_SKIP, NOOP_MAX = 4, 84, 4, 30
STICKY = 0.25
MAX_FRAMES = 108_000


def is_atari(env_id: str) -> bool:
    return env_id.startswith("ALE/")


def register() -> bool:
    """Register the ALE ids with Gymnasium if ale-py is installed; whether it is."""
    try:
        import ale_py
    except ImportError:
        return False
    gym.register_envs(ale_py)
    return True


def game(env_id: str) -> str:
    """``ALE/MsPacman-v5`` -> ``ms_pacman`` (the ROM name ale-py's vector env takes)."""
    name = env_id.split("/", 1)[1].rsplit("-v", 1)[0]
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def make_single(env_id: str, reward_clipping: bool = False, repeat_action_probability: float = STICKY,
                max_num_frames_per_episode: int = MAX_FRAMES, render_mode: str | None = None) -> gym.Env:
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation, TransformReward

    register()
    env = gym.make(env_id, frameskip=1, repeat_action_probability=repeat_action_probability,
                   max_num_frames_per_episode=max_num_frames_per_episode, render_mode=render_mode)
    env = AtariPreprocessing(env, noop_max=NOOP_MAX, frame_skip=FRAME_SKIP, screen_size=SCREEN,
                             terminal_on_life_loss=False, grayscale_obs=True, scale_obs=False)
    if reward_clipping:
        env = TransformReward(env, lambda reward: float((reward > 0) - (reward < 0)))
    return FrameStackObservation(env, FRAME_STACK)


def make_vector(env_id: str, num_envs: int, reward_clipping: bool = False,
                repeat_action_probability: float = STICKY, max_num_frames_per_episode: int = MAX_FRAMES,
                num_threads: int = 1) -> gym.vector.VectorEnv:
    from ale_py.vector_env import AtariVectorEnv

    return AtariVectorEnv(game(env_id), num_envs, num_threads=num_threads, autoreset_mode=AutoresetMode.SAME_STEP,
                          stack_num=FRAME_STACK, img_height=SCREEN, img_width=SCREEN, frameskip=FRAME_SKIP,
                          noop_max=NOOP_MAX, use_fire_reset=False, reward_clipping=reward_clipping,
                          repeat_action_probability=repeat_action_probability,
                          max_num_frames_per_episode=max_num_frames_per_episode)
