"""The fused Conv2D -> GroupNorm -> SiLU/Mish op (kernels/conv.py, issue 6).

Unmarked tests run on whatever Device(0) is (the reference device here: the
kernels' float64 NumPy references, which mirror the GPU's partial-statistics
layout); ``gpu`` tests run the kernels on the H100 (the WGMMA conv
where C % 64 == 0, the CUTLASS 2.x conv otherwise).
Every result is held to ``conv_gn_act_reference`` (float64) on fresh random data.
"""
import json
from pathlib import Path

import numpy as np
import pytest

import deviceop as dop
from deviceop.kernels import conv
from deviceop.kernels.conv import ConvGnAct, conv_gn_act_reference

ROOT = Path(__file__).resolve().parent.parent


def errors(got, ref):
    got = got.astype(np.float64)
    return float(np.abs(got - ref).max()), float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2)))


def make_inputs(rng, n, h, w, c, k, r=3, y_dtype="float16", x_mean=0.0, bias_scale=1.0):
    x = (x_mean + rng.standard_normal((n, h, w, c))).astype(np.float16)
    wt = (rng.standard_normal((k, r, r, c)) / np.sqrt(r * r * c)).astype(np.float16)
    b = (bias_scale * rng.standard_normal(k)).astype(y_dtype)
    gamma = (1 + 0.2 * rng.standard_normal(k)).astype(np.float32)
    beta = (0.2 * rng.standard_normal(k)).astype(np.float32)
    return x, wt, b, gamma, beta


def replays_bit_identical(graph, out, stream, times=10):
    """Replay ``graph`` ``times`` times; every replay leaves the same bits in ``out``
    (fp16). Returns them."""
    first = None
    for _ in range(times):
        graph.replay()
        stream.synchronize()
        got = out.numpy().copy()
        first = got if first is None else first
        assert np.array_equal(got.view(np.uint16), first.view(np.uint16))
    return first


def run(stream, plan, host, out_dtype="float16"):
    t = lambda a: dop.from_numpy(a, stream=stream)  # noqa: E731
    out = dop.empty([plan.n, plan.h, plan.w, plan.k], out_dtype, stream=stream)
    plan(out, *map(t, host)).sync_on(stream)
    return out.numpy()


# The configurations the unmarked tests compile: one of each kernel family, both intermediate
# dtypes among them, seconds of NVRTC each.  conftest compiles them in a background process
# while the other modules run, and runs this module last.
_WG = conv.WGMMA_TILES["wg64x128"]
PRECOMPILE = [
    (conv.conv2d_gn_stats["float16"], conv.TILES["64x64"].generics("float16")),
    (conv.conv2d_params["float32"], conv.TILES["128x128"].generics("float32")),
    (conv.conv2d_gn_stats_wgmma["float16"], conv.WGMMA_TILES["wg128x160"].generics("float16", 2)),
    (conv.conv2d_gn_act_wgmma[("float16", "float16")], ["__half", "__half", _WG.tm, _WG.tn, _WG.stages, 1]),
    (conv.conv2d_gn_act_wgmma[("float16", "float32")], ["float", "__half", _WG.tm, _WG.tn, _WG.stages, 1]),
    *[(conv.gn_act_apply[("float16", "float16")], [conv.ACTS[act], "__half", "__half", pad])
      for act, pad in (("identity", 3), ("silu", 3), ("mish", 3), ("silu", 2))],
    (conv.gn_act_apply_inplace["float16"], [conv.ACTS["mish"], "__half", 3]),
    (conv.gn_act_apply_inplace["float32"], [conv.ACTS["mish"], "float", 3]),
]


# -- everywhere (reference device on CPU, the kernels on the GPU) -------------------------

SWEEP = pytest.mark.full_sweep   # each compiles a tile no other CPU test needs (seconds of NVRTC): gpu-check runs them


@pytest.mark.parametrize("shape,groups,r,tile,act,one_launch", [
    ((2, 9, 9, 16, 24), 4, 3, "64x64", "silu", False),        # tiles straddle images; 6-channel groups straddle nothing
    pytest.param((3, 17, 17, 96, 96), 8, 3, "128x64", "mish", False, marks=SWEEP),  # tiles straddle images and groups
    ((1, 8, 8, 32, 128), 32, 1, "64x64", "identity", False),  # 1x1
    pytest.param((2, 9, 9, 64, 200), 20, 3, "wg64x128", "silu", False, marks=SWEEP),  # the Hopper kernel: K=200
    ((2, 9, 9, 64, 200), 20, 3, "wg64x128", "mish", True),    # ... K=200 divides no tile, the whole op in one launch
])
def test_fused_op_matches_float64(stream, rng, shape, groups, r, tile, act, one_launch):
    n, h, w, c, k = shape
    plan = ConvGnAct(n, h, w, c, k, kernel_size=r, groups=groups, act=act, tile=tile, one_launch=one_launch,
                     stream=stream)
    assert plan.one_launch == one_launch
    host = make_inputs(rng, n, h, w, c, k, r)
    got = run(stream, plan, host)
    mx, rel = errors(got, conv_gn_act_reference(*host, groups, 1e-5, act))
    assert mx <= 1e-2 and rel <= 1e-3, (mx, rel)


