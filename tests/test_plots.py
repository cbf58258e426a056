"""The plotter process (common/plots.py): it draws a run's end-of-run plots, survives Ctrl+C, leaves the
drawing to the run when it is gone, and never outlives its run."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
from conftest import ROOT, script_env

from common.plots import Plotter

ROWS = "global_step,wall_time,episodic_return,return_mean100,loss,sps,samples_per_s,worker,worker_step\n" + "".join(
    f"{i * 100},{i * 0.1},{i},{i / 2},{1 / (i + 1)},{1000 + i},{500 + i},{i % 2},{i * 50}\n" for i in range(20))


def plots_of(tmp_path) -> list[dict]:
    metrics = tmp_path / "metrics.csv"
    metrics.write_text(ROWS)
    return [{"plot": name, "metrics": str(metrics), "out": str(tmp_path / "plots" / f"{name}.png"), "title": name}
            for name in ("training_curve", "ultra_results", "population")]


def command_line(pid: int) -> str:
    """The process's command line, once it has one (between fork and exec /proc reads it empty)."""
    deadline = time.monotonic() + 10
    while not (line := " ".join(psutil.Process(pid).cmdline())) and time.monotonic() < deadline:
        time.sleep(0.01)
    return line


def test_the_plotter_draws_every_plot_and_exits(tmp_path):
    plotter = Plotter.start()
    proc = plotter.proc
    try:
        assert proc is not None and "common.plots" in command_line(proc.pid)
        assert plotter.draw(plots_of(tmp_path)) == []
    finally:
        plotter.close()  # ends it if an assertion came first (after draw() it is no longer the plotter's)
    assert proc.returncode == 0  # it drew them itself, then exited
    for name in ("training_curve", "ultra_results", "population"):
        assert (tmp_path / "plots" / f"{name}.png").stat().st_size > 10_000


def test_ctrl_c_leaves_the_plotter_drawing(tmp_path):
    plotter = Plotter.start()
    # Once it loads matplotlib it is past its first line, which ignores SIGINT.
    deadline = time.monotonic() + 30
    while not any("matplotlib" in m.path for m in psutil.Process(plotter.proc.pid).memory_maps()):
        assert time.monotonic() < deadline, "the plotter never loaded matplotlib"
        time.sleep(0.02)
    plotter.proc.send_signal(signal.SIGINT)  # a terminal's Ctrl+C reaches the run's whole process group
    time.sleep(0.3)
    proc = plotter.proc
    assert proc.poll() is None
    assert plotter.draw(plots_of(tmp_path)) == [] and proc.returncode == 0


def test_a_plotter_that_is_gone_leaves_the_plots_to_the_run_and_a_bad_plot_is_reported(tmp_path):
    plotter = Plotter.start()
    plotter.proc.kill()
    plotter.proc.wait()
    plots = plots_of(tmp_path)
    plots.append({**plots[0], "metrics": str(tmp_path / "missing.csv")})
    errors = plotter.draw(plots)
    assert len(errors) == 1 and "missing.csv" in errors[0]
    assert all((tmp_path / "plots" / f"{name}.png").exists() for name in ("training_curve", "population"))


def gone_within(proc: psutil.Process, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:  # exited; whoever adopted it reaps it
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_the_plotter_never_outlives_its_run():
    # Its run is killed with kill -9: the plotter reads end of file and exits.
    program = "from common.plots import Plotter; import time; print(Plotter.start().proc.pid, flush=True); " \
              "time.sleep(60)"
    run = subprocess.Popen([sys.executable, "-c", program], cwd=ROOT, env=script_env(), stdout=subprocess.PIPE,
                           text=True)
    try:
        plotter = psutil.Process(int(run.stdout.readline()))
        run.kill()
        run.wait()
        assert gone_within(plotter, 20), "the plotter outlived its run"
    finally:
        run.kill()
        run.stdout.close()
    # A run that ends before it asks for plots ends its plotter.
    plotter = Plotter.start()
    proc = plotter.proc
    plotter.close()
    assert proc.poll() is not None
