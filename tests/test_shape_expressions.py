"""Shape expressions: arithmetic on generics and sizes in ``shape=`` and ``tile=``
(``HQ*HD``, ``2*C+4``, ``HD//2``), int scalars named by shapes, what the arguments
determine, and the errors of each, which name the parameter, the expression, the
values and the fix.  Runs on Device(0): the references here, the CUDA on the H100."""
import numpy as np
import pytest

import deviceop as dop
from deviceop import In, InOut, Kernel, Out, Scalar
from deviceop.kernel import plan as plan_module
from deviceop.kernel.shapes import Expr, parse

# q = w @ x, split into HQ heads of HD: one block a head; rope-like table of HD/2
HEADS = r"""
template <int HQ, int HD>
__global__ void heads(float* q, const float* x, const float* w, const float* table, int k) {
    int row = blockIdx.x * HD + threadIdx.x;
    float acc = 0.0f;
    for (int i = 0; i < k; i++) acc += w[row * k + i] * x[i];
    q[row] = acc + table[threadIdx.x % (HD / 2)];
}
"""


def _heads_ref(g, q, x, w, table, k):
    q[...] = w.astype(np.float64) @ x.astype(np.float64) + np.tile(table, 2 * g["HQ"])


heads = Kernel(
    "heads", HEADS,
    [Out("q", "float32", shape=("HQ*HD",), tile=("HD",)), In("x", "float32", shape=("k",)),
     In("w", "float32", shape=("HQ * HD", "k")), In("table", "float32", shape=("HD//2",)), Scalar("k", "int32")],
    generics=["HQ", "HD"], block="HD", reference=_heads_ref)

# part [B, 2C+4] tile [1, 2C+4]: C is solved from the tile, B bound by the shape
PARTS = r"""
template <int C>
__global__ void parts(float* part, const float* x) {
    int row = blockIdx.x, i = threadIdx.x;
    if (i < 2 * C + 4) part[row * (2 * C + 4) + i] = x[row] + i;
}
"""


def _parts_ref(g, part, x):
    part[...] = x[:, None] + np.arange(part.shape[1])


parts = Kernel("parts", PARTS, [Out("part", "float32", shape=("B", "2*C+4"), tile=(1, "2*C+4")),
                                In("x", "float32", shape=("B",))],
               generics=["C"], block=128, reference=_parts_ref)


def put(rng, shape, stream):
    return dop.from_numpy(rng.standard_normal(shape).astype(np.float32), stream=stream)