def test_one_launch_writes_out_in_its_own_dtype(stream, rng):
    """The one-launch kernel writes ``out`` (OT), not y: declared InOut of the out dtype, an fp32
    output of an fp16 conv is accepted (declared as y, of the bias's dtype, it was refused)."""
    n, h, w, c, k, groups = 2, 9, 9, 64, 200, 20
    plan = ConvGnAct(n, h, w, c, k, groups=groups, act="mish", tile="wg64x128", one_launch=True, y_dtype="float16",
                     out_dtype="float32", stream=stream)
    host = make_inputs(rng, n, h, w, c, k)
    got = run(stream, plan, host, out_dtype="float32")
    assert got.dtype == np.float32
    mx, rel = errors(got, conv_gn_act_reference(*host, groups, 1e-5, "mish"))
    assert mx <= 1e-2 and rel <= 1e-3, (mx, rel)


def test_the_conv_output_is_written_so_it_may_not_be_its_input(stream, rng):
    """The conv writes y (declared InOut): the bare conv into its own input is an aliasing error
    (declared In, it was accepted and read x while overwriting it)."""
    n, h, w, c = 1, 8, 8, 16
    plan = ConvGnAct(n, h, w, c, c, groups=4, tile="64x64", stream=stream)
    x, wt, b = (dop.from_numpy(a, stream=stream) for a in make_inputs(rng, n, h, w, c, c)[:3])
    with pytest.raises(dop.AliasingError, match=r"conv2d_gn_stats<.*> writes y and reads x from overlapping"):
        plan._conv_launch(x, x, wt, b, 0).sync_on(stream)     # the declaration's check ...
    with pytest.raises(dop.AliasingError, match="y and x overlap"):
        plan.conv(x, x, wt, b)                                 # ... and the plan's, before it


def test_in_place_equals_out_of_place_in_a_graph(stream, rng):
    n, h, w, c, k, groups = 2, 9, 9, 16, 32, 8
    host = make_inputs(rng, n, h, w, c, k)
    t = lambda a: dop.from_numpy(a, stream=stream)  # noqa: E731
    args = list(map(t, host))
    a = dop.empty([n, h, w, k], "float16", stream=stream)
    b = dop.empty([n, h, w, k], "float16", stream=stream)
    out_of_place = ConvGnAct(n, h, w, c, k, groups=groups, act="mish", tile="64x64", stream=stream)
    in_place = ConvGnAct(n, h, w, c, k, groups=groups, act="mish", tile="64x64", inplace=True, stream=stream)
    graph = out_of_place(a, *args).graph_on(stream)          # captured once ...
    graph.replay()                                           # ... replayed
    in_place(b, *args).sync_on(stream)                       # eager
    stream.synchronize()
    assert np.array_equal(a.numpy(), b.numpy())
    mx, rel = errors(a.numpy(), conv_gn_act_reference(*host, groups, 1e-5, "mish"))
    assert mx <= 1e-2 and rel <= 1e-3, (mx, rel)


def test_scope_records_both_launches(stream, rng):
    n, h, w, c, k, groups = 1, 8, 8, 16, 16, 4
    host = make_inputs(rng, n, h, w, c, k)
    args = [dop.from_numpy(a, stream=stream) for a in host]
    out = dop.empty([n, h, w, k], "float16", stream=stream)
    plan = ConvGnAct(n, h, w, c, k, groups=groups, tile="64x64", stream=stream)
    graph = dop.CudaGraph.scope(stream, lambda s: s.record(plan(out, *args)))
    assert graph.summary()["nodes"] == 2
    graph.replay()
    stream.synchronize()
    mx, rel = errors(out.numpy(), conv_gn_act_reference(*host, groups, 1e-5, "silu"))
    assert mx <= 1e-2 and rel <= 1e-3


def test_building_the_op_runs_nothing(stream, rng):
    plan = ConvGnAct(1, 8, 8, 16, 16, groups=4, tile="64x64", stream=stream)
    args = [dop.from_numpy(a, stream=stream) for a in make_inputs(rng, 1, 8, 8, 16, 16)]
    out = dop.from_numpy(np.full((1, 8, 8, 16), 7, np.float16), stream=stream)
    launches = dop.op.stats["launches"] if hasattr(dop, "op") else None
    op = plan(out, *args)
    assert np.all(out.numpy() == 7)
    if launches is not None:
        assert dop.op.stats["launches"] == launches
    op.sync_on(stream)
    assert not np.all(out.numpy() == 7)


def test_hopper_runs_the_wgmma_kernel_where_it_applies():
    """On sm_90 (the reference device compiles for sm_90 too) a conv with C % 64 == 0
    gets conv_wgmma.cu; other channel counts and other GPUs get the CUTLASS 2.x conv."""
    unet = ConvGnAct(1, 64, 64, 320, 320, groups=32)
    assert unet.wgmma and (unet.tile.name, unet.split_k) == ("wg128x160", 2)
    assert not unet.one_launch                      # conv, then apply: as fast as one launch, and any N
    one = ConvGnAct(1, 64, 64, 320, 320, groups=32, one_launch=True)
    assert one.one_launch and one.y is None        # 128 CTAs fit the 132 SMs at once: no y buffer at all
    assert not ConvGnAct(3, 17, 17, 96, 96, groups=32).wgmma        # C=96: not a multiple of 64
    assert "not a multiple of 64" in conv.wgmma_fits("sm_90", 1, 8, 8, 96, 96)
    assert "needs sm_90" in conv.wgmma_fits("sm_80", 1, 64, 64, 320, 320)   # an A100: CUTLASS


