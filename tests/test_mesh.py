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


def _expected_ranks(mesh: Mesh, rank: int, axes: tuple[str, ...]) -> list[int]:
    """The ranks that differ from ``rank`` only along ``axes``, by brute force over coordinates."""
    mine = mesh.coords_of(rank)
    return sorted(r for r in range(mesh.world_size)
                  if all(mesh.coords_of(r)[a] == mine[a] for a in mesh.axes if a not in axes))


def test_dp_as_replicas_times_shards():
    """dp4 = 2 replicas x 2 shards over 8 ranks with tp2: every axis and view groups exactly the
    ranks that differ along its axes, dp's coordinate reads replica and shard together, and a
    collective over each group sums exactly its ranks."""
    shard = ("dp_shard_mod_ep", "dp_shard_in_ep")  # dp_shard, cut where an expert group would end
    views = {"dp_shard": shard, "dp": ("dp_replicate", *shard), "dp_cp": ("dp_replicate", *shard, "cp"),
             "dp_shard_cp": (*shard, "cp")}

    def fn(rank):
        mesh = Mesh(dp=4, tp=2, dp_replicate=2)
        c = mesh.coords
        assert mesh.axes == {"dp_replicate": 2, "dp_shard_mod_ep": 2, "dp_shard_in_ep": 1, "pp": 1, "cp": 1, "tp": 2}
        assert mesh.shape == {"dp": 4, "pp": 1, "cp": 1, "tp": 2, "ep": 1}
        assert c.dp == c.dp_replicate * 2 + c.dp_shard and rank == c.dp * 2 + c.tp
        assert mesh.rank_of(dp=c.dp, tp=c.tp) == mesh.rank_of(dp_replicate=c.dp_replicate,
                                                              dp_shard=c.dp_shard, tp=c.tp) == rank
        for name in ("dp_replicate", "tp", *views):
            axes = views.get(name, (name,))
            g = mesh.group(name)
            assert sorted(g.ranks) == _expected_ranks(mesh, rank, axes), name
            t = torch.tensor([float(rank)])
            comm.all_reduce(t, group=g)
            assert t.item() == sum(_expected_ranks(mesh, rank, axes))
        # ZeRO's shard group and the replicas are different groups; a replica writes first only at 0
        assert mesh.is_first_replica({"dp_shard_cp", "tp"}) == (c.dp_replicate == 0)
        return c.dp_replicate, c.dp_shard, c.tp

    assert sorted(comm.run_local(8, fn, timeout=30)) == [(r, s, t) for r in range(2) for s in range(2)
                                                          for t in range(2)]


def test_views_of_one_set_of_ranks_share_a_group_and_no_extra_groups_are_made():
    """With dp_replicate = 1, dp_shard / dp and dp_cp / dp_shard_cp are the same ranks: one group
    each, so the named axes create no more groups than the four fixed axes did, plus the
    reduction's own dp x cp group (shared by dp_cp and dp_shard_cp, never by the computation)."""
    def fn(rank):
        before = len(comm.current().groups)
        mesh = Mesh(dp=2, cp=2)
        assert mesh.group("dp") is mesh.group("dp_shard")
        assert mesh.group("dp_cp") is mesh.group("dp_shard_cp")
        assert mesh.group("dp_replicate").size == 1
        assert mesh.reduction_group("dp_cp") is mesh.reduction_group("dp_shard_cp")
        assert mesh.reduction_group("dp_cp") is not mesh.group("dp_cp")
        assert mesh.reduction_group("dp_cp").ranks == mesh.group("dp_cp").ranks
        return len(comm.current().groups) - before

    # one dp group per cp coordinate (2), one cp group per dp coordinate (2), one dp x cp group (1),
    # the reduction's dp x cp group (1)
    assert comm.run_local(4, fn, timeout=30) == [6] * 4


def test_the_reduction_never_shares_a_group_with_the_computation():
    """dp2 x ep2 (the experts' all-to-all group holds the dp ranks) and tp2 x ep2 x dp2 (the
    experts' gradient group holds the tp ranks): every reduction group is a group of its own, with
    the ranks of the view it reduces over, and one that is not there is named with the fix."""
    from meshtrain.parallel.expert import EXPERT_REDUCTION_VIEWS, add_expert_views

    def fn(rank, dp, tp, ep):
        mesh = Mesh(dp=dp, tp=tp, ep=ep)
        add_expert_views(mesh)
        compute = {id(mesh.group(n)) for n in list(mesh.axes) + list(mesh.views)}
        for name in ("dp_replicate", "dp_cp", "dp_shard_cp", *EXPERT_REDUCTION_VIEWS):
            g = mesh.reduction_group(name)
            assert sorted(g.ranks) == sorted(mesh.group(name).ranks), name
            assert g.size == 1 or id(g) not in compute, name
        with pytest.raises(ValueError, match=r"add_views\(\.\.\., reduction=\['tp'\]\)"):
            mesh.reduction_group("tp")
        same = (lambda a, b: mesh.group(a).size > 1 and mesh.group(a).ranks == mesh.group(b).ranks)
        return same("ep", "dp"), same("edp_tp", "tp")  # the layouts where a stream used to share a group

    assert comm.run_local(2, fn, 2, 1, 2, timeout=30) == [(True, False)] * 2
    assert comm.run_local(4, fn, 2, 2, 2, timeout=30) == [(True, True)] * 4


