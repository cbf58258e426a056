"""parallel_train_dqn.py and the DQN pieces it shares: masking in the target, replay layout and n-step
returns, the buffer memory plan, and learning runs (CartPole, ConnectFour self-play); replay augmentation
by the symmetries an env declares (--mirror-augment) and --target-win-rate.

Signals, worker deaths, resume and bad input common to every script are in test_faults.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import run_script, tensorboard_tags
from torch import nn

import parallel_train_dqn
from common import system
from common.checkpoint import load_checkpoint
from common.config import ConfigError
from common.dqn import double_dqn_loss, epsilon_greedy
from common.replay import LocalReplay, ReplayMemoryError, check_replay_memory, fit_buffer_size, nstep_returns
from common.runlog import read_metrics

SCRIPT = "parallel_train_dqn.py"
CARTPOLE = ["--env-id", "CartPole-v1", "--hidden-sizes", "64", "64", "--episodes-per-batch", "8",
            "--replay-ratio", "0.25", "--batch-size", "64", "--learning-rate", "1e-3", "--no-anneal-lr",
            "--target-update-interval", "100", "--epsilon-decay-steps", "4000", "--epsilon-end", "0.04",
            "--eval-interval", "0", "--eval-episodes", "20", "--num-workers", "1", "--no-tensorboard"]


class TableQ(nn.Module):
    """Q-values that ignore the observation: a fixed row per call, for exact target checks."""

    def __init__(self, values):
        super().__init__()
        self.values = nn.Parameter(torch.tensor(values, dtype=torch.float32))

    def forward(self, obs):
        return self.values.expand(len(obs), -1)


def test_masked_actions_never_win_the_target_max():
    q_net = TableQ([0.0, 10.0, 1.0])      # action 1 looks best but is illegal in the next state
    target_net = TableQ([5.0, 100.0, 2.0])
    obs = torch.zeros(2, 3)
    actions = torch.tensor([0, 0])
    rewards = torch.tensor([1.0, 1.0])
    dones = torch.tensor([0.0, 1.0])
    mask = torch.tensor([[True, False, True], [True, False, True]])
    _, td, _ = double_dqn_loss(q_net, target_net, obs, actions, rewards, obs, dones, 0.5, next_action_mask=mask)
    # argmax over legal actions of q_net is action 2 -> target_net value 2.0; terminal row: reward only
    assert torch.allclose(td, torch.tensor([abs(0.0 - (1.0 + 0.5 * 2.0)), abs(0.0 - 1.0)]))
    _, td_unmasked, _ = double_dqn_loss(q_net, target_net, obs, actions, rewards, obs, dones, 0.5)
    assert td_unmasked[0] == pytest.approx(1.0 + 0.5 * 100.0)


def test_epsilon_greedy_explores_legal_actions_only():
    rng = np.random.default_rng(0)
    q = np.tile([0.0, 5.0, 1.0], (2000, 1))
    mask = np.tile([True, False, True], (2000, 1))
    greedy = epsilon_greedy(q, 0.0, rng, mask)
    assert (greedy == 2).all()  # the best legal action, never the masked best
    explored = epsilon_greedy(q, 1.0, rng, mask)
    assert set(explored.tolist()) == {0, 2} and abs((explored == 0).mean() - 0.5) < 0.05
    assert set(epsilon_greedy(q, 1.0, rng).tolist()) == {0, 1, 2}


def test_replay_episode_layout_and_masks():
    buffer = LocalReplay(5, (2,), np.float32, num_actions=3, seed=0)
    obs = np.arange(8, dtype=np.float32).reshape(4, 2)  # T+1 = 4 observations
    masks = np.array([[1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=bool)
    buffer.add_episode(obs, np.array([0, 2, 1]), np.array([0.0, 0.0, 1.0]), True, masks)
    assert len(buffer) == 3
    assert (buffer.next_obs[:3] == obs[1:]).all() and buffer.dones[:3].tolist() == [False, False, True]
    assert (buffer.next_masks[:3] == masks[1:]).all()
    buffer.add_episode(obs, np.array([0, 1, 2]), np.zeros(3), False, masks)  # wraps around
    assert len(buffer) == 5 and buffer.pos == 1
    assert buffer.dones[:5].tolist() == [False, False, True, False, False]  # truncated: no terminal flag
    sample = buffer.sample(16)
    assert sample.obs.shape == (16, 2) and sample.next_masks.shape == (16, 3) and sample.weights is None


def test_replay_n_step_returns_from_whole_episodes():
    buffer = LocalReplay(8, (1,), np.float32, num_actions=2)
    obs = np.arange(5, dtype=np.float32)[:, None]
    masks = np.array([[1, 1], [1, 0], [0, 1], [1, 1], [1, 1]], dtype=bool)
    buffer.add_episode(obs, np.zeros(4, dtype=np.int64), np.array([1.0, 2.0, 3.0, 4.0]), True, masks,
                       gamma=0.5, n_step=2)
    assert buffer.rewards[:4].tolist() == [2.0, 3.5, 5.0, 4.0]       # r_t + 0.5 r_t+1, cut at the end
    assert buffer.next_obs[:4, 0].tolist() == [2.0, 3.0, 4.0, 4.0]   # two steps ahead, final obs at the end
    assert buffer.discounts[:4].tolist() == [0.25, 0.25, 0.25, 0.5]
    assert buffer.dones[:4].tolist() == [False, False, True, True]
    assert (buffer.next_masks[:4] == masks[[2, 3, 4, 4]]).all()
    returns, counts = nstep_returns(np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]]), 0.5, 2)  # [T, envs]
    assert returns[:, 1].tolist() == [20.0, 35.0, 30.0] and counts.tolist() == [2, 2, 1]


def test_buffer_memory_plan():
    with pytest.raises(ReplayMemoryError, match="RAM"):
        check_replay_memory(10**12, (84,), np.float32, 7)
    with system.assumed_machine({"ram_available_gib": 1}):
        assert fit_buffer_size(None, 100_000, 1000) == (100_000, None)  # 100 MB of 800 MB usable
        size, note = fit_buffer_size(None, 10**6, 2000)  # 2 GB does not fit: the default shrinks to what does
        assert size * 2000 <= 0.8 * 2**30 and size >= 2 * 10**6 // 8 and "fits this machine's RAM" in note
        with pytest.raises(ConfigError, match="--buffer-size 1000000: .*lower it"):
            fit_buffer_size(10**6, 100_000, 2000)  # the user's own size is refused, not changed


def test_buffer_the_user_sized_beyond_ram_exits_2(tmp_path, capsys):
    assert parallel_train_dqn.main(["--learner", "q_network", "--buffer-size", "1000000000000",
                                    "--output-dir", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--buffer-size" in lines[0] and "RAM" in lines[0], lines
    assert not (tmp_path / "run").exists()


@pytest.mark.timeout(120)
def test_cartpole_learns(tmp_path):
    run = tmp_path / "run"
    result = run_script(SCRIPT, *CARTPOLE, "--seed", "1", "--total-timesteps", "12000", "--output-dir", run,
                        timeout=110)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] >= 12000 and summary["stop_reason"] == "total_timesteps 12000 reached"
    assert summary["final_mean_return"] >= 60, summary  # a random policy averages about 22
    assert summary["final_eval"]["eval_return"] > 0
    rows = read_metrics(run / "metrics.csv")
    assert rows and list(rows[0])[:6] == ["wall_time", "global_step", "episodes", "episodic_return",
                                          "episodic_length", "sps"]
    assert (run / "plots" / "training_curve.png").exists() and (run / "logs" / "worker_0.log").exists()
    state = load_checkpoint(run / "checkpoints" / "latest.pt", required=("model", "policy", "target", "optimizer"))
    assert state["policy"]["class"] == "QNetwork" and state["policy"]["hidden_sizes"] == [64, 64]


@pytest.mark.timeout(150)
def test_self_play_beats_random(tmp_path):
    run = tmp_path / "run"
    result = run_script(SCRIPT, "--learner", "q_network", "--seed", "2", "--num-workers", "1",
                        "--hidden-sizes", "64", "64",
                        "--total-episodes", "6000", "--episodes-per-batch", "32", "--eval-episodes", "100",
                        "--epsilon-decay-steps", "10000", "--learning-starts", "500", "--replay-ratio", "0.1",
                        "--eval-interval", "0",
                        "--learning-rate", "1e-3", "--target-update-interval", "100", "--opponent-latest", "0.3",
                        "--opponent-snapshot", "0.2", "--opponent-random", "0.5", "--snapshot-interval", "10",
                        "--tensorboard", "--output-dir", run, timeout=140)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    tags = tensorboard_tags(run / "tb")
    assert {"charts/episodic_return", "charts/epsilon", "charts/return_mean100", "losses/td_loss",
            "losses/q_values"} <= tags, sorted(tags)
    final = summary["final_eval"]
    # 100 greedy games from each seat; a random player wins about half its games against random
    assert final["eval_win_random"] > 0.65, final
    assert final["eval_win_random_first"] > 0.55 and final["eval_win_random_second"] > 0.55, final
    checkpoint = load_checkpoint(run / "checkpoints" / "latest.pt")
    snapshots, ids = checkpoint["snapshots"], checkpoint["snapshot_ids"]
    assert 1 <= len(snapshots) <= 10 and len(ids) == len(snapshots)  # the opponent pool is saved with the learner
    assert ids == list(range(ids[0], ids[0] + len(ids)))  # the newest snapshots, oldest first


# ------------------------------------------------------------------------ symmetries an env declares

def test_connect_four_declares_its_mirror_and_it_is_one():
    """The declared mirror is a real symmetry: the mirrored move on the mirrored board wins the same way."""
    from common.envs.connect_four import ConnectFourEnv
    from common.envs.symmetry import declared_symmetries

    (mirror,) = declared_symmetries("ConnectFour-v0")
    assert mirror.action_map == (6, 5, 4, 3, 2, 1, 0) and declared_symmetries("CartPole-v1") == ()
    board = np.zeros((6, 7), dtype=np.int8)
    board[:3, 1] = 1  # three learner discs in column 1: column 1 wins
    board[:6, 0] = [-1, 1, -1, 1, -1, 1]  # column 0 full
    board[0, 4] = -1
    env = ConnectFourEnv()
    outcomes = []
    for position, action in ((board, 1), (board[:, ::-1], int(mirror.actions(np.array(1))))):
        env.reset(seed=0)
        env.set_board(position)
        outcomes.append(env.step(action))
    (obs, reward, terminated, _, info), (m_obs, m_reward, m_terminated, _, m_info) = outcomes
    assert reward == m_reward == 1.0 and terminated and m_terminated
    assert (m_obs == mirror.observations(obs[None])[0]).all()
    assert (m_info["action_mask"] == mirror.masks(info["action_mask"])).all() and not m_info["action_mask"][6]


def test_mirror_augment_stores_every_move_mirrored():
    from common.envs.symmetry import declared_symmetries

    rng = np.random.default_rng(0)
    obs = rng.integers(0, 2, (4, 2, 6, 7)).astype(np.float32)  # T + 1 = 4 boards
    masks = np.ones((4, 7), dtype=bool)
    masks[1:, 0] = False  # column 0 fills after the first move
    masks[3, 1] = False
    episode = {"obs": obs, "actions": np.array([0, 1, 5]), "rewards": np.array([0.0, 0.0, 1.0]), "terminated": True,
               "masks": masks}
    buffer = LocalReplay(16, (2, 6, 7), np.float32, num_actions=7, seed=0)
    parallel_train_dqn.store_episodes(buffer, [episode], declared_symmetries("ConnectFour-v0"), 0.99, 1)
    assert len(buffer) == 6  # each move twice: as played, then mirrored
    assert (buffer.obs[:3] == obs[:3]).all() and buffer.actions[:3].tolist() == [0, 1, 5]
    assert (buffer.obs[3:6] == obs[:3, :, :, ::-1]).all() and (buffer.next_obs[3:6] == obs[1:, :, :, ::-1]).all()
    assert buffer.actions[3:6].tolist() == [6, 5, 1]  # a -> 6 - a
    assert (buffer.next_masks[3:6] == masks[1:, ::-1]).all() and not buffer.next_masks[5, 5]
    assert buffer.rewards[3:6].tolist() == buffer.rewards[:3].tolist() and buffer.dones[:6].tolist() == [0, 0, 1] * 2
    plain = LocalReplay(16, (2, 6, 7), np.float32, num_actions=7, seed=0)
    parallel_train_dqn.store_episodes(plain, [episode], (), 0.99, 1)  # --no-mirror-augment
    assert len(plain) == 3


def test_mirror_augment_on_an_env_without_symmetries(tmp_path, capsys):
    """Set explicitly on an env that declares none, it is refused (one line, exit 2); left unset, nothing is
    augmented and the run goes on; --no-mirror-augment turns a declared symmetry off."""
    from common.run import probe_env

    run = tmp_path / "run"
    assert parallel_train_dqn.main(["--env-id", "CartPole-v1", "--mirror-augment", "--output-dir", str(run)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --mirror-augment True: CartPole-v1 declares no symmetry")
    assert not run.exists()
    assert parallel_train_dqn.main(["--env-id", "CartPole-v1", "--validate-only", "--output-dir", str(run)]) == 0
    assert not run.exists()
    cartpole = probe_env("CartPole-v1", actions=("Discrete",))
    assert parallel_train_dqn.augmenting_symmetries(parallel_train_dqn.Config(env_id="CartPole-v1"), cartpole) == ()
    connect_four = probe_env("ConnectFour-v0", actions=("Discrete",))
    names = {flag: [s.name for s in parallel_train_dqn.augmenting_symmetries(
        parallel_train_dqn.Config(mirror_augment=flag), connect_four)] for flag in (None, True, False)}
    assert names == {None: ["mirror"], True: ["mirror"], False: []}


class RecordingPlayer:
    """A random opponent that keeps every board it was shown and the move it made there (one game at a time)."""

    def __init__(self):
        self.rng, self.calls = np.random.default_rng(5), []

    def act(self, obs, action_mask, env_ids):
        action = self.rng.choice(np.flatnonzero(action_mask[0]))
        self.calls.append((obs[0].copy(), action_mask[0].copy(), int(action)))
        return np.array([action])


def test_other_seat_rebuilds_what_the_opponent_saw_and_played():
    """From the learner's record alone, other_seat rebuilds the opponent's boards (from its side), its legal
    moves and its moves exactly as the opponent was given and made them (less an opening move, which the
    record starts after), with the game's result as its last reward."""
    from common.envs import make_vec_env, play_episodes
    from common.envs.symmetry import declared_other_seat

    rebuild = declared_other_seat("ConnectFour-v0")
    assert rebuild is not None and declared_other_seat("CartPole-v1") is None
    opponent = RecordingPlayer()
    vec = make_vec_env("ConnectFour-v0", 1, 0)
    vec.env.set_opponent(opponent)
    rng = np.random.default_rng(6)
    episodes, _ = play_episodes(vec, lambda obs, masks: np.array([rng.choice(np.flatnonzero(masks[0]))]), 40,
                                record=True, seed=3)
    assert len(episodes) == 40
    games, opened = [], 0
    for board, mask, action in opponent.calls:  # a board with at most one disc starts a new game
        discs = int(board.sum())
        if discs <= 1:
            games.append([])
        if discs == 0:
            opened += 1  # the opponent's first move: not in the learner's record
            continue
        games[-1].append((board, mask, action))
    assert 5 <= opened <= 35 and len(games) >= 40  # both seats were played (the last game may be unfinished)
    for episode, game in zip(episodes, games):
        other = rebuild(episode)
        assert len(other["actions"]) == len(game) >= episode["length"] - 1
        assert (other["obs"][:-1] == np.stack([board for board, _, _ in game])).all()
        assert (other["masks"][:-1] == np.stack([mask for _, mask, _ in game])).all()
        assert other["actions"].tolist() == [action for _, _, action in game]
        assert other["rewards"][:-1].tolist() == [0.0] * (len(game) - 1) and other["terminated"]
        assert other["rewards"][-1] == -episode["rewards"][-1]
        assert (other["obs"][-1] == episode["obs"][-1][::-1]).all()  # the final board, planes swapped
    vec.close()
    cut = dict(episodes[0], terminated=False)
    assert rebuild(cut) is None  # the opponent's next position is not in a cut game's record


