# The two commands of the README. Each bootstraps .venv first (idempotent, fast when done).
.PHONY: run test bootstrap gpu-check

bootstrap:
	@bash scripts/bootstrap.sh

run: bootstrap
	.venv/bin/meshtrain train

test: bootstrap
	.venv/bin/python -m pytest

# On a GPU machine: the CUDA tests and the GPU benchmarks, written to gpu-check/report.md.
gpu-check: bootstrap
	@bash scripts/gpu_check.sh
