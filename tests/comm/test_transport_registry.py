"""A transport is one registry entry: a transport added from this file alone (one class, one
``TransportSpec``) runs every collective, passes the config's validation and the bench CLI's, and
the built-in entries hold exactly the facts the code used to keep in per-name tables."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from typing import Any, Iterator

import pytest
import torch

import meshtrain.comm as mc
from meshtrain.comm.transport import registry
from meshtrain.comm.transport.base import Capabilities, capabilities
from meshtrain.comm.transport.local import LocalTransport
from meshtrain.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

SENT: Counter[int] = Counter()  # messages each rank of the echo transport posted


class EchoTransport(LocalTransport):
    """The thread transport under another name, counting what it sends (so the test sees that the
    collectives really went through it)."""

    kind = "echo"

    def isend(self, tensor: torch.Tensor, dst: int, tag: int) -> Any:
        """Count, then send as ``local`` does."""
        SENT[self.rank] += 1
        return super().isend(tensor, dst, tag)


ECHO = registry.TransportSpec(
    name=EchoTransport.kind,
    build=lambda setup: EchoTransport(setup.world, setup.rank),
    capabilities=Capabilities(cpu_only=False, ranks_are_threads=True),
    cost_model=(20e-6, 1 / 2e9, 1 / 4e9),
)


@pytest.fixture
def echo() -> Iterator[registry.TransportSpec]:
    """The echo transport, registered for one test."""
    SENT.clear()
    registry.register(ECHO)
    try:
        yield ECHO
    finally:
        registry.unregister(ECHO.name)


def _data(rank: int, n: int = 12) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64) * (rank + 1) + rank


def _collectives(rank: int) -> dict[str, Any]:
    p = mc.get_world_size()
    assert mc.current().transport.kind == "echo"
    out: dict[str, Any] = {}
    for algorithm in ("auto", "ring", "direct"):  # auto: priced by the entry's cost model (threads)
        t = _data(rank)
        mc.all_reduce(t, algorithm=algorithm)
        out[f"all_reduce/{algorithm}"] = t
    gathered = [torch.empty(4, dtype=torch.float64) for _ in range(p)]
    mc.all_gather(gathered, _data(rank, 4))
    out["all_gather"] = torch.stack(gathered)
    b = _data(rank) if rank == 1 else torch.zeros(12, dtype=torch.float64)
    mc.broadcast(b, src=1)
    out["broadcast"] = b
    rs = torch.empty(4, dtype=torch.float64)
    mc.reduce_scatter(rs, list(_data(rank).chunk(p)))
    out["reduce_scatter"] = rs
    got = torch.empty(5, dtype=torch.float64)  # a ring of send/recv: each rank hears from its left
    if rank % 2 == 0:
        mc.send(_data(rank, 5), dst=(rank + 1) % p)
        mc.recv(got, src=(rank - 1) % p)
    else:
        mc.recv(got, src=(rank - 1) % p)
        mc.send(_data(rank, 5), dst=(rank + 1) % p)
    out["recv"] = got
    out["cost_model"] = mc.current().world.cost_model
    return out


def test_a_transport_added_by_one_class_and_one_entry_runs_the_collectives(echo):
    p = 3
    results = mc.run_local(p, _collectives, transport="echo", timeout=20)
    total = sum(_data(r) for r in range(p))
    for rank, got in enumerate(results):
        for algorithm in ("auto", "ring", "direct"):
            torch.testing.assert_close(got[f"all_reduce/{algorithm}"], total)
        torch.testing.assert_close(got["all_gather"], torch.stack([_data(r, 4) for r in range(p)]))
        torch.testing.assert_close(got["broadcast"], _data(1))
        torch.testing.assert_close(got["reduce_scatter"], total.chunk(p)[rank])
        torch.testing.assert_close(got["recv"], _data((rank - 1) % p, 5))
        assert got["cost_model"].alpha == echo.cost_model[0]  # threads keep the entry's model
    assert all(SENT[r] > 0 for r in range(p))  # the data went through the echo transport


def test_config_accepts_a_registered_transport_and_names_them_all_for_an_unknown_one(echo):
    from meshtrain.config import load_config

    assert load_config(None, ["--comm.transport=echo"]).comm.transport == "echo"
    with pytest.raises(ConfigError, match=r"comm.transport = 'bogus' is not one of auto, echo, local, shm, torch$"):
        load_config(None, ["--comm.transport=bogus"])
    registry.unregister("echo")
    with pytest.raises(ConfigError, match=r"'echo' is not one of auto, local, shm, torch$"):
        load_config(None, ["--comm.transport=echo"])


def test_run_local_and_init_take_only_their_kind_of_transport(echo):
    with pytest.raises(ValueError, match=r"run_local cannot run transport 'torch' \(its ranks are processes"):
        mc.run_local(2, lambda rank: rank, transport="torch")
    with pytest.raises(ValueError, match="cannot run transport 'bogus': use one whose ranks are threads, echo, local"):
        mc.run_local(2, lambda rank: rank, transport="bogus")
    # init's check comes first, before torch.distributed is touched
    with pytest.raises(ValueError, match=r"unknown transport 'echo': use 'shm', 'torch' or 'auto' \(threads"):
        mc.init(transport="echo")


def test_the_registry_refuses_auto_and_a_second_entry_of_a_name(echo):
    with pytest.raises(ValueError, match="cannot name a transport"):
        registry.register(registry.TransportSpec("auto", build=echo.build))
    with pytest.raises(ValueError, match="'echo' is already registered"):
        registry.register(registry.TransportSpec("echo", build=echo.build))
    registry.register(echo)  # the same entry again: a no-op
    with pytest.raises(ValueError, match="registered transports are echo, local, shm, torch"):
        registry.get("bogus")
    assert registry.runs_as_threads("echo") and not registry.runs_as_threads("auto")
    assert "echo" not in registry.auto_names("auto")  # auto never takes threads


def test_builtin_entries_hold_what_the_code_used_to_hard_code():
    from meshtrain.bench.comm_cli import only_on
    from meshtrain.comm import select
    from meshtrain.comm.algorithms import TABLE, algorithms_for
    from meshtrain.comm.transport.shm import ShmTransport
    from meshtrain.comm.transport.torchdist import TorchTransport
    from meshtrain.config.check import transport_kinds
    from meshtrain.config.schema import transports

    assert registry.names() == ["local", "shm", "torch"]
    assert registry.names(threads=False) == ["shm", "torch"] and registry.names(threads=True) == ["local"]
    assert [LocalTransport.kind, ShmTransport.kind, TorchTransport.kind] == ["local", "shm", "torch"]
    # what transport/base.py's CAPABILITIES table held
    assert registry.capabilities_of("local") == Capabilities(cpu_only=False, ranks_are_threads=True)
    assert registry.capabilities_of("shm") == Capabilities(shared_memory=True)
    assert registry.capabilities_of("torch") == Capabilities(native_collectives=True, cpu_only=False)
    assert capabilities(type("T", (), {"kind": "torch"})()).native_collectives
    assert registry.capabilities_of("nope") == Capabilities()
    # select.py's DEFAULTS, and the torch model for a kind it does not know
    want = {"local": (30e-6, 1 / 3e9, 1 / 4e9), "torch": (300e-6, 1 / 0.8e9, 1 / 4e9), "shm": (10e-6, 1 / 5e9, 1 / 4e9)}
    for name, (a, b, g) in want.items():
        model = select.default_model(name)
        assert (model.alpha, model.beta, model.gamma, model.source) == (a, b, g, "default")
    assert select.default_model("nope") == select.default_model("torch")
    assert set(registry.names()) == want.keys()
    # what bench comm_cli's TRANSPORTS and ONLY_ON and schema's TRANSPORTS held
    assert only_on() == {"native": "torch", "shm": "shm", "shm_symmetric": "shm"}
    assert transports() == ("auto", "local", "shm", "torch")
    # auto's choice (comm.init) and config/check.py's transport_kinds, hints
    assert registry.auto_choice("nccl").name == "torch" and registry.auto_choice("gloo").name == "shm"
    assert registry.auto_choice("cpu:gloo,cuda:nccl").name == "shm"  # every backend but nccl: shm
    assert [transport_kinds("auto", b) for b in ("gloo", "nccl", "auto")] == [("shm",), ("torch",), ("shm", "torch")]
    assert transport_kinds("local", "auto") == ("local",)
    assert registry.get("torch").hint == "comm.transport = 'torch', or 'auto' with nccl"
    assert registry.get("shm").hint == "comm.transport = 'shm', or 'auto' without nccl"
    # an entry's own algorithms are exactly the dispatch table's names its capabilities add
    for spec in registry.specs():
        own = {n for (op, n) in TABLE if n in algorithms_for(op, spec.name)} - {
            n for (op, n) in TABLE if n in algorithms_for(op, "nope")}
        assert own == set(spec.algorithms) & {n for _, n in TABLE}, spec.name


def test_bench_comm_names_the_registered_transports_for_an_unknown_one(capsys):
    from meshtrain.cli import main

    assert main(["bench", "comm", "--transport", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown transport ['bogus']: use local, shm and/or torch" in err


def test_importing_meshtrain_comm_leaves_the_process_transports_unimported():
    """Only ``local`` registers at import; torchdist and shm load on the first full listing."""
    code = ("import sys, meshtrain.comm; from meshtrain.comm.transport import registry; "
            "mods = ('meshtrain.comm.transport.torchdist', 'meshtrain.comm.transport.shm'); "
            "print([m in sys.modules for m in mods], registry.names(), [m in sys.modules for m in mods])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[False, False] ['local', 'shm', 'torch'] [True, True]"


def test_bench_comm_runs_a_registered_thread_transport(echo, capsys):
    from meshtrain.cli import main

    assert main(["bench", "comm", "--transport", "echo", "--world", "2", "--algorithms", "ring,native",
                 "--sizes", "1K", "--iters", "1", "--warmup", "0", "--trials", "1"]) == 0
    out = capsys.readouterr().out
    assert "transport=echo world=2 op=all_reduce algorithm=ring" in out  # native: the torch transport's only
    assert "algorithm=native" not in out and "Out of bounds values : 0 OK" in out
