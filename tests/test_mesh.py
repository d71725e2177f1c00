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


@pytest.mark.parametrize("kw,msg", [({"dp": 0}, "dp=0"), ({"tp": -1}, "tp=-1"), ({"pp": 1.5}, "pp=1.5")])
def test_bad_dimension(kw, msg):
    with pytest.raises(ValueError, match=msg + ".*positive integer"):
        DeviceMesh(**kw)


def _groups_connect():
    m = DeviceMesh(dp=2, pp=1, tp=2)
    out = {}
    for dim in ("dp", "tp"):
        t = torch.tensor([float(dist.rank())])
        comm.all_reduce(t, group=m.get_group(dim))
        out[dim] = (t.item(), m.get_local_rank(dim))
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
    assert outs[0]["error"].startswith("DeviceMesh(dp=3, pp=1, tp=2) needs dp*pp*tp = 6 ranks but the world has 4")
