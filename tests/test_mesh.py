"""Mesh: rank <-> coordinates, the groups of every axis, and degree validation."""

from __future__ import annotations

import itertools

import pytest
import torch

from meshtrain import comm
from meshtrain.errors import ConfigError
from meshtrain.mesh import Mesh, validate_degrees


@pytest.mark.parametrize("shape", [(2, 2, 1, 2), (1, 2, 2, 2), (8, 1, 1, 1), (1, 1, 1, 8), (2, 1, 2, 2)])
def test_groups_match_the_formula(shape):
    dp, pp, cp, tp = shape

    def fn(rank):
        mesh = Mesh(dp, pp, cp, tp)
        c = mesh.coords
        assert rank == ((c.dp * pp + c.pp) * cp + c.cp) * tp + c.tp
        assert mesh.rank_of(c.dp, c.pp, c.cp, c.tp) == rank
        # each axis group holds exactly the ranks that differ from us along that axis only
        for axis, axes in (("tp", ("tp",)), ("cp", ("cp",)), ("pp", ("pp",)), ("dp", ("dp",)),
                           ("dp_cp", ("dp", "cp"))):
            g = mesh.group(axis)
            want = sorted(r for r in range(8) if all(
                getattr(mesh.coords_of(r), d) == getattr(c, d) for d in ("dp", "pp", "cp", "tp") if d not in axes))
            assert sorted(g.ranks) == want
            # and a collective over it sums exactly those ranks' values
            t = torch.tensor([float(rank)])
            comm.all_reduce(t, group=g)
            assert t.item() == sum(want)
        assert mesh.is_first_stage == (c.pp == 0) and mesh.is_last_stage == (c.pp == pp - 1)
        assert mesh.coords_of(mesh.stage_rank(pp - 1)).pp == pp - 1
        return c

    coords = comm.run_local(8, fn, timeout=30)
    assert len({(c.dp, c.pp, c.cp, c.tp) for c in coords}) == 8


@pytest.mark.parametrize("degrees,fragment", [
    ((3, 1, 1, 1), "= 3 but the world size is 4"),
    ((2, 2, 1, 2), "= 8 but the world size is 4"),
    ((0, 1, 1, 4), "positive integers"),
    ((4, -1, 1, 1), "positive integers"),
    ((2, 1, 1, 1.0), "positive integers"),
])
def test_bad_degrees_name_the_problem_and_a_valid_layout(degrees, fragment):
    with pytest.raises(ConfigError) as exc:
        validate_degrees(4, *degrees)
    msg = str(exc.value)
    assert fragment in msg
    # the suggestion itself must be a valid factorisation of 4
    sugg = dict(kv.split("=") for kv in msg.rsplit("e.g. ", 1)[1].split(", "))
    validate_degrees(4, *(int(sugg[d]) for d in ("dp", "pp", "cp", "tp")))


def test_bad_degrees_fail_before_any_group_is_created():
    def fn(rank):
        before = len(comm.current().groups)
        with pytest.raises(ConfigError):
            Mesh(2, 1, 1, 1)
        return len(comm.current().groups) - before

    assert comm.run_local(3, fn, timeout=10) == [0, 0, 0]


def test_every_factorisation_of_4():
    layouts = [s for s in itertools.product([1, 2, 4], repeat=4) if s[0] * s[1] * s[2] * s[3] == 4]

    def fn(rank):
        out = []
        for s in layouts:
            m = Mesh(*s)
            t = torch.ones(1)
            comm.all_reduce(t, group=m.dp_cp)
            out.append(t.item() == s[0] * s[2])
        return out

    assert all(all(r) for r in comm.run_local(4, fn, timeout=30))