def test_tma_loads_x_where_a_tile_is_whole_image_rows():
    """TMA reads a tile's A as one box of x: whole image rows (W divides the tile's
    128 rows) or a run of one row (W a multiple of them); elsewhere every thread
    gathers its pieces with cp.async.  w always comes by TMA."""
    for hw in (64, 32, 16):                                          # the U-Net shapes
        assert ConvGnAct(1, hw, hw, 320, 320, groups=32).loads == 2
    assert ConvGnAct(1, 4, 256, 64, 64, groups=32, tile="wg128x128").loads == 2      # 2 tiles per image row
    assert conv.WGMMA_TILES["wg128x128"].a_box(32, 32) == (4, 32)
    assert conv.WGMMA_TILES["wg128x128"].a_box(4, 256) == (1, 128)
    assert ConvGnAct(2, 9, 9, 64, 200, groups=20, tile="wg64x128").loads == 1        # 9 divides no tile
    assert ConvGnAct(1, 64, 64, 320, 320, groups=32, a_tma=False).loads == 1
    with pytest.raises(dop.ShapeError, match="a_tma=True: TMA loads"):
        ConvGnAct(2, 9, 9, 64, 200, groups=20, tile="wg64x128", a_tma=True)
    with pytest.raises(dop.LaunchError, match="a_tma=True needs the WGMMA kernel"):
        ConvGnAct(1, 16, 16, 96, 96, groups=32, a_tma=True)


def test_a_tensor_map_refuses_what_tma_cannot_do():
    from deviceop.runtime.tma import tensor_map
    with pytest.raises(dop.LaunchError, match="16-byte aligned"):
        tensor_map("float16", 0x1008, [64, 576], [128, 64])
    with pytest.raises(dop.LaunchError, match="fit the 128-byte swizzle"):
        tensor_map("float16", 0x1000, [64, 576], [64, 128])
    with pytest.raises(dop.LaunchError, match="1-5 dimensions"):
        tensor_map("float16", 0x1000, [64, 576], [64])


def test_wgmma_heuristic_picks_the_fastest_configuration_of_the_recorded_h100_sweep():
    """The WGMMA cost model was fitted to this sweep (every tile x split-K 1-8 x
    split fix-up, cluster or workspace, of the shipped menu at the six N<=2 U-Net
    problems, bare conv as graph replays), with the cluster capacity the H100
    reported in the same run."""
    recorded = json.loads((ROOT / "bench" / "results" / "conv_gn_act_wgmma_sweep.json").read_text())
    sweep, clusters = recorded["tile_sweep"], {int(s): n for s, n in recorded["cluster_capacity"].items()}
    problems = sorted({(r["C"], r["HW"], r["N"]) for r in sweep})
    assert len(problems) == 6 and {r["tile"] for r in sweep} == set(conv.WGMMA_TILES)
    assert {r["split_fixup"] for r in sweep if r["split_k"] > 1} == set(conv.SPLIT_FIXUPS)
    for c, hw, n in problems:
        runs = [r for r in sweep if (r["C"], r["HW"], r["N"]) == (c, hw, n) and "bare_conv_us" in r]
        fastest = min(runs, key=lambda r: r["bare_conv_us"])
        assert conv.choose_wgmma_tile(n, hw, hw, c, c, clusters=clusters) == \
            (fastest["tile"], fastest["split_k"], fastest["split_fixup"]), (c, hw, n)


def test_split_k_meets_in_the_workspace_where_its_clusters_would_not_fit_at_once():
    """C=1280 16x16 N=2 is 32 tiles of 128x160.  The H100 holds 30 clusters of 4, so 4
    slices in clusters would run in two rounds; through the global workspace they fit
    in one.  With clusters packed ideally (33 of 4) the cluster wins the same split."""
    h100 = {1: 132, 2: 66, 3: 39, 4: 30, 5: 22, 6: 17, 7: 15, 8: 15}
    assert conv.choose_wgmma_tile(2, 16, 16, 1280, 1280, clusters=h100) == ("wg128x160", 4, "workspace")
    assert conv.choose_wgmma_tile(1, 16, 16, 1280, 1280, clusters=h100) == ("wg128x160", 6, "cluster")
    ideal = conv.ideal_cluster_capacity(132)
    assert conv.choose_wgmma_tile(2, 16, 16, 1280, 1280, clusters=ideal)[2] == "cluster"
    cost = lambda f, caps: conv.wgmma_cost_us(2, 16, 16, 1280, 1280, "wg128x160", 4, f, clusters=caps)  # noqa: E731
    assert cost("cluster", h100) > 1.5 * cost("workspace", h100)     # two rounds against one
    assert cost("cluster", ideal) < cost("workspace", ideal)
    with pytest.raises(dop.LaunchError, match="a split tile adds up in a 'cluster' or the 'workspace'"):
        conv.wgmma_cost_us(2, 16, 16, 1280, 1280, "wg128x160", 4, "dsmem")
    with pytest.raises(dop.LaunchError, match="an unsplit one needs neither"):
        conv.wgmma_cost_us(2, 16, 16, 1280, 1280, "wg128x160", 1, "cluster")
    with pytest.raises(dop.LaunchError, match="is not a WGMMA tile"):
        conv.wgmma_cost_us(2, 16, 16, 1280, 1280, "128x128", 1, None)


