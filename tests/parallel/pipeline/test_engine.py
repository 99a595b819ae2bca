"""The pipeline engine alone: a stage whose neighbour never sends fails within the timeout and
says which stage waited for what, from whom; a schedule that leaves work undone is refused."""

from __future__ import annotations

import pytest
import torch

from meshtrain import comm
from meshtrain.bench.pipeline import SleepStage
from meshtrain.errors import CollectiveTimeout
from meshtrain.mesh import Mesh
from meshtrain.parallel.pipeline.engine import PipelineEngine
from meshtrain.parallel.pipeline.schedule import build_schedule


def _engine(rank: int, pp: int) -> PipelineEngine:
    mesh = Mesh(pp=pp)
    return PipelineEngine({rank: SleepStage(4, 0.0, 0.0)}, pp, lambda s: s, mesh.pp_group, lambda out, _: out.mean())


def test_a_silent_neighbour_is_named_with_stage_and_microbatch():
    def fn(rank):
        engine = _engine(rank, 2)
        if rank == 0:
            return None  # stage 0 died (or diverged) before sending anything
        with pytest.raises(CollectiveTimeout) as err:
            engine.run(build_schedule("1f1b", 2, 2)[1], [None, None], [None, None])
        return str(err.value)

    msg = comm.run_local(2, fn, timeout=2)[1]
    assert "pipeline stage 1 (rank 1) waited for the activation of micro-batch 0 from stage 0 (rank 0)" in msg


def test_backward_waits_name_the_gradient():
    def fn(rank):
        engine = _engine(rank, 2)
        x = [torch.ones(1, 2, 4), torch.ones(1, 2, 4)]
        if rank == 1:  # stage 1 receives the activations, then dies before sending gradients back
            engine._recv(0, 0, 0, 0)  # (src stage, activation, micro-batch, sender's stage)
            engine._recv(0, 0, 1, 0)
            return None
        with pytest.raises(CollectiveTimeout) as err:
            engine.run(build_schedule("afab", 2, 2)[0], x, [None, None])
        return str(err.value)

    msg = comm.run_local(2, fn, timeout=2)[0]
    assert "pipeline stage 0 (rank 0) waited for the gradient of micro-batch 0 from stage 1 (rank 1)" in msg


def test_a_peer_death_keeps_its_type_and_ranks_when_the_pipeline_names_it(monkeypatch):
    """An error with fields of its own (the shm transport's PeerDied names the dead ranks) comes
    out of a pipeline receive as the same type, with its fields and the pipeline's words; it
    used to end in a TypeError of the error path itself."""
    from meshtrain.comm.transport.shm import PeerDied

    def recv(*args, **kwargs):
        raise PeerDied("rank 0 (pid 12) exited or was killed while rank 1 was waiting", [0])

    monkeypatch.setattr("meshtrain.parallel.pipeline.engine.comm.recv", recv)

    def fn(rank):
        if rank == 0:
            return None
        with pytest.raises(PeerDied) as err:
            _engine(rank, 2)._recv(0, 0, 0, 0)
        return err.value

    err = comm.run_local(2, fn, timeout=5)[1]
    assert err.missing == [0]
    assert str(err).startswith("pipeline stage 1 (rank 1) waited for the activation of micro-batch 0 from stage 0 "
                               "(rank 0), which did not send it: rank 0 (pid 12) exited")


def test_a_signature_skips_headers_and_refuses_a_shape_it_did_not_announce(monkeypatch):
    """With a signature, the second step's messages carry no header (fewer sends) and the
    receiver allocates from the first; a sender whose shape changed under the same signature
    fails with both shapes named (its receiver would otherwise read a wrong-sized tensor)."""
    sends: dict[int, list] = {0: [], 1: []}
    real = comm.isend

    def isend(t, *args, **kwargs):  # one patch for both rank threads, counted per rank
        sends[comm.get_rank()].append(t.shape)
        return real(t, *args, **kwargs)

    monkeypatch.setattr(comm, "isend", isend)

    def fn(rank):
        engine = _engine(rank, 2)
        actions, out = build_schedule("afab", 2, 2)[rank], []
        for x in (torch.ones(1, 2, 4), torch.full((1, 2, 4), 2.0)):
            before = len(sends[rank])
            loss, _ = engine.run(actions, [x, x], [None, None], signature="2x4")
            out.append((len(sends[rank]) - before, float(loss)))
        if rank == 0:
            with pytest.raises(RuntimeError, match=r"sends a torch.float32 \(1, 3, 4\).*sent torch.float32 \(1, 2, 4\)"):
                engine.run(actions, [torch.ones(1, 3, 4)] * 2, [None, None], signature="2x4")
        return out

    first, second = comm.run_local(2, fn, timeout=10)
    assert first[0][0] == 2 * first[1][0] and second[0][0] == 2 * second[1][0] > 0  # header + tensor, then tensor
    assert second[1][1] != second[0][1] and first[1][1] == 0.0  # the second step's data really arrived