def _heads_args(rng, stream, hq=3, hd=8, k=16, **over):
    a = dict(q=dop.empty([hq * hd], stream=stream), x=put(rng, k, stream), w=put(rng, (hq * hd, k), stream),
             table=put(rng, hd // 2, stream), k=k, tile=hd)
    a.update(over)
    return a


def _heads(a):
    return heads(a["q"].partition([a["tile"]]), a["x"], a["w"], a["table"], a["k"])


def test_expressions_in_shapes_and_tiles_check_a_launch_and_infer_its_generics(stream, rng):
    a = _heads_args(rng, stream)
    launch = _heads(a)
    assert launch.infer_generics() == (3, 8)  # HD from the tile, HQ from HQ*HD = 24
    launch.sync_on(stream)
    expect = (a["w"].numpy(stream=stream).astype(np.float64) @ a["x"].numpy(stream=stream)
              + np.tile(a["table"].numpy(stream=stream), 6))
    np.testing.assert_allclose(a["q"].numpy(stream=stream), expect, rtol=1e-5, atol=1e-5)
    assert str(heads) == ("Kernel heads<HQ, HD>(q: out float32 [HQ*HD] tile [HD], x: float32 [k], "
                          "w: float32 [HQ * HD, k], table: float32 [HD//2], k: int32)")


def test_a_c_plus_4_tile_gives_c(stream, rng):
    x = put(rng, 5, stream)
    part = dop.empty([5, 2 * 6 + 4], stream=stream)
    launch = parts(part.partition([1, 16]), x)
    assert launch.infer_generics() == (6,)
    launch.sync_on(stream)
    np.testing.assert_allclose(part.numpy(stream=stream), x.numpy(stream=stream)[:, None] + np.arange(16))


def test_an_expression_that_disagrees_names_the_parameter_the_expression_the_values_and_the_fix(stream, rng):
    a = _heads_args(rng, stream, w=put(rng, (20, 16), stream))
    with pytest.raises(dop.ShapeError, match=r"heads<HQ=3, HD=8>: argument w has shape \[20, 16\], "
                                             r"but its axis 0 is HQ \* HD = 3\*8 = 24 \(HQ, HD from \.generics\(\)\), "
                                             r"20 here; pass a w of shape \[24, 16\]"):
        _heads(a).generics([3, 8]).sync_on(stream)
    # inferred: HD from q's tile, HQ solved from q's shape, then table's HD//2 checked
    a = _heads_args(rng, stream, table=put(rng, 3, stream))
    with pytest.raises(dop.ShapeError, match=r"heads<HD=8>: argument table has shape \[3\], but its axis 0 is "
                                             r"HD//2 = 8//2 = 4 \(HD from q's tile\), 3 here; pass a table of shape "
                                             r"\[4\]"):
        _heads(a).sync_on(stream)


def test_bare_names_bind_before_expressions_so_the_wrong_argument_is_named(stream, rng):
    """q [HQ*HD] comes first, but HD is bound by q's tile and HQ solved from q: w, which
    disagrees, is the one named; had w come first, q would not be blamed for it."""
    a = _heads_args(rng, stream, q=dop.empty([32], stream=stream), tile=8)
    with pytest.raises(dop.ShapeError, match=r"heads<HQ=4, HD=8>: argument w has shape \[24, 16\], but its axis 0 "
                                             r"is HQ \* HD = 4\*8 = 32 \(HQ from q's shape \(HQ\*HD\); HD from q's "
                                             r"tile\), 24 here"):
        _heads(a).sync_on(stream)


def test_an_expression_no_value_satisfies_is_refused_naming_the_unknown(stream, rng):
    x = put(rng, 3, stream)
    with pytest.raises(dop.ShapeError, match=r"parts: argument part has shape \[3, 9\], but its axis 1 is 2\*C\+4, "
                                             r"and no C >= 0 makes 2\*C\+4 = 9; pass a part whose axis 1 is 2\*C\+4 "
                                             r"for the C you mean \(or give \.generics\(\)\)"):
        parts(dop.empty([3, 9], stream=stream).partition([1, 9]), x).sync_on(stream)
    with pytest.raises(dop.ShapeError, match=r"no C >= 0 makes 2\*C\+4 = 2"):
        parts(dop.empty([3, 2], stream=stream).partition([1, 2]), x).sync_on(stream)


def test_generics_an_expression_cannot_give_must_be_given(stream, rng):
    """HD//2 = 4 has two answers (8, 9): only a bare name or a solvable expression infers."""
    k = Kernel("half", "template <int HD> __global__ void half(float* y) {}",
               [Out("y", "float32", shape=("HD//2",), tile=("HD//2",))], generics=["HD"], block=32,
               reference=lambda g, y: None)
    assert not k.infers_generics
    with pytest.raises(dop.LaunchError, match=r"half needs generics <HD>: call \.generics"):
        k(dop.empty(4, stream=stream).partition([4])).sync_on(stream)
    k(dop.empty(4, stream=stream).partition([4])).generics([9]).sync_on(stream)  # 9//2 = 4 checks


def test_an_int_scalar_named_by_a_shape_is_checked_against_it(stream, rng):
    a = _heads_args(rng, stream)  # x [16]
    a["k"] = 12
    with pytest.raises(dop.ShapeError, match=r"heads<k=12>: argument x has shape \[16\], but its axis 0 is k: 12 from "
                                             r"the scalar argument k, 16 here; pass k=16 \(x\.shape\[0\]\), or an x of "
                                             r"shape \[12\]"):
        _heads(a).sync_on(stream)


def test_declarations_with_expressions_are_checked():
    assert parse("HQ*HD", "here") == Expr("HQ*HD", None) and parse(" 4 ", "here") == 4 and parse("HD ", "here") == "HD"
    for dims, match in (((("HQ*",),), r"cannot read 'HQ\*' \(a number or a name is missing\)"),
                        ((("(N+1",),), r"a '\(' is not closed"),
                        ((("N**2",),), r"unexpected '\*'"),
                        ((("N.5",),), r"cannot read 'N\.5' at '\.5'"),
                        ((("N; import os",),), r"cannot read 'N; import os' at '; import os'")):
        with pytest.raises(dop.LaunchError, match=r"parameter y's shape: .*" + match + r".*\+ - \* // %"):
            Out("y", "float32", shape=dims[0])
    with pytest.raises(dop.LaunchError, match=r"its shape is a list of dimensions, one per axis, got 'N': write \['N'\]"):
        In("x", "float32", shape="N")
    src = "template <int A> __global__ void k(float* y, float s) {}"
    for params, generics, match in (
            ([Out("y", "float32", shape=("B//A",))], ["A"],
             r"y's shape \[B//A\] reads B, which no argument determines: name B alone"),
            ([Out("y", "float32", shape=("s",)), Scalar("s", "float32")], [],
             r"y's shape \[s\] names the float scalar s; a dimension is an int"),
            ([Out("y", "float32", shape=("A",)), Scalar("A", "int32")], ["A"],
             r"A is both a generic and a scalar parameter; rename one")):
        with pytest.raises(dop.LaunchError, match=match):
            Kernel("k", src, params, generics=generics, block=32)


def test_numpy_ints_are_dimensions_as_in_a_geometry(stream, rng):
    # grid=/block= took np.int64 and shape=/tile= refused it ("each dimension ... is an int, got np.int64(8)")
    n, tile = np.prod([4, 4]), np.int64(8)
    src = 'extern "C" __global__ void copy16(float* y, const float* x) { int i = blockIdx.x * 8 + threadIdx.x; y[i] = x[i]; }'
    k = Kernel("copy16", src,
               [Out("y", "float32", shape=(n,), tile=(tile,)), In("x", "float32", shape=(n,))], block=tile,
               reference=lambda g, y, x: y.__setitem__(..., x))
    assert k.params[0].shape == (16,) and type(k.params[0].shape[0]) is int
    x, y = dop.from_numpy(rng.standard_normal(16).astype(np.float32), stream=stream), dop.empty(16, stream=stream)
    k(y.partition([8]), x).sync_on(stream)
    np.testing.assert_array_equal(y.numpy(stream=stream), x.numpy(stream=stream))
    with pytest.raises(dop.LaunchError, match=r"got True in \(True,\)"):  # a bool is still no size
        Out("y", "float32", shape=(True,))


def test_a_type_generic_in_an_expression_and_a_division_by_zero_are_refused(stream):
    src = "template <typename T, int D> __global__ void typed(float* y) {}"
    typed = Kernel("typed", src, [Out("y", "float32", shape=("T*2",), tile=("16//D",))], generics=["T", "D"],
                   block=32, reference=lambda g, y: None)
    y = dop.empty(16, stream=stream)
    with pytest.raises(dop.LaunchError, match=r"T='float' in the shape expression T\*2: it is used as a number, so "
                                              r"give T an int"):
        typed(y.partition([16])).generics(["float", 1]).sync_on(stream)
    ok = Kernel("zero", src.replace("typed", "zero"), [Out("y", "float32", tile=("16//D",))], generics=["T", "D"],
                block=32, entry="zero", reference=lambda g, y: None)
    with pytest.raises(dop.ShapeError, match=r"16//D = 16//0 divides by zero; give D a value that is not zero"):
        ok(y.partition([16])).generics(["float", 0]).sync_on(stream)


def test_shapes_are_read_at_declaration_and_checked_once_per_argument_shapes(stream, rng, monkeypatch):
    """No parsing and no binding at a launch whose arguments were seen: the plan holds the verdict."""
    calls = []
    real = plan_module.bind
    monkeypatch.setattr(plan_module, "bind", lambda *a: calls.append(1) or real(*a))
    a = _heads_args(rng, stream)
    for _ in range(3):
        _heads(a).sync_on(stream)
    assert len(calls) == 1
    _heads(_heads_args(rng, stream, hq=2)).sync_on(stream)  # new shapes: checked again
    assert len(calls) == 2


def test_an_in_out_tensor_shaped_by_an_expression(stream, rng):
    """InOut shapes take expressions too (a KV cache [HKV, cap, HD] appended at a row)."""
    src = r"""template <int HD> __global__ void put_row(float* done, float* cache, const float* row, int cap, int pos) {
        int h = blockIdx.x, i = threadIdx.x;
        cache[(h * cap + pos) * HD + i] = row[h * HD + i];
        if (i == 0) done[h] = 1.0f;
    }"""

    def ref(g, done, cache, row, cap, pos):
        cache[:, pos, :] = row.reshape(cache.shape[0], -1)
        done[...] = 1.0

    put_row = Kernel("put_row", src, [Out("done", "float32", shape=("H",), tile=(1,)),
                                      InOut("cache", "float32", shape=("H", "cap", "HD")),
                                      In("row", "float32", shape=("H*HD",)), Scalar("cap", "int32"),
                                      Scalar("pos", "int32")],
                     generics=["HD"], block="HD", reference=ref)
    cache, row = put(rng, (2, 5, 8), stream), put(rng, 16, stream)
    before = cache.numpy(stream=stream)
    put_row(dop.empty(2, stream=stream).partition([1]), cache, row, 5, 3).sync_on(stream)
    before[:, 3, :] = row.numpy(stream=stream).reshape(2, 8)
    np.testing.assert_array_equal(cache.numpy(stream=stream), before)
    with pytest.raises(dop.ShapeError, match=r"put_row<cap=4>: argument cache has shape \[2, 5, 8\], but its axis 1 "
                                             r"is cap: 4 from the scalar argument cap, 5 here; pass cap=5"):
        put_row(dop.empty(2, stream=stream).partition([1]), cache, row, 4, 3).sync_on(stream)
    with pytest.raises(dop.ShapeError, match=r"put_row<H=2, HD=8>: argument row has shape \[12\], but its axis 0 is "
                                             r"H\*HD = 2\*8 = 16 \(H from done's shape; HD from cache's shape\)"):
        put_row(dop.empty(2, stream=stream).partition([1]), cache, put(rng, 12, stream), 5, 3).sync_on(stream)


def test_a_captured_node_cannot_set_a_scalar_that_disagrees_with_a_shape(stream, rng):
    """k names x's length: setting it in a graph is checked like a launch (a kernel
    without rules of its own would otherwise take a scalar unchecked)."""
    put_k = Kernel("sum_k", "extern \"C\" __global__ void sum_k(float* y, const float* x, int k) {}",
                   [Out("y", "float32", shape=(1,), tile=(1,)), In("x", "float32", shape=("k",)), Scalar("k", "int32")],
                   block=32, reference=lambda g, y, x, k: y.__setitem__(..., x[:k].sum()))
    x = put(rng, 16, stream)
    launch = put_k(dop.empty(1, stream=stream).partition([1]), x, 16).dynamic("k")
    graph = launch.graph_on(stream)
    with pytest.raises(dop.ShapeError, match=r"sum_k<k=8>: argument x has shape \[16\], but its axis 0 is k: 8 from "
                                             r"the scalar argument k"):
        graph.node(launch).set(k=8)
    graph.node(launch).set(k=16)
    graph.launch().sync_on(stream)
