# The README's commands. run and test bootstrap .venv first (idempotent, fast when done).
.PHONY: run test bootstrap gpu-check

bootstrap:
	@bash scripts/bootstrap.sh

run: bootstrap
	.venv/bin/meshtrain train

# The suite gets a temp dir of its own, removed after: what other programs put in /tmp meanwhile
# is not in its way, and what it leaves (an aborted run's) is not in theirs. Two xdist workers, a
# file at a time: one process keeps about one core busy (tests/_parallel_suite.py). The 15 slowest
# tests are listed at the end, so a CI log shows where the suite's time goes.
test: bootstrap
	@d="$$(mktemp -d "$${TMPDIR:-/tmp}/meshtrain-suite.XXXXXX")"; trap 'rm -rf "$$d"' EXIT; \
	TMPDIR="$$d" .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=15

# On a GPU machine: the CUDA tests and the GPU benchmarks, written to gpu-check/report.md. No
# bootstrap first: it takes .venv or a python3 whose torch sees CUDA as they are (the script says which).
gpu-check:
	@bash scripts/gpu_check.sh