def test_learn_both_seats_stores_the_opponents_moves_and_is_refused_without_a_declaration(tmp_path, capsys):
    from common.envs.connect_four import other_seat
    from common.run import probe_env

    board_before = np.zeros((2, 6, 7), dtype=np.float32)
    after_reply = board_before.copy()
    after_reply[0, 0, 3] = 1  # the learner played column 3
    after_reply[1, 0, 2] = 1  # the opponent replied in column 2
    final = after_reply.copy()
    final[0, 1, 3] = 1  # the learner's second move, then a reply that the record says ended the game
    final[1, 0, 4] = 1  # with the learner's loss (other_seat takes the result from the record's rewards)
    episode = {"obs": np.stack([board_before, after_reply, final]), "actions": np.array([3, 3]),
               "rewards": np.array([0.0, -1.0], dtype=np.float32), "terminated": True,
               "masks": np.ones((3, 7), dtype=bool)}
    buffer = LocalReplay(16, (2, 6, 7), np.float32, num_actions=7, seed=0)
    parallel_train_dqn.store_episodes(buffer, [episode], (), 0.99, 1, other_seat)
    assert len(buffer) == 4  # the opponent's two replies, then the learner's two moves
    assert buffer.actions[:4].tolist() == [2, 4, 3, 3] and buffer.rewards[:4].tolist() == [0.0, 1.0, 0.0, -1.0]
    assert buffer.obs[0, 1, 0, 3] == 1 and buffer.obs[0].sum() == 1  # the opponent saw the learner's disc as theirs
    assert buffer.dones[:4].tolist() == [0, 1, 0, 1]

    run = tmp_path / "run"
    assert parallel_train_dqn.main(["--env-id", "CartPole-v1", "--learn-both-seats", "--output-dir", str(run)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --learn-both-seats True: CartPole-v1 declares no other_seat")
    assert not run.exists()
    probe_env("ConnectFour-v0", actions=("Discrete",))
    seats = {flag: parallel_train_dqn.other_seat(parallel_train_dqn.Config(learn_both_seats=flag))
             for flag in (None, True, False)}
    assert seats == {None: other_seat, True: other_seat, False: None}
    assert parallel_train_dqn.other_seat(parallel_train_dqn.Config(env_id="CartPole-v1")) is None


def test_plies_are_both_players_moves_each_from_the_side_to_move():
    """The learner's record as alternating plies: each next board is the move played on the board before,
    seen from the other side; only the game's last move, the winner's, is rewarded; a cut game ends on the
    learner's next board (to bootstrap from). CartPole declares no plies."""
    from common.envs import make_vec_env, play_episodes
    from common.envs.connect_four import boards_of, wins
    from common.envs.symmetry import declared_plies

    plies = declared_plies("ConnectFour-v0")
    assert plies is not None and declared_plies("CartPole-v1") is None
    vec = make_vec_env("ConnectFour-v0", 1, 0)
    rng = np.random.default_rng(6)
    episodes, _ = play_episodes(vec, lambda obs, masks: np.array([rng.choice(np.flatnonzero(masks[0]))]), 60,
                                record=True, seed=3)
    vec.close()
    results = set()
    for episode in episodes:
        game = plies(episode)
        boards, heights = boards_of(game["obs"])
        moves = len(game["actions"])
        assert len(boards) == moves + 1 and len(game["rewards"]) == moves and game["terminated"]
        assert (boards[0::2][:episode["length"]] == boards_of(episode["obs"])[0][:episode["length"]]).all()
        for t, column in enumerate(game["actions"]):
            assert game["masks"][t, column]
            played = boards[t].copy()
            played[heights[t, column], column] = 1
            assert (boards[t + 1] == -played).all()  # the next ply's side to move sees it from its side
            assert game["rewards"][t] == float(bool(wins(played[None], 1)[0]))
        result = float(episode["rewards"][-1])
        results.add(result)
        assert moves % 2 == (1 if result == 1.0 else 0 if result == -1.0 else moves % 2)  # the winner moved last
    assert results == {1.0, -1.0} or results == {1.0, -1.0, 0.0}
    cut = plies(dict(episodes[0], terminated=False, obs=episodes[0]["obs"][:3], actions=episodes[0]["actions"][:2],
                     rewards=np.zeros(2, dtype=np.float32)))
    assert not cut["terminated"] and len(cut["actions"]) == 4 and not cut["rewards"].any()
    assert (cut["obs"][-1] == episodes[0]["obs"][2]).all()  # the learner's board after two replies


def test_negamax_stores_plies_bootstrapped_from_the_reply_and_is_refused_where_it_cannot_apply(tmp_path, capsys):
    """Each stored ply bootstraps with -gamma times the best value of the side to move next, so a move that
    lets the opponent win is worth about -gamma (the loss is the opponent's +1 one ply on); 3-ply returns
    alternate signs. --negamax on an env without plies, or with --no-learn-both-seats, is refused."""
    from common.envs.connect_four import plies
    from common.run import probe_env

    start = np.zeros((2, 6, 7), dtype=np.float32)
    replied = start.copy()
    replied[0, 0, 3] = replied[1, 0, 2] = 1  # the learner played column 3, the opponent column 2
    final = replied.copy()
    final[0, 1, 3] = final[1, 0, 4] = 1  # the learner's second move, then the reply that won
    episode = {"obs": np.stack([start, replied, final]), "actions": np.array([3, 3]),
               "rewards": np.array([0.0, -1.0], dtype=np.float32), "terminated": True,
               "masks": np.ones((3, 7), dtype=bool)}
    buffer = LocalReplay(16, (2, 6, 7), np.float32, num_actions=7, seed=0)
    parallel_train_dqn.store_episodes(buffer, [episode], (), 0.9, 1, plies=plies)
    assert len(buffer) == 4 and buffer.actions[:4].tolist() == [3, 2, 3, 4]
    assert buffer.rewards[:4].tolist() == [0.0, 0.0, 0.0, 1.0] and buffer.dones[:4].tolist() == [0, 0, 0, 1]
    assert np.allclose(buffer.discounts[:4], -0.9)
    assert (buffer.next_obs[0] == buffer.obs[1]).all() and buffer.next_obs[0][1, 0, 3] == 1  # the reply's side
    q_net, target_net = TableQ([0.0] * 4 + [1.0] + [0.0] * 2), TableQ([0.0] * 4 + [1.0] + [0.0] * 2)
    sample = torch.as_tensor
    _, td, _ = double_dqn_loss(q_net, target_net, sample(buffer.obs[2:3]), sample(buffer.actions[2:3]),
                               sample(buffer.rewards[2:3]), sample(buffer.next_obs[2:3]), sample(buffer.dones[2:3]),
                               sample(buffer.discounts[2:3]), next_action_mask=sample(buffer.next_masks[2:3]))
    assert td.item() == pytest.approx(abs(0.0 - (-0.9 * 1.0)))  # the opponent's best reply is worth 1 to it
    three = LocalReplay(16, (2, 6, 7), np.float32, num_actions=7, seed=0)
    parallel_train_dqn.store_episodes(three, [episode], (), 0.9, 3, plies=plies)
    # the ply after the learner's first move: the opponent wins two of its moves later (+0.81 for it)
    assert np.allclose(three.rewards[:4], [0.0, 0.81, -0.9, 1.0]) and three.dones[:4].tolist() == [0, 1, 1, 1]
    assert np.isclose(three.discounts[0], -0.729)

    for flags, message in ((["--env-id", "CartPole-v1", "--negamax"], "--negamax True: CartPole-v1 declares no plies"),
                           (["--learner", "q_network", "--negamax", "--no-learn-both-seats"],
                            "--learn-both-seats False: negamax targets")):
        run = tmp_path / "run"
        assert parallel_train_dqn.main([*flags, "--output-dir", str(run)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines
        assert not run.exists()
    probe_env("ConnectFour-v0", actions=("Discrete",))
    chosen = {flag: parallel_train_dqn.negamax_plies(parallel_train_dqn.Config(negamax=flag))
              for flag in (None, True, False)}
    assert chosen == {None: plies, True: plies, False: None}


def test_win_rates_reached_needs_both_rates():
    reached = parallel_train_dqn.win_rates_reached
    evaluation = {"eval_win_random": 0.9, "eval_win_heuristic": 0.6}
    assert reached([0.9, 0.6], evaluation) and reached([0.5, 0.0], evaluation)
    assert not reached([0.95, 0.6], evaluation) and not reached([0.9, 0.7], evaluation)
    assert not reached(None, evaluation) and not reached([0.0, 0.0], {"eval_return": 1.0})  # single-agent env


@pytest.mark.timeout(90)
def test_target_win_rate_stops_the_run_and_moves_are_stored_mirrored(tmp_path):
    """A reachable --target-win-rate ends the run at the first evaluation, before its episode budget;
    the default on ConnectFour-v0 stores every move twice (as played and mirrored), the opponent's too.
    --anneal-lr: the first updates already learn at the rate left after 4 of the 10 budgeted episodes."""
    summary = parallel_train_dqn.train(
        learner="q_network", num_workers=1, episodes_per_batch=4, total_episodes=10, duration=None, eval_interval=1,
        eval_episodes=2,
        target_win_rate=[0.0, 0.0], hidden_sizes=[16], learning_starts=0, batch_size=16, tensorboard=False,
        anneal_lr=True, learning_rate=1e-3, output_dir=str(tmp_path / "run"))
    assert summary["exit_code"] == 0 and summary["stop_reason"] == "target win rates [0.0, 0.0] reached", summary
    assert summary["iterations"] == 1 and summary["episodes"] == 4
    (row,) = read_metrics(tmp_path / "run" / "metrics.csv")
    # the learner's moves (global_step) and the opponent's (as many or one fewer in each of the 4 games), each twice
    steps, stored = float(row["global_step"]), float(row["buffer_size"])
    assert 2 * (2 * steps - 4) <= stored <= 4 * steps and float(row["eval_win_random"]) >= 0, row
    assert float(row["learner_updates"]) >= 1 and float(row["learning_rate"]) == pytest.approx(1e-3 * (1 - 4 / 10))


# ------------------------------------------------------------------------ self-play that generalizes

def test_the_default_training_mix_holds_neither_search_players_nor_the_heuristic():
    """The players evaluation judges by stay out of the default training mix (with and without snapshots),
    so the win rates against them measure play the policy never trained against."""
    from common.envs.connect_four import HELD_OUT_PLAYERS, check_training_opponents

    cfg = parallel_train_dqn.Config()
    pool = parallel_train_dqn.OpponentPool(cfg.pool_size)
    for snapshots in (0, 2):
        for _ in range(snapshots):
            pool.add(nn.Linear(2, 2))
        probs = pool.mixture(cfg)["probs"]
        check_training_opponents(probs)  # raises on a held-out player
        assert not set(probs) & set(HELD_OUT_PLAYERS) and probs["heuristic"] == 0, probs
        assert probs["latest"] > 0 and probs["random"] > 0
    assert cfg.total_episodes is None and cfg.duration == 0.25  # the budget is wall time, not an episode count


def test_pfsp_draws_the_snapshots_that_beat_the_learner():
    """snapshot_sampling pfsp: a snapshot the learner always beats is drawn far less than one that always
    beats it; games against other players leave the rates alone; uniform splits the share evenly."""
    pool = parallel_train_dqn.OpponentPool(3)
    for _ in range(3):
        pool.add(nn.Linear(2, 2))
    assert list(pool.ids) == [0, 1, 2] and pool.win_rates() == [0.5] * 3
    pool.record([{"opponent": 0.0, "result": 1.0}] * 50 + [{"opponent": 1.0, "result": -1.0}] * 50
                + [{"opponent": -1.0, "result": -1.0}] * 50)
    assert pool.win_rates() == pytest.approx([51 / 52, 1 / 52, 0.5])
    weights = pool.mixture(parallel_train_dqn.Config())["snapshot_weights"]
    assert weights[1] > 100 * weights[0] and weights[1] > weights[2] > weights[0]
    uniform = pool.mixture(parallel_train_dqn.Config(snapshot_sampling="uniform"))
    assert uniform["snapshot_weights"] == [1.0] * 3 and uniform["snapshot_ids"] == [0, 1, 2]
    pool.add(nn.Linear(2, 2))  # the oldest leaves the pool, and its results with it
    assert list(pool.ids) == [1, 2, 3] and sorted(pool.results) == [1, 2, 3]
    resumed = parallel_train_dqn.OpponentPool(3, list(pool.snapshots), list(pool.ids))  # --resume
    resumed.record([{"opponent": 2.0, "result": 1.0}] * 2)  # resumed snapshots are measured at once
    assert resumed.win_rates() == pytest.approx([0.5, 0.75, 0.5])
    resumed.add(nn.Linear(2, 2))
    assert list(resumed.ids) == [2, 3, 4]  # ids go on from the checkpoint's, never reused
    with pytest.raises(ConfigError, match="--snapshot-sampling .league.: must be pfsp or uniform"):
        parallel_train_dqn.Config(snapshot_sampling="league").validate()


def test_a_game_against_a_snapshot_ends_with_its_id():
    """The env reports who each game was against, and the mixture draws snapshots by their weights."""
    from common.envs.connect_four import ConnectFourVectorEnv, RandomPlayer
    from common.envs.selfplay import opponent_mixture

    class Policy:  # a snapshot's inference policy: any legal move
        def act(self, obs, mask, epsilon, rng):
            return RandomPlayer(0).act(obs, mask)

    rng = np.random.default_rng(0)
    payload = {"probs": {"snapshot": 1.0}, "snapshot_weights": [0.0, 1.0], "snapshot_ids": [7, 9]}
    env = ConnectFourVectorEnv(16, opponent=opponent_mixture(payload, None, [Policy(), Policy()], 16, rng), seed=0)
    obs, info = env.reset(seed=0)
    labels = []
    for _ in range(60):
        obs, _, done, _, info = env.step(RandomPlayer(1).act(obs, info["action_mask"]))
        if done.any():
            labels += info["final_info"]["opponent"][done].tolist()
    assert len(labels) >= 16 and set(labels) == {9}


def test_the_conv_q_network_is_rebuilt_from_its_spec():
    """--conv-channels puts 3x3 convolutions before the MLP on a board (what a checkpoint's policy spec
    rebuilds); a vector observation keeps the plain MLP, and so does a spec without the key."""
    import gymnasium as gym

    from common.networks import BoardCNN, QNetwork, build_network

    board, actions = gym.spaces.Box(0.0, 1.0, (2, 6, 7), np.float32), gym.spaces.Discrete(7)
    net = QNetwork(board, actions, (32,), (8, 8))
    assert isinstance(net.trunk, BoardCNN) and net.spec["conv_channels"] == [8, 8]
    again = build_network(net.spec)
    again.load_state_dict(net.state_dict())
    obs = torch.rand(5, 2, 6, 7)
    assert again(obs).shape == (5, 7) and torch.equal(again(obs), net(obs))
    vector = QNetwork(gym.spaces.Box(-1.0, 1.0, (4,), np.float32), gym.spaces.Discrete(2), (32,), (8, 8))
    assert "conv_channels" not in vector.spec and not isinstance(vector.trunk, BoardCNN)
    assert "conv_channels" not in QNetwork(board, actions, (32,)).spec
