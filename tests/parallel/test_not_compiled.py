"""``not_compiled``: the communicator's helpers are left out of compiled graphs, and importing the
trainer no longer imports torch's compiler front end (about a second of CPU per worker)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from meshtrain.parallel import not_compiled as nc

ROOT = Path(__file__).resolve().parents[2]


def test_importing_the_trainer_leaves_torch_dynamo_unimported():
    code = ("import sys, meshtrain.train.cli, meshtrain.train.trainer, meshtrain.parallel.parallel_model; "
            "print('torch._dynamo' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _graph_breaks(fn, x: torch.Tensor) -> int:
    torch._dynamo.reset()
    return torch._dynamo.explain(fn)(x).graph_break_count


def test_prepare_turns_a_deferred_helper_into_a_graph_break():
    calls = []

    def helper(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x * 2

    forwarder = nc._Forwarder(helper)
    nc._PENDING.add(forwarder)
    assert forwarder.__name__ == "helper" and forwarder(torch.ones(2)).tolist() == [2.0, 2.0]

    def model(x: torch.Tensor) -> torch.Tensor:
        return forwarder(x + 1) - 1

    nc.prepare()
    assert forwarder.target is not helper and forwarder not in nc._PENDING
    assert _graph_breaks(model, torch.ones(3)) >= 1  # dynamo did not trace into the helper
    assert _graph_breaks(lambda x: helper(x + 1) - 1, torch.ones(3)) == 0  # it would have, undecorated
    compiled = torch.compile(model, backend="eager")
    assert compiled(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]


def test_a_helper_called_once_dynamo_is_loaded_disables_itself():
    import torch._dynamo  # noqa: F401  (a program that compiles has imported it)

    forwarder = nc._Forwarder(lambda x: x + 1)
    assert forwarder.target is forwarder.fn
    assert forwarder(torch.zeros(1)).item() == 1.0
    assert forwarder.target is not forwarder.fn
    assert nc.not_compiled(lambda x: x) is not None  # once loaded, the real decorator at once
