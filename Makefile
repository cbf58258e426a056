# Seed 003's make targets: each runs the command the docs give (docs/seeds.md lists them).
# PYTHON is the README's virtual environment once it exists: make PYTHON=python3 ... for another.
PYTHON ?= $(if $(wildcard .venv/bin/python),.venv/bin/python,python3)

.PHONY: train-parallel train-sequential compare test

# One hour of parallel PPO, 4 workers x 8 envs (docs/train_parallel_timed.md)
train-parallel runs/par_1h:
	$(PYTHON) train_parallel_timed.py --duration 1 --num-workers 4 --num-envs-per-worker 8 --output-dir runs/par_1h

# The sequential baseline on as many envs (docs/train_parallel_timed.md)
train-sequential runs/seq_1h:
	$(PYTHON) train_parallel_timed.py --duration 1 --num-workers 0 --num-envs-per-worker 32 --output-dir runs/seq_1h

# Parallel against sequential (docs/compare_results.md), training first whichever run is not there yet
compare: | runs/seq_1h runs/par_1h
	$(PYTHON) compare_results.py --sequential runs/seq_1h --parallel runs/par_1h

# The README's test command: install into .venv, then the whole suite on 2 cores (what CI runs)
test:
	python3 -m venv .venv && .venv/bin/pip install -q -r requirements.txt -r requirements-extras.txt -r requirements-tracking.txt -r requirements-test.txt -c constraints.txt && .venv/bin/python -m pytest -q -n 2