def test_apply_ctas_wait_beside_the_conv_where_they_all_fit():
    """The apply kernel's CTAs start (PDL) on the SMs the conv leaves and wait there.
    3 a SM where that lets all of them wait before the conv ends and 2 would not
    (C=1280 16x16 N=2: 4 slices through the workspace leave 100 SMs to 256 CTAs);
    else 2, fewer packed on the SMs that free first (N=1: 6 slices in clusters, 96
    SMs busy to the end; C=320 64x64 N=2: 128 busy)."""
    assert conv.apply_ctas_per_sm(apply_ctas=256, sms=132, busy_sms=32) == 3
    assert conv.apply_ctas_per_sm(apply_ctas=128, sms=132, busy_sms=96) == 2
    assert conv.apply_ctas_per_sm(apply_ctas=256, sms=132, busy_sms=128) == 2
    assert conv.apply_ctas_per_sm(apply_ctas=64, sms=132, busy_sms=32) == 2    # 2 a SM hold them all already
    plan = ConvGnAct(2, 16, 16, 1280, 1280, tile="wg128x160", split_k=4, split_fixup="workspace")
    assert (plan.n * plan.chunks, plan.mt * plan.nt, plan.apply_ctas) == (256, 32, 3)
    assert ConvGnAct(2, 16, 16, 1280, 1280, tile="wg128x160", split_k=4, split_fixup="cluster").apply_ctas == 2
    assert ConvGnAct(2, 16, 16, 96, 96, groups=8).apply_ctas == 3    # the CUTLASS conv: no padding off Hopper
    assert conv.gn_act_apply[("float16", "float16")].config((2, 128), (1, "__half", "__half", 2)).shared_mem == 48 << 10
    with pytest.raises(dop.LaunchError, match=r"CTAS generic is the CTAs an SM may hold, one of \[2, 3\]; got 4"):
        conv.gn_act_apply[("float16", "float16")].config((2, 128), (1, "__half", "__half", 4))


def test_the_split_fixup_is_recorded_in_the_plan_and_refused_where_it_has_no_meaning(stream, rng):
    n, h, w, c, k, groups = 2, 16, 16, 64, 200, 20
    for fixup in conv.SPLIT_FIXUPS:   # either way the same results (the reference device: the same arithmetic)
        plan = ConvGnAct(n, h, w, c, k, groups=groups, tile="wg128x160", split_k=3, split_fixup=fixup, stream=stream)
        assert plan.split_fixup == fixup and f"split_k=3 in a {fixup}" in repr(plan)
        host = make_inputs(rng, n, h, w, c, k)
        mx, rel = errors(run(stream, plan, host), conv_gn_act_reference(*host, groups, 1e-5, "silu"))
        assert mx <= 1e-2 and rel <= 1e-3, (fixup, mx, rel)
    assert ConvGnAct(n, h, w, c, k, groups=groups, tile="wg128x160", split_k=1, stream=stream).split_fixup is None
    assert ConvGnAct(n, h, w, c, k, groups=groups, tile="wg128x160", split_k=2, one_launch=True,
                     stream=stream).split_fixup == "workspace"     # cooperative: no clusters
    with pytest.raises(dop.LaunchError, match="split_fixup='dsmem' is not one of"):
        ConvGnAct(n, h, w, c, k, groups=groups, split_fixup="dsmem", stream=stream)
    with pytest.raises(dop.LaunchError, match="split_k > 1"):
        ConvGnAct(n, h, w, c, k, groups=groups, tile="wg128x160", split_k=1, split_fixup="cluster", stream=stream)
    with pytest.raises(dop.LaunchError, match="the WGMMA two-launch conv"):
        ConvGnAct(n, h, w, c, k, groups=groups, tile="64x64", split_k=2, split_fixup="workspace", stream=stream)
    with pytest.raises(dop.LaunchError, match="one_launch=True"):
        ConvGnAct(n, h, w, c, k, groups=groups, tile="wg128x160", split_k=2, split_fixup="cluster",
                  one_launch=True, stream=stream)


def test_the_split_k_workspace_is_sized_by_the_declaration(stream, rng):
    """Slices meeting in the global workspace write a fp32 tile each: the declaration's shape
    says partials' length (tiles x slices x TM*TN), so a short one is refused, not overrun."""
    n, h, w, c, k, groups = 2, 16, 16, 64, 200, 20
    plan = ConvGnAct(n, h, w, c, k, groups=groups, tile="wg128x160", split_k=3, split_fixup="workspace", stream=stream)
    need = plan.mt * plan.nt * 3 * 128 * 160
    assert plan.partials.shape == (need,)
    plan.partials = dop.empty([need - 128 * 160], stream=stream)   # one slice's tile short
    host = [dop.from_numpy(a, stream=stream) for a in make_inputs(rng, n, h, w, c, k)]
    with pytest.raises(dop.ShapeError, match=rf"argument partials has shape \[{need - 128 * 160}\], but its axis 0 "
                                             rf"is \(\(n\*h\*wd\+TM-1\)//TM\)\*\(\(k\+TN-1\)//TN\)\*SK\*TM\*TN .* "
                                             rf"= {need} .*; pass a partials of shape \[{need}\]"):
        plan(dop.empty([n, h, w, k], "float16", stream=stream), *host).sync_on(stream)


def test_heuristic_fills_the_sms_at_n1():
    """At N=1 the pick puts work on at least 90 % of the 132 SMs: not always all of
    them, because measured on the H100, C=1280 at 16x16 runs fastest as 120 CTAs of
    128x64 split 3 (42.6 us), ahead of 320 CTAs of 64x64 split 4 (48.0 us)."""
    for c, hw in ((320, 64), (640, 32), (1280, 16)):
        name, split = conv.choose_tile(1, hw, hw, c, c, 3, 132)
        ctas = conv.tile_count(hw * hw, c, conv.TILES[name], split)
        assert ctas >= 0.9 * 132, (c, hw, name, split, ctas)


