"""train(config) -> summary from Python, as a notebook calls it: twice in one process, nothing left behind."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import ROOT, script_env

PROGRAM = textwrap.dedent('''
    import json, logging, os, signal, sys, threading, time
    import psutil
    import train_parallel_timed as timed

    def leftovers():
        children = [c for c in psutil.Process().children(recursive=True)
                    if "resource_tracker" not in " ".join(c.cmdline())]
        segments = [n for n in os.listdir("/dev/shm") if n.startswith(f"prl_{os.getpid()}_")]
        return {"children": len(children), "segments": segments, "threads": threading.active_count(),
                "sigint_as_before": signal.getsignal(signal.SIGINT) is SIGINT_BEFORE,
                "log_handlers": len(logging.getLogger("prl").handlers)}

    # Python's own Ctrl+C handler, or SIG_IGN when this program was started in the background by a shell
    # without job control (SIGINT ignored is inherited): either way, what a run must leave as it found it.
    SIGINT_BEFORE = signal.getsignal(signal.SIGINT)

    if __name__ == "__main__":
        out = {}
        tiny = dict(env_id="CartPole-v1", num_workers=2, num_envs_per_worker=4, n_steps=32, batch_size=64,
                    tensorboard=False)
        out["first"] = timed.train(timed.Config(**tiny, total_timesteps=1024, output_dir=sys.argv[1] + "/a"))
        out["after_first"] = leftovers()
        out["second"] = timed.train(**tiny, total_timesteps=1024, output_dir=sys.argv[1] + "/b")
        try:
            timed.train(**{**tiny, "num_workers": -1}, total_timesteps=1024, output_dir=sys.argv[1] + "/c")
        except ValueError as err:
            out["bad"] = str(err)
        # Ctrl+C in a notebook: SIGINT to the process once the run has saved its first checkpoint.
        checkpoint = os.path.join(sys.argv[1], "d", "checkpoints", "latest.pt")
        def interrupt_after_a_checkpoint():
            deadline = time.monotonic() + 60
            while not os.path.exists(checkpoint) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=interrupt_after_a_checkpoint, daemon=True).start()
        out["interrupted"] = timed.train(**{**tiny, "num_workers": 1}, total_timesteps=10**8, target_return="none",
                                         checkpoint_interval_s=0.5, output_dir=sys.argv[1] + "/d")
        out["after_all"] = leftovers()
        print(json.dumps(out))
''')


@pytest.mark.timeout(240)
def test_train_from_python_twice_interrupted_and_clean(tmp_path):
    program = tmp_path / "notebook.py"
    program.write_text(PROGRAM)
    result = subprocess.run([sys.executable, str(program), str(tmp_path)], cwd=ROOT, env=script_env(),
                            capture_output=True, text=True, timeout=230)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    for key, directory in (("first", "a"), ("second", "b")):
        summary = out[key]
        assert summary["exit_code"] == 0 and summary["global_step"] == 1024, summary
        assert summary["time_budget"]["process_s"] < 60  # counted from the call, not from the process start
        on_disk = json.loads((tmp_path / directory / "summary.json").read_text())
        assert summary == {**on_disk, "run_dir": str(tmp_path / directory)}
    assert out["bad"].startswith("--num-workers -1: must be >= 0") and not (tmp_path / "c").exists()
    interrupted = out["interrupted"]
    assert interrupted["stop_reason"] == "interrupted" and interrupted["exit_code"] == 130
    assert (tmp_path / "d" / "checkpoints" / "latest.pt").exists() and interrupted["global_step"] > 0
    for when in ("after_first", "after_all"):
        assert out[when] == {"children": 0, "segments": [], "threads": 1, "sigint_as_before": True,
                             "log_handlers": 0}, (when, out[when])


def test_aliases_read_and_write_the_same_field():
    import dataclasses

    from common.config import aliased, to_dict

    @aliased
    @dataclasses.dataclass
    class Settings:
        num_workers: int = 2
        total_episodes: int | None = None
        ALIASES = {"n_workers": "num_workers", "n_episodes": "total_episodes"}

    settings = Settings(n_workers=5, n_episodes=10)
    assert (settings.num_workers, settings.n_workers, settings.total_episodes) == (5, 5, 10)
    settings.n_workers = 7
    assert settings.num_workers == 7 and to_dict(settings) == {"num_workers": 7, "total_episodes": 10}
    with pytest.raises(TypeError, match="same setting"):
        Settings(n_workers=1, num_workers=2)


SEED_FORMS = textwrap.dedent('''
    import json, sys
    import parallel_train_dqn
    import train_ppo_multiprocess
    import ultra_parallel_train_dqn
    from ultra_parallel_train_dqn import UltraTrainingConfig

    if __name__ == "__main__":
        out = sys.argv[1]
        config = UltraTrainingConfig(env_id="CartPole-v1", n_episodes=30, n_workers=1, envs_per_worker=4,
                                     learning_starts=200, tensorboard=False, output_dir=out + "/ultra")
        results = {"ultra": ultra_parallel_train_dqn.train(config)}
        results["dqn"] = parallel_train_dqn.train_dqn(n_episodes=16, num_workers=1, env_id="CartPole-v1",
                                                      episodes_per_batch=8, eval_interval=0, eval_episodes=4,
                                                      learning_starts=100, tensorboard=False,
                                                      output_dir=out + "/dqn")
        results["population"] = train_ppo_multiprocess.train(train_ppo_multiprocess.Config(
            env_id="CartPole-v1", num_workers=1, num_envs_per_worker=4, n_steps=64, batch_size=64,
            max_steps_per_worker=512, target_return="none", eval_episodes=2, tensorboard=False,
            output_dir=out + "/population"))
        print(json.dumps({k: {"exit_code": v["exit_code"], "episodes": v["episodes"], "steps": v["global_step"],
                              "run_dir": v["run_dir"], "num_workers": v["num_workers"]} for k, v in results.items()}))
''')


@pytest.mark.timeout(240)
def test_the_seeds_python_forms(tmp_path):
    """Seed 001's UltraTrainingConfig(...) then train, seed 002's train_dqn(...), the population's
    train(Config(...))."""
    program = tmp_path / "seeds.py"
    program.write_text(SEED_FORMS)
    result = subprocess.run([sys.executable, str(program), str(tmp_path)], cwd=ROOT, env=script_env(),
                            capture_output=True, text=True, timeout=230)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["ultra"]["exit_code"] == 0 and out["ultra"]["episodes"] >= 30 and out["ultra"]["num_workers"] == 1
    assert out["dqn"]["exit_code"] == 0 and out["dqn"]["episodes"] >= 16
    assert out["population"]["exit_code"] == 0 and out["population"]["steps"] >= 512
    for name, summary in out.items():
        assert summary["run_dir"] == str(tmp_path / name) and (tmp_path / name / "summary.json").exists()