def test_any_named_axes_and_views():
    """A mesh of other axes (an expert axis, say) gets the same groups and coordinates."""
    def fn(rank):
        mesh = Mesh.of({"pp": 2, "ep": 2, "tp": 2}, {"ep_tp": ("ep", "tp")})
        c = mesh.coords
        assert rank == (c.pp * 2 + c.ep) * 2 + c.tp and c.ep_tp == c.ep * 2 + c.tp
        for name, axes in (("ep", ("ep",)), ("ep_tp", ("ep", "tp")), ("pp", ("pp",))):
            assert sorted(mesh.group(name).ranks) == _expected_ranks(mesh, rank, axes)
        assert mesh.stage_rank(1 - c.pp) == rank + (4 if c.pp == 0 else -4)
        return True

    assert all(comm.run_local(8, fn, timeout=30))


@pytest.mark.parametrize("axes, views, fragment", [
    ({"a": 2, "b": 3}, {}, "hold 6 ranks but the world size is 4"),
    ({"a": 0, "b": 4}, {}, "positive integers"),
    ({"a": 2, "b": 2}, {"ab": ("b", "a")}, "mesh axes in mesh order"),
    ({"a": 2, "b": 2}, {"x": ("a", "c")}, "mesh axes in mesh order"),
])
def test_bad_axes_or_views_are_named(axes, views, fragment):
    def fn(rank):
        with pytest.raises(ConfigError, match=fragment):
            Mesh.of(axes, views)
        return True

    assert all(comm.run_local(4, fn, timeout=10))


def test_dp_replicate_must_divide_dp():
    with pytest.raises(ConfigError, match=r"dp_replicate = 3 must be a positive integer that divides dp = 4.*\[1, 2, 4\]"):
        validate_degrees(4, 4, dp_replicate=3)


def test_expert_parallel_axis_is_carved_from_dp_shard_and_cp():
    """ep = 4 out of dp4 x cp2 on 8 ranks: the ranks keep their numbers; an ep group holds two dp
    shards and both cp ranks (torchtitan's layout); the experts' data-parallel view is the rest of
    dp; add_views makes a group of any set of axes in mesh order."""
    def fn(rank):
        mesh = Mesh(dp=4, cp=2, ep=4)
        c = mesh.coords
        assert rank == c.dp * 2 + c.cp  # as without ep
        assert mesh.axes["dp_shard_in_ep"] == 2 and mesh.axes["dp_shard_mod_ep"] == 2 and mesh.ep == 4
        mesh.add_views({"edp": ("dp_replicate", "dp_shard_mod_ep"), "edp_tp": ("dp_replicate", "dp_shard_mod_ep", "tp")})
        for name in ("ep", "edp", "edp_tp", "dp_cp"):
            g = mesh.group(name)
            axes = mesh.views[name]
            assert sorted(g.ranks) == _expected_ranks(mesh, rank, axes), name
            t = torch.tensor([float(rank)])
            comm.all_reduce(t, group=g)
            assert t.item() == sum(_expected_ranks(mesh, rank, axes))
        assert mesh.group("edp") is mesh.group("edp_tp")  # tp = 1: the same ranks, one group
        assert mesh.size("ep") * mesh.size("edp") == mesh.size("dp_cp")
        return sorted(mesh.group("ep").ranks)

    groups = comm.run_local(8, fn, timeout=30)
    assert groups[0] == [0, 1, 2, 3] and groups[7] == [4, 5, 6, 7]


@pytest.mark.parametrize("degrees, fragment", [
    ({"dp": 4, "ep": 3}, r"ep = 3 must divide dp_shard = 4 x cp = 1 \(= 4\).*\[1, 2, 4\]"),
    ({"dp": 1, "cp": 4, "ep": 2}, r"ep = 2 must divide .*multiple of cp = 4.*\[1, 4\]"),
    ({"dp": 4, "dp_replicate": 2, "ep": 4}, r"ep = 4 must divide dp_shard = 2 x cp = 1"),
])
def test_bad_expert_degree_is_named_with_the_choices(degrees, fragment):
    with pytest.raises(ConfigError, match=fragment):
        validate_degrees(4, **degrees)
