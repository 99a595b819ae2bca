"""The start of a benchmark on simulated hosts (elastic_soak.py, memory_replica_cost.py): refuse
where the namespaces it needs are unavailable, and make its output folder."""

from __future__ import annotations

import sys
from pathlib import Path

from meshtrain.simhosts import namespaces_unavailable


def output_dir(out: Path, name: str) -> Path:
    """``out`` resolved and created; exits 2 naming why if simulated hosts cannot run here."""
    reason = namespaces_unavailable()
    if reason:
        print(f"{name}: {reason}", file=sys.stderr)
        raise SystemExit(2)
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    return out