def test_heuristic_picks_the_fastest_configuration_of_the_recorded_h100_sweep():
    """The cost model was fitted to this sweep (every tile x split-K, timed on the
    H100): for each of its problems it must pick the measured fastest bare conv."""
    sweep = json.loads((ROOT / "bench" / "results" / "conv_gn_act_tile_sweep.json").read_text())["tile_sweep"]
    problems = sorted({(r["C"], r["HW"], r["N"]) for r in sweep})
    assert len(problems) == 6 and len(sweep) == 6 * len(conv.TILES) * conv.MAX_SPLIT_K
    for c, hw, n in problems:
        runs = [r for r in sweep if (r["C"], r["HW"], r["N"]) == (c, hw, n)]
        fastest = min(runs, key=lambda r: r["bare_conv_us"])
        assert conv.choose_tile(n, hw, hw, c, c) == (fastest["tile"], fastest["split_k"]), (c, hw, n)


# -- bad input: clear errors before anything runs --------------------------------------------

def test_bad_inputs_are_refused_with_the_fix(stream, rng):
    n, h, w, c, k = 1, 8, 8, 16, 16
    plan = ConvGnAct(n, h, w, c, k, groups=4, tile="64x64", stream=stream)
    x, wt, b, ga, be = (dop.from_numpy(a, stream=stream) for a in make_inputs(rng, n, h, w, c, k))
    out = dop.empty([n, h, w, k], "float16", stream=stream)
    nchw = dop.from_numpy(np.zeros((n, c, h, w), np.float16), stream=stream)
    with pytest.raises(dop.ShapeError, match="looks NCHW"):
        plan(out, nchw, wt, b, ga, be)
    kcrs = dop.from_numpy(np.zeros((k, c, 3, 3), np.float16), stream=stream)
    with pytest.raises(dop.ShapeError, match="looks KCRS"):
        plan(out, x, kcrs, b, ga, be)
    with pytest.raises(dop.DTypeError, match="x must be float16"):
        plan(out, dop.from_numpy(np.zeros((n, h, w, c), np.float32), stream=stream), wt, b, ga, be)
    with pytest.raises(dop.DTypeError, match="gamma must be float32"):
        plan(out, x, wt, b, dop.from_numpy(np.ones(k, np.float16), stream=stream), be)
    big = dop.empty([n * h * w * c + 8], "float16", stream=stream)
    shifted = big[1:n * h * w * c + 1].view([n, h, w, c])      # 2 bytes past a 16-byte boundary
    with pytest.raises(dop.ShapeError, match="16-byte aligned"):
        plan(out, shifted, wt, b, ga, be)
    with pytest.raises(dop.ShapeError, match="divide into groups"):
        ConvGnAct(n, h, w, c, 24, groups=5, stream=stream)
    with pytest.raises(dop.ShapeError, match="multiples of 8"):
        ConvGnAct(n, h, w, 12, k, groups=4, stream=stream)
    with pytest.raises(dop.ShapeError, match="no tile configuration fits"):
        ConvGnAct(1, 4, 4, 16, 16, groups=4, stream=stream)
    with pytest.raises(dop.ShapeError, match="needs H\\*W >= 128"):
        ConvGnAct(1, 8, 8, 16, 16, groups=4, tile="128x128", stream=stream)
    with pytest.raises(dop.ShapeError, match="not a multiple of 64"):
        ConvGnAct(1, 16, 16, 96, 96, groups=4, tile="wg128x128", stream=stream)
    with pytest.raises(dop.LaunchError, match="one_launch=True needs the WGMMA kernel"):
        ConvGnAct(1, 16, 16, 96, 96, groups=4, one_launch=True, stream=stream)       # C=96: CUTLASS, two launches
    with pytest.raises(dop.LaunchError, match="a grid the GPU holds at once"):
        ConvGnAct(8, 64, 64, 320, 320, groups=32, one_launch=True, stream=stream)    # 512 CTAs
    with pytest.raises(dop.ShapeError, match="only 3x3"):
        ConvGnAct(n, h, w, c, k, kernel_size=5, groups=4, stream=stream)
    with pytest.raises(dop.LaunchError, match="act="):
        ConvGnAct(n, h, w, c, k, groups=4, act="relu", stream=stream)
    with pytest.raises(dop.AliasingError):
        plan(x.view([n, h, w, c]), x, wt, b, ga, be)


# -- NVRTC: every shipped configuration compiles for sm_90 (CPU CI too) -------------------------

def test_one_configuration_of_each_conv_kernel_compiles_for_sm90():
    """Each kernel family once, both intermediate dtypes among them (PRECOMPILE): the
    configurations the tests above run, so a whole run compiles little more (the
    sweep below compiles all 84 and takes minutes on two cores)."""
    for kern, gen in PRECOMPILE:
        program, expr = kern.compile(gen, arch="sm_90")
        assert program.cubin[:4] == b"\x7fELF" and program.symbol(expr).startswith("_Z"), expr


@pytest.mark.full_sweep
def test_every_shipped_configuration_compiles_for_sm90():
    built = conv.compile_all("sm_90")
    wgmma = len(conv.WGMMA_TILES) * 2 * 3   # per load path (A by TMA or cp.async): conv, one-launch per out dtype
    apply = len(conv.ACTS) * len(conv.APPLY_PAD_BYTES) * 3   # per y dtype: in place, out to fp16, out to fp32
    assert len(built) == 2 * wgmma + 2 * len(conv.TILES) * 2 + 2 * apply
    assert any("conv2d_gn_act_wgmma<__half, __half, 128, 160, 4, 2>" in b for b in built)
    assert any("conv2d_gn_stats_wgmma<__half, 128, 160" in b for b in built)
    assert any("128, 128" in b for b in built) and any("gn_act_apply_inplace" in b for b in built)
    assert any("gn_act_apply<1, __half, __half, 2>" in b for b in built)


