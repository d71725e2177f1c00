"""DeviceMesh: layout arithmetic, printing, drawing, process groups that really connect, bad input."""

import pytest
import torch

from minifsdp import comm, dist, launch, plot
from minifsdp.mesh import DeviceMesh


def test_layout_is_megatrons_tp_fastest():
    m = DeviceMesh(dp=2, pp=2, tp=2)
    assert m.world_size == 8 and m.size("pp") == 2
    assert m.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert m.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert m.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for r in range(8):
        assert m.rank_at(**m.coords(r)) == r
    assert m.coords(6) == {"dp": 1, "pp": 1, "tp": 0} and m.ranks_along("dp", 6) == [2, 6]


def test_prints_and_draws():
    m = DeviceMesh(dp=2, tp=2)
    text = str(m)
    assert text.splitlines()[0] == "DeviceMesh(dp=2, pp=1, tp=2): 4 ranks, rank = dp*2 + pp*2 + tp"
    assert "tp groups: [0, 1] [2, 3]" in text and "dp groups: [0, 2] [1, 3]" in text
    fig = plot.mesh_diagram(DeviceMesh(dp=2, pp=2, tp=2))
    assert sum(t.get_text().startswith("rank ") for t in fig.axes[0].texts) == 8


def test_five_dimensions_cp_axis_and_ep_split():
    m = DeviceMesh(dp=4, pp=2, tp=2, cp=2, ep=2)
    assert m.world_size == 32 and m.size("cp") == 2 and m.size("ep") == 2 and m.size("edp") == 2
    for r in range(32):
        assert m.rank_at(**m.coords(r)) == r
    assert m.coords(5) == {"dp": 0, "pp": 1, "tp": 1, "cp": 0}
    assert m.groups("cp")[:2] == [[0, 2], [1, 3]]              # cp between pp and tp: tp ranks apart
    assert m.groups("ep")[:2] == [[0, 8], [16, 24]] and m.groups("edp")[:2] == [[0, 16], [8, 24]]
    text = str(m)
    assert "rank = dp*8 + pp*4 + cp*2 + tp" in text and "cp groups: [0, 2]" in text and "edp groups:" in text
    fig = plot.mesh_diagram(m)
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert sum(t.startswith("rank ") for t in labels) == 32 and "cp=1 tp=1" in labels
    assert any(t.startswith("ep group 1") for t in labels) and "edp group 1" in labels
    with pytest.raises(ValueError, match=r"ep=3 must divide dp=4 \(expert parallel runs inside data parallel"):
        DeviceMesh(dp=4, ep=3)
    with pytest.raises(ValueError, match="no 'edp' dimension"):
        DeviceMesh(dp=4).groups("edp")


@pytest.mark.parametrize("kw,msg", [({"dp": 0}, "dp=0"), ({"tp": -1}, "tp=-1"), ({"pp": 1.5}, "pp=1.5"),
                                    ({"dp": 4, "dp_shard": 0}, "dp_shard=0")])
def test_bad_dimension(kw, msg):
    with pytest.raises(ValueError, match=msg + ".*positive integer"):
        DeviceMesh(**kw)
    with pytest.raises(ValueError, match=r"dp_shard=3 must divide dp=4 \(HYBRID_SHARD"):
        DeviceMesh(dp=4, dp_shard=3)


@pytest.mark.parametrize("world,shard", [(4, 2), (4, 1), (4, 4), (6, 3), (8, 2)])
def test_dp_split_gives_hybrid_shards_groups(world, shard):
    # the rank lists init_hybrid_groups built by hand before it used the mesh: consecutive shard groups (a node),
    # replicate groups of the same position in every node
    m = DeviceMesh(dp=world, dp_shard=shard)
    assert m.groups("dp_shard") == [list(range(s, s + shard)) for s in range(0, world, shard)]
    assert m.groups("dp_replicate") == [list(range(o, world, shard)) for o in range(shard)]
    assert m.size("dp_replicate") * m.size("dp_shard") == m.size("dp") == world
    assert repr(m) == f"DeviceMesh(dp={world}, pp=1, tp=1, dp_shard={shard})"
    assert f"dp_shard groups: {' '.join(map(str, m.groups('dp_shard')))}" in str(m)


def test_dp_split_under_tp():
    # HSDP x TP: dp indices split as replicate x shard, each tp slice on its own
    m = DeviceMesh(dp=4, tp=2, dp_shard=2)
    assert m.groups("dp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert m.groups("dp_shard") == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert m.groups("dp_replicate") == [[0, 4], [2, 6], [1, 5], [3, 7]]


@pytest.mark.parametrize("pp,dp", [(2, 2), (4, 2), (2, 3), (1, 4)])
def test_pipeline_layout_is_the_mesh_with_tp_1(pp, dp):
    # pipeline_groups(pp, dp) laid ranks out as d*pp + s; the mesh's rank = d*(pp*tp) + p*tp + t agrees at tp=1
    m = DeviceMesh(dp=dp, pp=pp)
    assert m.groups("pp") == [[d * pp + s for s in range(pp)] for d in range(dp)]
    assert m.groups("dp") == [[d * pp + s for d in range(dp)] for s in range(pp)]


def _groups_connect():
    m = DeviceMesh(dp=2, pp=1, tp=2)
    h = DeviceMesh(dp=4, dp_shard=2)
    c, e = DeviceMesh(dp=2, cp=2), DeviceMesh(dp=4, ep=2)
    out = {}
    for dim, mesh in (("dp", m), ("tp", m), ("dp_shard", h), ("dp_replicate", h), ("cp", c), ("ep", e), ("edp", e)):
        t = torch.tensor([float(dist.rank())])
        comm.all_reduce(t, group=mesh.get_group(dim))
        out[dim] = (t.item(), mesh.get_local_rank(dim))
    try:
        DeviceMesh(dp=3, tp=2)
    except ValueError as e:
        out["error"] = str(e)
    return out


def test_groups_connect_the_right_ranks():
    outs = launch(_groups_connect, 4, timeout=60)
    # tp groups [0,1] [2,3] sum to 1, 1, 5, 5; dp groups [0,2] [1,3] sum to 2, 4, 2, 4
    assert [o["tp"] for o in outs] == [(1.0, 0), (1.0, 1), (5.0, 0), (5.0, 1)]
    assert [o["dp"] for o in outs] == [(2.0, 0), (4.0, 0), (2.0, 1), (4.0, 1)]
    # HSDP's split: shard groups [0,1] [2,3] as tp above, replicate groups [0,2] [1,3] as dp
    assert [o["dp_shard"] for o in outs] == [o["tp"] for o in outs]
    assert [o["dp_replicate"] for o in outs] == [o["dp"] for o in outs]
    # cp groups [0,1] [2,3] and ep groups [0,1] [2,3] as tp; edp groups [0,2] [1,3] (the same experts) as dp
    assert [o["cp"] for o in outs] == [o["ep"] for o in outs] == [o["tp"] for o in outs]
    assert [o["edp"] for o in outs] == [o["dp"] for o in outs]
    assert outs[0]["error"].startswith("DeviceMesh(dp=3, pp=1, tp=2) needs dp*pp*tp = 6 ranks but the world has 4")


def test_docstring_examples_run():
    import doctest

    import minifsdp.mesh

    assert doctest.testmod(minifsdp.mesh).failed == 0
