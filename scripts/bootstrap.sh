#!/usr/bin/env bash
# Create .venv if absent and install what is missing: torch only if it is not importable
# (pinned by constraints.txt), then meshtrain itself (editable) with its dev extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  echo "bootstrap: installing torch (pinned in constraints.txt)" >&2
  "$VPY" -m pip install -q -c constraints.txt torch
fi
# Re-install only when pyproject.toml changed since the last successful install.
STAMP=.venv/.meshtrain-installed
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ] || ! "$VPY" -c "import meshtrain, pytest, hypothesis, matplotlib, pytest_timeout, xdist, kubeflow.training" >/dev/null 2>&1; then
  "$VPY" -m pip install -q -e ".[dev]"
  touch "$STAMP"
fi