def test_the_wgmma_kernel_refuses_other_gpus():
    with pytest.raises(dop.ArchError, match="runs on sm_90 only"):
        conv.conv2d_gn_stats_wgmma["float16"].compile(conv.WGMMA_TILES["wg128x128"].generics("float16"), arch="sm_80")


def test_missing_cutlass_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(conv.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(dop.CompileError, match="pip install --no-deps 'nvidia-cutlass"):
        conv.cutlass_include_dir()


# -- the H100 -----------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("tile,split", [(t, s) for t in conv.TILES for s in (1, 3)])
def test_every_tile_and_split_k_on_the_gpu(stream, rng, tile, split):
    n, h, w, c, k, groups = 2, 16, 16, 64, 200, 20      # K=200 divides no tile width
    plan = ConvGnAct(n, h, w, c, k, groups=groups, act="silu", tile=tile, split_k=split, stream=stream)
    host = make_inputs(rng, n, h, w, c, k)
    mx, rel = errors(run(stream, plan, host), conv_gn_act_reference(*host, groups, 1e-5, "silu"))
    assert mx <= 1e-2 and rel <= 1e-3, (mx, rel)
    size_params, size_smem = plan.blob_sizes
    assert size_params <= conv.BLOB_BYTES - 8
    assert size_smem == plan.tile.shared_bytes()  # the host's formula is CUTLASS's sizeof(SharedStorage)


@pytest.mark.gpu
@pytest.mark.parametrize("tile,split,a_tma,y_dtype,one_launch",
                         [(t, s, a, "float16", False) for t in conv.WGMMA_TILES for s in (1, 3) for a in (True, False)]
                         + [(t, s, a, "float16", True) for t in conv.WGMMA_TILES for s in (1, 3) for a in (None, False)]
                         + [("wg128x160", 2, None, "float32", False), ("wg128x160", 2, None, "float32", True)])
def test_every_wgmma_tile_split_k_and_load_path_on_the_gpu(stream, rng, tile, split, a_tma, y_dtype, one_launch):
    n, h, w, c, k, groups = 2, 16, 16, 64, 200, 20      # K=200 divides no tile width
    plan = ConvGnAct(n, h, w, c, k, groups=groups, act="silu", tile=tile, split_k=split, a_tma=a_tma,
                     y_dtype=y_dtype, out_dtype=y_dtype, one_launch=one_launch, stream=stream)
    assert plan.loads == (1 if a_tma is False else 2)
    host = make_inputs(rng, n, h, w, c, k, y_dtype=y_dtype)
    mx, rel = errors(run(stream, plan, host, y_dtype), conv_gn_act_reference(*host, groups, 1e-5, "silu"))
    assert mx <= 1e-2 and rel <= 1e-3, (mx, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("n,h,w", [(3, 16, 16), (3, 12, 16)])   # A by TMA; A by cp.async with M = 4.5 tiles
@pytest.mark.parametrize("split", range(2, 9))
@pytest.mark.parametrize("fixup", conv.SPLIT_FIXUPS)
def test_split_k_slices_add_up_in_their_cluster_or_the_workspace(stream, rng, n, h, w, split, fixup):
    """In a cluster, a split-K tile is `split` CTAs: each slice takes ceil(128 / split)
    rows of the tile (the last fewer, or none), adds them over every slice's shared
    memory and runs the epilogue on them; the last slice merges the GroupNorm partials.
    Through the workspace (no cluster), the last slice to arrive adds every slice's
    tile and runs the whole epilogue."""
    c, k, groups = 128, 160, 20
    plan = ConvGnAct(n, h, w, c, k, groups=groups, act="silu", tile="wg128x160", split_k=split, split_fixup=fixup,
                     stream=stream)
    assert plan.loads == (2 if h * w % 128 == 0 else 1)
    kernel = (conv.conv2d_gn_stats_wgmma if fixup == "cluster" else conv.conv2d_gn_stats_wgmma_workspace)["float16"]
    generics = tuple(plan.tile.generics("float16", plan.loads))
    assert kernel.config((plan.mt, plan.nt, split), generics).cluster == ((1, 1, split) if fixup == "cluster" else None)
    host = make_inputs(rng, n, h, w, c, k)
    mx, rel = errors(run(stream, plan, host), conv_gn_act_reference(*host, groups, 1e-5, "silu"))
    assert mx <= 1e-2 and rel <= 1e-3, (mx, rel)


@pytest.mark.gpu
def test_cluster_capacity_is_what_the_gpu_holds(stream):
    """The cost model counts rounds of clusters against what the driver says the GPU
    keeps resident: never more CTAs than SMs, and whole GPCs can leave SMs over."""
    dev = stream.device
    caps = conv.cluster_capacity(dev)
    assert caps[1] == dev.sm_count
    for s in range(2, conv.WGMMA_MAX_SPLIT_K + 1):
        assert 1 <= caps[s] <= dev.sm_count // s, (s, caps[s])


@pytest.mark.gpu
def test_the_tensor_maps_follow_x_and_w(stream, rng):
    """The WGMMA kernel reads x and w through TMA tensor maps it patches on the
    device (conv_wgmma.cu, tensor_map): one plan called with one (x, w), another,
    then the first again gives each one's result; and 32x32 images (W=32: a tile
    is 4 image rows) whose border taps read the box's out-of-bounds zeros."""
    n, h, w, c, k, groups = 1, 32, 32, 64, 128, 16
    plan = ConvGnAct(n, h, w, c, k, groups=groups, tile="wg128x128", stream=stream)
    assert plan.loads == 2
    x1, w1, b, ga, be = make_inputs(rng, n, h, w, c, k)
    x2, w2, _, _, _ = make_inputs(rng, n, h, w, c, k, x_mean=0.5)
    dev = {name: dop.from_numpy(a, stream=stream) for name, a in (("x1", x1), ("x2", x2), ("w1", w1), ("w2", w2),
                                                                    ("b", b), ("ga", ga), ("be", be))}
    out = dop.empty([n, h, w, k], "float16", stream=stream)
    for xs, ws, hx, hw_ in (("x1", "w1", x1, w1), ("x2", "w2", x2, w2), ("x1", "w2", x1, w2), ("x1", "w1", x1, w1)):
        plan(out, dev[xs], dev[ws], dev["b"], dev["ga"], dev["be"]).sync_on(stream)
        mx, rel = errors(out.numpy(), conv_gn_act_reference(hx, hw_, b, ga, be, groups, 1e-5, "silu"))
        assert mx <= 1e-2 and rel <= 1e-3, (xs, ws, mx, rel)


@pytest.mark.gpu
def test_one_launch_replays_and_matches_two_launches(stream, rng):
    """The cooperative one-launch op in a graph: its grid barrier resets itself, so
    replay after replay gives the same bits; and it agrees with the two-launch op."""
    n, h, w, c, k, groups = 1, 32, 32, 320, 320, 32
    args = [dop.from_numpy(a, stream=stream) for a in make_inputs(rng, n, h, w, c, k)]
    one = ConvGnAct(n, h, w, c, k, groups=groups, act="mish", one_launch=True, stream=stream)
    two = ConvGnAct(n, h, w, c, k, groups=groups, act="mish", stream=stream)
    assert one.one_launch and not two.one_launch
    out1, out2 = (dop.empty([n, h, w, k], "float16", stream=stream) for _ in range(2))
    first = replays_bit_identical(one(out1, *args).graph_on(stream), out1, stream)
    two(out2, *args).sync_on(stream)
    assert np.abs(first.astype(np.float32) - out2.numpy().astype(np.float32)).max() < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["identity", "silu", "mish"])
def test_odd_shape_c96_hw17_n3(stream, rng, act):
    n, h, w, c, k, groups = 3, 17, 17, 96, 96, 32
    plan = ConvGnAct(n, h, w, c, k, groups=groups, act=act, stream=stream)
    host = make_inputs(rng, n, h, w, c, k)
    mx, rel = errors(run(stream, plan, host), conv_gn_act_reference(*host, groups, 1e-5, act))
    assert mx <= 1e-2 and rel <= 1e-3, (plan, mx, rel)


@pytest.mark.gpu
def test_large_mean_input(stream, rng):
    """x with mean/std = 100: the conv output's channels sit far apart; fp16 y is enough."""
    n, h, w, c, k, groups = 1, 32, 32, 64, 64, 16
    plan = ConvGnAct(n, h, w, c, k, groups=groups, stream=stream)
    host = make_inputs(rng, n, h, w, c, k, x_mean=100.0)
    mx, rel = errors(run(stream, plan, host), conv_gn_act_reference(*host, groups, 1e-5, "silu"))
    assert mx <= 1e-2 and rel <= 1e-3, (mx, rel)


@pytest.mark.gpu
def test_large_mean_groups_need_the_fp32_intermediate(stream, rng):
    """Groups whose mean is 100x their std (a bias of 100): statistics stay exact
    (shifted sums, Chan merge), and an fp32 y keeps 1e-2 after normalization."""
    n, h, w, c, k, groups = 2, 16, 16, 32, 64, 8
    x, wt, _, ga, be = make_inputs(rng, n, h, w, c, k, y_dtype="float32")
    b = np.full(k, 100.0, np.float32)
    host = (x, wt, b, ga, be)
    plan = ConvGnAct(n, h, w, c, k, groups=groups, y_dtype="float32", out_dtype="float32", stream=stream)
    mx, rel = errors(run(stream, plan, host, "float32"), conv_gn_act_reference(*host, groups, 1e-5, "silu"))
    assert mx <= 1e-2 and rel <= 1e-3, (mx, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("c", [32, 64])   # the CUTLASS conv, the WGMMA conv
def test_zero_variance_groups(stream, rng, c):
    """Groups whose output is constant (zero weights, constant bias): normalized to beta, no NaN."""
    n, h, w, k, groups = 1, 16, 16, 64, 8
    x, wt, b, ga, be = make_inputs(rng, n, h, w, c, k)
    wt[:16] = 0                                    # groups 0 and 1: y = bias, constant per channel ...
    b[:16] = 3.0                                   # ... and the same for the whole group
    host = (x, wt, b, ga, be)
    plan = ConvGnAct(n, h, w, c, k, groups=groups, act="identity", stream=stream)
    got = run(stream, plan, host)
    assert np.all(np.isfinite(got))
    mx, rel = errors(got, conv_gn_act_reference(*host, groups, 1e-5, "identity"))
    assert mx <= 1e-2 and rel <= 1e-3, (mx, rel)


@pytest.mark.gpu
@pytest.mark.parametrize("tile,split,fixup", [("64x64", 2, None), ("wg128x128", 3, "cluster"),
                                              ("wg128x128", 3, "workspace")])
def test_deterministic_over_ten_runs(stream, rng, tile, split, fixup):
    """Split-K included: CUTLASS's serial slices, and the WGMMA kernel's slices summed
    in slice order within their cluster or by the last to arrive at the workspace."""
    n, h, w, c, k, groups = 2, 32, 32, 64, 128, 32
    plan = ConvGnAct(n, h, w, c, k, groups=groups, act="mish", tile=tile, split_k=split, split_fixup=fixup,
                     stream=stream)
    args = [dop.from_numpy(a, stream=stream) for a in make_inputs(rng, n, h, w, c, k)]
    out = dop.empty([n, h, w, k], "float16", stream=stream)
    replays_bit_identical(plan(out, *args).graph_on(stream), out, stream)


@pytest.mark.gpu
@pytest.mark.parametrize("apply_ctas", [2, 3])
def test_groups_of_many_partials_merge_in_chunks(stream, rng, apply_ctas):
    """64x64 pixels in tiles of 128 (or 64) rows: every group has 32-64 partials, more
    than a lane's first chunk (GroupPartials::kOwn), so the chunks merge pairwise;
    the same bits replay after replay, with the apply kernel at 2 or 3 CTAs a SM."""
    n, h, w, c, k, groups = 1, 64, 64, 64, 64, 8
    plan = ConvGnAct(n, h, w, c, k, groups=groups, act="silu", stream=stream)
    plan.apply_ctas = apply_ctas
    host = make_inputs(rng, n, h, w, c, k)
    args = [dop.from_numpy(a, stream=stream) for a in host]
    out = dop.empty([n, h, w, k], "float16", stream=stream)
    got = replays_bit_identical(plan(out, *args).graph_on(stream), out, stream)
    mx, rel = errors(got, conv_gn_act_reference(*host, groups, 1e-5, "silu"))
    assert mx <= 1e-2 and rel <= 1e-3, (plan, mx, rel)


@pytest.mark.gpu
def test_against_torch_fp32(stream, rng):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    n, h, w, c, k, groups = 1, 32, 32, 320, 320, 32
    x, wt, b, ga, be = make_inputs(rng, n, h, w, c, k)
    plan = ConvGnAct(n, h, w, c, k, groups=groups, act="mish", stream=stream)
    got = run(stream, plan, (x, wt, b, ga, be)).astype(np.float32)
    tx = torch.from_numpy(x).cuda().float().permute(0, 3, 1, 2)
    tw = torch.from_numpy(wt).cuda().float().permute(0, 3, 1, 2)
    ref = F.mish(F.group_norm(F.conv2d(tx, tw, torch.from_numpy(b).cuda().float(), padding=1), groups,
                              torch.from_numpy(ga).cuda(), torch.from_numpy(be).cuda(), 1e-5))
    ref = ref.permute(0, 2, 3, 1).cpu().numpy().astype(np.float64)
    mx, rel = errors(got, ref)
    assert mx <= 1e-2 and rel <= 1e-3, (mx, rel)


def test_without_a_gpu_the_cost_model_assumes_ideal_cluster_packing():
    """The reference device has no GPCs to ask about: clusters of s CTAs pack SMs // s."""
    from deviceop.runtime import ReferenceDevice
    caps = conv.cluster_capacity(ReferenceDevice())
    assert caps == conv.ideal_cluster_capacity(132) and caps[4] == 33 and caps[8] == 16


def test_plan_arguments_of_the_wrong_kind_or_range_are_refused_naming_them(stream):
    """A size that is not an int (None, "1", 3.0, True == 1), an eps that is 0, negative, NaN,
    inf or 0 in float32, an act/tile that is not a string, split_k=0, a stream that is not a
    Stream, a flag that is not a bool: each a deviceop error naming the argument (they were raw
    TypeError/AttributeError, or accepted: eps=0 normalizes a constant group to NaN,
    kernel_size=True ran as 1x1, one_launch="no" ran one launch, split_k=0 ran as 1)."""
    plan = lambda **kw: ConvGnAct(**{**dict(n=1, h=8, w=8, c=16, k=16, groups=4, stream=stream), **kw})  # noqa: E731
    for name, bad in (("n", None), ("n", "1"), ("h", 8.0), ("groups", None), ("kernel_size", True),
                      ("kernel_size", 3.0)):
        with pytest.raises(dop.ShapeError, match=f"{name}=.* must be an int"):
            plan(**{name: bad})
    for eps in (0.0, -1e-5, float("nan"), float("inf"), 1e-50):
        with pytest.raises(dop.ShapeError, match="eps=.* must be positive and finite in float32"):
            plan(eps=eps)
    with pytest.raises(dop.ShapeError, match="must be a number"):
        plan(eps=None)
    for name, bad in (("act", ["silu"]), ("tile", ["64x64"]), ("one_launch", "no"), ("inplace", 1),
                      ("a_tma", "yes"), ("split_k", 0), ("split_k", "2"), ("stream", "s")):
        with pytest.raises(dop.LaunchError, match=f"{name}="):
            plan(**{name: bad})
    assert plan(n=np.int64(1), eps=1e-6).n == 1          # NumPy ints are ints


def test_the_bare_conv_checks_its_operands_against_the_plan(stream, rng):
    """plan.conv(y, x, w, bias): x and w of another channel count (the plan's CUTLASS Params
    were built for its own) are refused naming x; y of None is a LaunchError (they were
    accepted, and an AttributeError)."""
    n, h, w, c, k = 1, 8, 8, 16, 16
    plan = ConvGnAct(n, h, w, c, k, groups=4, tile="64x64", stream=stream)
    y = dop.empty([n, h, w, k], "float16", stream=stream)
    x2, w2, b = (dop.from_numpy(a, stream=stream) for a in make_inputs(rng, n, h, w, c + 8, k)[:3])
    with pytest.raises(dop.ShapeError, match=r"x must be NHWC \[1, 8, 8, 16\]"):
        plan.conv(y, x2, w2, b)
    with pytest.raises(dop.LaunchError, match="y must be a deviceop Tensor"):
        plan.conv(None, x2, w2, b)
