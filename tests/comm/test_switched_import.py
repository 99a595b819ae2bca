"""A torch.distributed program that switches its import to meshtrain.comm: ``init_process_group``
takes shared memory between the ranks of a host and gloo between hosts, per link; torch's own
ProcessGroups stay valid beside it. Processes start as torchrun leaves them (torch.distributed
initialised, meshtrain not), two simulated hosts by host id (ranks 0,1 on "a", 2,3 on "b")."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from meshtrain.comm.launch import spawn

pytestmark = pytest.mark.timeout(120)

HOSTS = ["a", "a", "b", "b"]


def _inputs(rank: int, n: int = 6) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64) * (rank + 1) + rank


def _record_shm_peers(seen: dict[str, set]) -> None:
    """Wrap the shm transport's mailbox posts and shared areas to record which ranks they touch."""
    from meshtrain.comm.transport.shm import ShmTransport

    send, recv, area = ShmTransport._post_send, ShmTransport._post_recv, ShmTransport.area

    def post_send(self, data, dst, tag, result):  # type: ignore[no-untyped-def]
        seen["mailbox"].add(dst)
        return send(self, data, dst, tag, result)

    def post_recv(self, out, src, tag, result):  # type: ignore[no-untyped-def]
        seen["mailbox"].add(src)
        return recv(self, out, src, tag, result)

    def shared_area(self, ranks, name, deadline):  # type: ignore[no-untyped-def]
        seen["areas"].update(ranks)
        return area(self, ranks, name, deadline)

    ShmTransport._post_send, ShmTransport._post_recv, ShmTransport.area = post_send, post_recv, shared_area


def _across_hosts(rank: int) -> dict[str, Any]:
    seen: dict[str, set] = {"mailbox": set(), "areas": set(), "remote": set()}
    _record_shm_peers(seen)
    dist = importlib.import_module("meshtrain.comm")
    dist.init_process_group("gloo")
    remote = dist.group.WORLD.comm.transport.remote
    send, recv = remote.isend, remote.irecv
    remote.isend = lambda t, dst, tag: (seen["remote"].add(dst), send(t, dst, tag))[1]
    remote.irecv = lambda t, src, tag: (seen["remote"].add(src), recv(t, src, tag))[1]

    out: dict[str, Any] = {}
    cross = dist.new_group([0, 2])  # one rank of each host
    mine, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])  # a host's ranks
    for name, g in (("world", None), ("cross", cross), ("host", mine)):
        if dist.get_rank(g) < 0:
            continue
        ranks = dist.get_process_group_ranks(g)
        x = _inputs(rank)
        dist.all_reduce(x, group=g)
        gathered = torch.empty(len(ranks) * 6, dtype=torch.float64)
        dist.all_gather_into_tensor(gathered, _inputs(rank), group=g)
        b = _inputs(rank)
        dist.broadcast(b, src=ranks[-1], group=g)
        out[name] = {"ranks": ranks, "sum": x, "gathered": gathered, "bcast": b, "describe": dist.describe(g)}
    peer = rank ^ 2  # the same position on the other host
    got = torch.empty(6, dtype=torch.float64)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, _inputs(rank), peer),
                                     dist.P2POp(dist.irecv, got, peer)]):
        w.wait()
    out["p2p"] = got
    out["backend"] = dist.get_backend()
    out["seen"] = {k: sorted(v) for k, v in seen.items()}
    dist.destroy_process_group()
    return out


def test_cross_host_links_take_gloo_and_host_links_shared_memory() -> None:
    res = spawn(4, _across_hosts, transport=None, host_ids=HOSTS, timeout=90)
    for rank, out in enumerate(res):
        same = {r for r in range(4) if HOSTS[r] == HOSTS[rank] and r != rank}
        other = {r for r in range(4) if HOSTS[r] != HOSTS[rank]}
        # shared memory never carries a byte to or from another host, and gloo carried some
        assert set(out["seen"]["mailbox"]) | set(out["seen"]["areas"]) <= same | {rank}, out["seen"]
        assert set(out["seen"]["remote"]) & other, out["seen"]
        assert out["backend"] == "gloo"
        for name, g in ((k, v) for k, v in out.items() if k in ("world", "cross", "host")):
            ranks = g["ranks"]
            assert torch.equal(g["sum"], sum(_inputs(r) for r in ranks)), name
            assert torch.equal(g["gathered"], torch.cat([_inputs(r) for r in ranks])), name
            assert torch.equal(g["bcast"], _inputs(ranks[-1])), name
            links = g["describe"]["links"]
            assert links == {r: ("shm" if r in same else "gloo") for r in ranks if r != rank}, (name, links)
            assert g["describe"]["collectives"] == ("shm" if name == "host" else "p2p algorithms")
        assert torch.equal(out["p2p"], _inputs(rank ^ 2))


def _mixed(rank: int) -> dict[str, Any]:
    """meshtrain.comm and torch.distributed calls interleaved on the same groups, and DDP (a torch
    library that uses torch's default group) training beside them."""
    import torch.distributed as tdist

    import meshtrain.comm as dist

    dist.init_process_group("gloo")
    pair, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    torch_pairs = [tdist.new_group([0, 1]), tdist.new_group([2, 3])]  # torch's own, every rank makes both
    torch_pair = torch_pairs[rank // 2]
    out: dict[str, Any] = {"describe": dist.describe(pair)}
    x = _inputs(rank)
    dist.all_reduce(x)  # meshtrain, world
    tdist.all_reduce(x)  # torch, world (its default group is still valid)
    dist.all_reduce(x, group=pair)  # meshtrain, subgroup
    tdist.all_reduce(x, group=pair.torch_group)  # torch, the same subgroup's twin
    dist.all_reduce(x, group=torch_pair)  # meshtrain, given torch's group with those ranks
    out["x"] = x
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).double()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    inp = torch.full((3, 4), float(rank + 1), dtype=torch.float64)
    ddp(inp).sum().backward()
    out["grad"] = model.weight.grad.clone()
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_meshtrain_and_torch_calls_mix_on_the_same_groups() -> None:
    res = spawn(4, _mixed, transport=None, timeout=90)
    world = sum(_inputs(r) for r in range(4))
    for rank, out in enumerate(res):
        pair = [0, 1] if rank < 2 else [2, 3]
        expect = world * 4  # meshtrain then torch over the world: 4 equal values summed
        expect = expect * 2 * 2 * 2  # three pair sums of equal values
        assert torch.equal(out["x"], expect)
        assert out["describe"]["torch_group"] and out["describe"]["collectives"] == "shm"
        # DDP averaged the gradient over the world: the mean of the ranks' inputs, plain torch here
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2).double()
        mean_inp = torch.stack([torch.full((3, 4), float(r + 1), dtype=torch.float64) for r in range(4)]).mean(0)
        model(mean_inp).sum().backward()
        assert torch.allclose(out["grad"], model.weight.grad, rtol=1e-12), (pair, out["grad"])
