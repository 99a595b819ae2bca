# The two commands of the README. Each bootstraps .venv first (idempotent, fast when done).
.PHONY: run test bootstrap

bootstrap:
	@bash scripts/bootstrap.sh

run: bootstrap
	.venv/bin/meshtrain train

test: bootstrap
	.venv/bin/python -m pytest
