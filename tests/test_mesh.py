"""Chapter 12: the rank grid. Its arithmetic is checked against brute force and against the layout
of ``torch.arange(n).view(mesh_shape)`` that torch's DeviceMesh uses; Megatron-LM's own example
(``initialize_model_parallel``'s docstring) is reproduced; and on 8 real ranks, for every shape
d·t·p = 8, the process groups ``init_groups`` makes (by hand and through DeviceMesh) contain the
ranks the grid says -- checked by an all-reduce of the members' rank numbers, not only by a list.
"""
import itertools

import pytest
import torch
import torch.distributed as dist

from minitorch_dist.models.gpt import GPTConfig
from minitorch_dist.parallelism.mesh import AXES, RankGrid, check_model, init_groups
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.launch import RankError, launch

pytestmark = pytest.mark.ch12

SHAPES_8 = [(d, t, p) for d in (1, 2, 4, 8) for t in (1, 2, 4, 8) for p in (1, 2, 4, 8) if d * t * p == 8]
ORDERS = ["-".join(o) for o in itertools.permutations(("tp", "dp", "pp"))]


def test_there_are_ten_shapes_of_eight():
    assert len(SHAPES_8) == 10 and (2, 2, 2) in SHAPES_8 and (8, 1, 1) in SHAPES_8


def test_megatron_example_16_gpus_t2_p4():
    # megatron/core/parallel_state.py, initialize_model_parallel: "we use 2 GPUs to parallelize the
    # model tensor, and 4 GPUs to parallelize the model pipeline [...] 8 tensor model-parallel groups,
    # 4 pipeline model-parallel groups and 8 data-parallel groups"
    g = RankGrid(16, dp=2, tp=2, pp=4)
    assert g.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
    assert g.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert g.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert g.embedding_groups() == [[0, 12], [1, 13], [2, 14], [3, 15]]


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", SHAPES_8)
def test_grid_is_a_bijection_and_its_groups_partition_the_ranks(shape, order):
    d, t, p = shape
    g = RankGrid(8, d, t, p, order)
    seen = set()
    for r in range(8):
        c = g.coords(r)
        assert 0 <= c.dp < d and 0 <= c.tp < t and 0 <= c.pp < p
        assert g.rank_of(*c) == r
        seen.add(tuple(c))
    assert len(seen) == 8
    for axis in AXES:
        groups = g.groups(axis)
        size = {"dp": d, "tp": t, "pp": p}[axis]
        assert len(groups) == 8 // size and all(len(x) == size for x in groups)
        assert sorted(r for x in groups for r in x) == list(range(8))
        for x in groups:
            # members run through the axis' coordinates in order; all else is fixed
            assert [getattr(g.coords(r), axis) for r in x] == list(range(size))
            assert x == sorted(x)  # so torch's group rank (sorted ranks) == the coordinate
            assert len({tuple(v for a, v in g.coords(r)._asdict().items() if a != axis) for r in x}) == 1
            for r in x:
                assert g.group_of(r, axis) == x
        # brute force: r, s share a group iff their other two coordinates are equal
        for r, s in itertools.product(range(8), repeat=2):
            same = all(getattr(g.coords(r), a) == getattr(g.coords(s), a) for a in AXES if a != axis)
            assert (s in g.group_of(r, axis)) == same


@pytest.mark.parametrize("shape", SHAPES_8)
def test_default_order_is_megatrons_tp_consecutive_pp_outermost(shape):
    d, t, p = shape
    g = RankGrid(8, d, t, p)
    for r in range(8):
        assert g.coords(r) == (r // t % d, r % t, r // (t * d))  # rank = tp + t·(dp + d·pp)
    assert all(x == list(range(x[0], x[0] + t)) for x in g.groups("tp"))
    assert g.embedding_groups() == ([[x[0], x[-1]] for x in g.groups("pp")] if p > 1 else [])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("shape", SHAPES_8)
def test_groups_equal_the_slices_of_a_row_major_mesh(shape, order):
    """DeviceMesh's layout: ranks = arange(n).view(shape slowest first); a group along dim i is a
    1-d slice with the other indices fixed."""
    d, t, p = shape
    g = RankGrid(8, d, t, p, order)
    mesh = torch.arange(8).view(g.mesh_shape)
    for i, axis in enumerate(g.mesh_dim_names):
        slices = mesh.movedim(i, -1).reshape(-1, mesh.shape[i]).tolist()
        assert sorted(slices) == g.groups(axis)


def test_bad_grids_and_models_name_the_fix():
    with pytest.raises(ValueError, match=r"dp·tp·pp = 2·2·1 = 4 does not equal the world size 8"):
        RankGrid(8, 2, 2, 1)
    with pytest.raises(ValueError, match="order"):
        RankGrid(8, 2, 2, 2, order="tp-dp")
    with pytest.raises(ValueError, match="positive int"):
        RankGrid(8, 0, 2, 4)
    g = RankGrid(8, 2, 2, 2)
    with pytest.raises(ValueError, match="outside"):
        g.coords(8)
    with pytest.raises(ValueError, match="outside"):
        g.rank_of(2, 0, 0)
    with pytest.raises(ValueError, match="unknown axis"):
        g.groups("ep")
    ok = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32)
    check_model(ok, tp=4, pp=2, virtual_stages=2)  # fits
    with pytest.raises(ValueError, match="n_head 4 is not divisible by tp=8"):
        check_model(ok, tp=8)
    with pytest.raises(ValueError, match="vocab_size 66 is not divisible by tp=4"):
        check_model(GPTConfig(vocab_size=66, block_size=16, n_layer=4, n_head=4, n_embd=32), tp=4)
    with pytest.raises(ValueError, match=r"n_layer 4 is not divisible by pp·v = 3·1 = 3"):
        check_model(ok, pp=3)
    with pytest.raises(ValueError, match=r"pp·v = 2·4 = 8"):
        check_model(ok, pp=2, virtual_stages=4)
    # (t | n_head implies t | n_embd and t | mlp_ratio·n_embd for GPTConfig's integer mlp_ratio)


# --- on 8 ranks: the torch process groups are the grid's ----------------------------------------


def _groups_on_ranks():
    me = dist.get_rank()
    out = {}
    for shape in SHAPES_8:
        grid = RankGrid(8, *shape)
        for use_mesh in (False, True):
            pg = init_groups(grid, use_device_mesh=use_mesh)
            got = {}
            for axis in (*AXES, "embedding"):
                group = pg.group(axis)
                if group is None:
                    got[axis] = None
                    continue
                t = torch.tensor([float(me), 1.0])
                with comm.meter() as m:
                    comm.all_reduce(t, group=group)
                got[axis] = {"ranks": dist.get_process_group_ranks(group), "group_rank": dist.get_rank(group),
                             "sum": t.tolist(), "meter_ranks": m.events[0].ranks}
            out[shape, use_mesh] = {"coords": tuple(pg.coords), "got": got, "ranks": pg.ranks}
    return out


def test_init_groups_makes_the_grids_groups_for_every_shape_of_8_ranks():
    results = launch(_groups_on_ranks, 8, timeout_s=300)
    for shape in SHAPES_8:
        grid = RankGrid(8, *shape)
        for use_mesh in (False, True):
            for r, res in enumerate(results):
                res = res[shape, use_mesh]
                assert res["coords"] == tuple(grid.coords(r))
                for axis in AXES:
                    want = grid.group_of(r, axis)
                    got = res["got"][axis]
                    assert got["ranks"] == want == res["ranks"][axis], (shape, use_mesh, axis, r)
                    assert got["group_rank"] == getattr(grid.coords(r), axis)
                    # the all-reduce really ran over exactly those ranks
                    assert got["sum"] == [float(sum(want)), float(len(want))]
                    assert got["meter_ranks"] == tuple(want)
                emb = next((x for x in grid.embedding_groups() if r in x), None)
                if emb is None:
                    assert res["got"]["embedding"] is None
                else:
                    assert res["got"]["embedding"]["ranks"] == emb
                    assert res["got"]["embedding"]["sum"] == [float(sum(emb)), 2.0]


def _wrong_world():
    init_groups(RankGrid(8, 2, 2, 2))


def test_init_groups_on_the_wrong_number_of_ranks_names_the_fix():
    with pytest.raises(RankError, match=r"the grid has 8 ranks but the job has 2"):
        launch(_wrong_world, 2, timeout_s=120)
    with pytest.raises(RuntimeError, match="inside a function run by launch"):
        init_groups(RankGrid(1, 1, 1, 1))
