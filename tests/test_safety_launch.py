"""A launch is refused whenever the GPU would do something wrong with it (issue 24).

* Every check that can reject a launch runs whenever its inputs change: a
  kernel's rules (``validate``) may read scalars, so a repeated launch with a
  new scalar, a graph node given a new scalar, and a scalar computed by an op
  are all checked like a first launch (the verdict cache keys on every input
  of every check).
* A tensor parameter is dense unless its declaration says otherwise: the
  kernels receive a bare pointer and index it row-major, so a reversed, a
  broadcast (stride 0), an every-other-element or a row-strided view is
  refused with a ShapeError that names the fix, before any driver call.

Unmarked tests run on Device(0): the reference device here, the H100 under
scripts/gpu-check.  Tests through ``fake_gpu`` take the GPU launch path with a
driver that records cuLaunchKernel (tests/test_eager_gpu_path.py).
"""
import numpy as np
import pytest

import deviceop as dop
from deviceop.testing import ForeignArray
from deviceop import api
from deviceop.kernel import In, Kernel, Out
from deviceop.kernels import affine, rms_norm, store_row
from test_eager_gpu_path import fake_gpu

D = 128


@pytest.fixture
def rows(stream, rng):
    """A 4-row table, a row to store and an index (7: outside the table) on Device(0)."""
    table = dop.from_numpy(rng.standard_normal((4, D)).astype(np.float32), stream=stream)
    x = dop.from_numpy(rng.standard_normal(D).astype(np.float32), stream=stream)
    index = dop.from_numpy(np.array([7], np.int32), stream=stream)
    return table, x, index


def store(table, x, index, n_rows):
    return store_row(table.partition([4, D]), x, index, n_rows).generics([D])


# -- item 1: a new scalar is checked again ------------------------------------------------

def test_a_repeated_launch_with_a_new_scalar_runs_the_kernels_rules_again(stream, rows):
    table, x, index = rows
    before = table.numpy()
    for _ in range(2):
        store(table, x, index, 4).sync_on(stream)      # row 7 of 4 rows: the kernel moves nothing
    for _ in range(2):  # the same layouts with rows=1000 would write row 7 of a 4-row table
        with pytest.raises(dop.ShapeError, match="axis 0 is rows: 1000 from the scalar argument rows, 4 here; pass "
                                                 r"rows=4 \(table\.shape\[0\]\)"):
            store(table, x, index, 1000).sync_on(stream)
    np.testing.assert_array_equal(table.numpy(), before)


def test_a_new_scalar_is_checked_before_it_reaches_the_driver(monkeypatch):
    device, stream, driver, checks = fake_gpu(monkeypatch, [(store_row, [D])])
    table, x, index = dop.empty([4, D]), dop.empty([D]), dop.empty([1], "int32")
    store(table, x, index, 4).async_on(stream)
    for _ in range(2):
        with pytest.raises(dop.ShapeError, match="rows=1000"):
            store(table, x, index, 1000).async_on(stream)
    store(table, x, index, 4).async_on(stream)        # prepared: no check, one driver call
    assert [launch[3][3] for launch in driver.launches] == [4, 4]
    assert checks == ["store_row"]  # the first launch's rules; the shapes refused rows=1000 before them


def test_a_node_update_runs_the_kernels_rules_and_a_refusal_changes_nothing(stream, rows):
    table, x, index = rows
    api.memcpy(index, dop.from_numpy(np.array([2], np.int32))).sync_on(stream)
    step = store(table, x, index, 4).dynamic("rows")
    graph = step.graph_on(stream)
    node = graph.node(step)
    with pytest.raises(dop.ShapeError, match="axis 0 is rows: 100 from the scalar argument rows, 4 here"):
        node.set(rows=100)
    with pytest.raises(dop.ShapeError, match="rows=100"):
        node.set(node.args["table"], x, index, 100)  # all arguments, positionally
    assert node.args["rows"] == 4
    graph.launch().sync_on(stream)                  # the node still stores row 2 of 4
    np.testing.assert_array_equal(table.numpy()[2], x.numpy())
    node.set(rows=4)                                # the arguments it was captured with: accepted
    graph.close()


def test_scalars_computed_by_ops_are_checked_like_plain_scalars(stream, rows, rng):
    table, x, index = rows
    y = dop.empty(256)
    v = dop.from_numpy(rng.standard_normal(256).astype(np.float32))
    affine(y.partition([128]), v, dop.value(2.0), 0.0).generics([128]).sync_on(stream)
    with pytest.raises(dop.DTypeError, match="alpha.*bool"):
        affine(y.partition([128]), v, dop.value(True), 0.0).generics([128]).sync_on(stream)
    store(table, x, index, dop.value(4)).sync_on(stream)
    with pytest.raises(dop.DTypeError, match="rows.*does not fit in int32"):
        store(table, x, index, dop.value(2**40)).sync_on(stream)


@pytest.mark.gpu
def test_on_the_gpu_a_new_scalar_never_writes_past_the_table(stream, rng):
    """The table is the first 4 rows of a bigger buffer: rows=1000 would overwrite row 7."""
    host = rng.standard_normal((8, D)).astype(np.float32)
    buf = dop.from_numpy(host, stream=stream)
    table, x = buf[:4], dop.from_numpy(rng.standard_normal(D).astype(np.float32), stream=stream)
    index = dop.from_numpy(np.array([7], np.int32), stream=stream)
    for n_rows in (4, 4):
        store(table, x, index, n_rows).async_on(stream)
    with pytest.raises(dop.ShapeError, match="rows=1000"):
        store(table, x, index, 1000).async_on(stream)
    np.testing.assert_array_equal(buf.numpy(stream=stream), host)


# -- item 2: strided views are refused unless a parameter declares them -------------------

Exported = ForeignArray  # another framework's memory, exported through DLPack


def _broadcast(value, n):
    """A stride-0 tensor of n elements, imported through DLPack (host memory here, GPU memory on a GPU)."""
    if dop.Device(0).is_reference:
        return dop.from_dlpack(Exported(np.broadcast_to(value, (n,))))
    import cupy
    return dop.from_dlpack(cupy.broadcast_to(cupy.asarray(value), (n,)))


def _views(rng):
    """The four views of the issue, each (name, tensor, a launch that reads it)."""
    t = dop.from_numpy(rng.standard_normal(600).astype(np.float32))
    bcast = _broadcast(np.float32(rng.standard_normal()), 256)
    big = dop.from_numpy(rng.standard_normal((4, 1024)).astype(np.float32))
    w = dop.from_numpy(rng.standard_normal(512).astype(np.float32))

    def affine_of(v):
        return affine(dop.empty(v.shape[0]).partition([128]), v, 2.0, 1.0).generics([128])

    def rms_of(v):
        return rms_norm(dop.empty([4, 512]).partition([1, 512]), v, w, 1e-5).generics([512, 128])

    return [("reversed", t[260:4:-1], affine_of), ("broadcast", bcast, affine_of),
            ("every other element", t[0:512:2], affine_of), ("row-strided", big[:, :512], rms_of)]


@pytest.mark.parametrize("which", range(4), ids=["reversed", "broadcast", "every-other", "row-strided"])
def test_a_strided_view_is_refused_naming_the_fix(stream, rng, which):
    name, view, launch = _views(rng)[which]
    assert not view.is_contiguous, name
    with pytest.raises(dop.ShapeError, match=r"argument x of (affine|rms_norm) must be dense \(C-contiguous\), "
                                             r"got shape .* with strides .*t\.contiguous\(\)"):
        launch(view).sync_on(stream)
    dense = view.contiguous()                        # the fix the message names
    assert dense.is_contiguous and dense is not view
    np.testing.assert_array_equal(dense.numpy(), view.numpy())
    launch(dense).sync_on(stream)


def test_an_output_must_be_dense_too_and_size_one_dims_may_have_any_stride(stream, rng):
    big = dop.from_numpy(rng.standard_normal((2, 512)).astype(np.float32))
    x = dop.from_numpy(rng.standard_normal(256).astype(np.float32))
    with pytest.raises(dop.ShapeError, match="argument out of affine must be dense"):
        affine(big.view([-1])[0:512:2].partition([128]), x, 2.0, 1.0).generics([128]).sync_on(stream)
    row = big[1:2, ::-1][:, ::-1]                   # a [1, 512] view: its size-1 axis's stride is irrelevant
    assert row.is_contiguous
    w = dop.from_numpy(rng.standard_normal(512).astype(np.float32))
    out = dop.empty([1, 512])
    rms_norm(out.partition([1, 512]), row, w, 1e-5).generics([512, 128]).sync_on(stream)


def test_a_strided_view_is_refused_before_the_driver(monkeypatch, rng):
    device, stream, driver, checks = fake_gpu(monkeypatch, [(affine, [128])])
    t = dop.empty([600])
    with pytest.raises(dop.ShapeError, match="must be dense"):
        affine(dop.empty([256]).partition([128]), t[0:512:2], 2.0, 1.0).generics([128]).async_on(stream)
    assert driver.launches == [] and checks == []   # refused by the shared check, before the kernel's own


def test_a_node_update_to_a_strided_view_is_refused(stream, rng):
    x = dop.from_numpy(rng.standard_normal(256).astype(np.float32))
    y = dop.empty(256)
    step = affine(y.partition([128]), x, 2.0, 1.0).generics([128]).dynamic("x")
    graph = step.graph_on(stream)
    t = dop.from_numpy(rng.standard_normal(600).astype(np.float32))
    with pytest.raises(dop.ShapeError, match="must be dense"):
        graph.node(step).set(x=t[0:512:2])
    assert graph.node(step).args["x"] is x
    graph.close()


def test_a_parameter_may_declare_a_strided_layout(stream, rng):
    """``layout="strided"``: for a kernel that is given the strides and reads them."""
    source = ('extern "C" __global__ void take(float* out, const float* x, int stride) '
              '{ out[threadIdx.x] = x[threadIdx.x * stride]; }')

    def ref(g, out, x, stride):
        out[...] = x

    take = Kernel("take", source, [Out("out", "float32", rank=1), In("x", "float32", rank=1, layout="strided"),
                                   dop.Scalar("stride", "int32")], block=32, reference=ref)
    t = dop.from_numpy(rng.standard_normal(64).astype(np.float32))
    out = dop.empty(32)
    take(out.partition([32]), t[0:64:2], 2).sync_on(stream)
    np.testing.assert_array_equal(out.numpy(), t.numpy()[0:64:2])
    assert "x: float32, rank 1, strided" in repr(take)
    with pytest.raises(dop.LaunchError, match="layout must be one of 'dense', 'strided', got 'packed'"):
        In("x", "float32", layout="packed")


@pytest.mark.gpu
def test_on_the_gpu_a_row_strided_view_is_refused_and_its_copy_is_normalized_right(stream, rng):
    host = rng.standard_normal((4, 1024)).astype(np.float32)
    big = dop.from_numpy(host, stream=stream)
    w = dop.from_numpy(rng.standard_normal(512).astype(np.float32), stream=stream)
    out = dop.from_numpy(np.full((4, 512), np.nan, np.float32), stream=stream)
    with pytest.raises(dop.ShapeError, match="argument x of rms_norm must be dense"):
        rms_norm(out.partition([1, 512]), big[:, :512], w, 1e-5).generics([512, 128]).sync_on(stream)
    assert np.isnan(out.numpy(stream=stream)).all()
    rms_norm(out.partition([1, 512]), big[:, :512].contiguous(stream=stream), w, 1e-5).generics([512, 128]) \
        .sync_on(stream)
    x = host[:, :512].astype(np.float64)
    want = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + 1e-5) * w.numpy(stream=stream)
    np.testing.assert_allclose(out.numpy(stream=stream), want, rtol=1e-5, atol=1e-5)


# -- item 4 (compile part): the reference device compiles the kernel it stands in for ------

def _scale(source, params=None, entry=None):
    """A one-tile y = alpha * x kernel over ``source``, with a NumPy reference."""
    def ref(g, out, x, alpha):
        out[...] = np.float64(alpha) * x.astype(np.float64)
    params = params or [Out("out", "float32", rank=1), In("x", "float32", rank=1), dop.Scalar("alpha", "float32")]
    return Kernel("scale", source, params, generics=["B"], block=lambda g: g["B"], reference=ref, entry=entry)


SCALE = """
template <int B>
__global__ void scale(float* out, const float* x, float alpha) {
    out[blockIdx.x * B + threadIdx.x] = alpha * x[blockIdx.x * B + threadIdx.x];
}
"""


def _scale_launch(kernel, rng, n=64):
    x = dop.from_numpy(rng.standard_normal(n).astype(np.float32))
    return kernel(dop.empty(n).partition([32]), x, 2.0).generics([32])


def test_a_kernel_that_does_not_compile_is_refused_with_the_nvrtc_log(stream, rng):
    broken = _scale(SCALE.replace("alpha * x", "alpha * undeclared_name * x"))
    for _ in range(2):  # refused every time, not only the first
        with pytest.raises(dop.CompileError, match=r"(?s)undeclared_name.*>> +4 \|"):
            _scale_launch(broken, rng).sync_on(stream)
    with pytest.raises(dop.CompileError, match="undeclared_name"):  # and in a capture, which ends cleanly
        _scale_launch(broken, rng).graph_on(stream)
    _scale_launch(_scale(SCALE), rng).sync_on(stream)  # the stream goes on


def test_a_template_instantiation_that_fails_is_refused_for_those_generics_only(stream, rng):
    k = _scale(SCALE.replace("float alpha) {", "float alpha) {\n    static_assert(B % 32 == 0, \"B\");"))
    _scale_launch(k, rng).sync_on(stream)           # B=32 compiles
    x = dop.from_numpy(rng.standard_normal(48).astype(np.float32))
    with pytest.raises(dop.CompileError, match="static assertion failed"):
        k(dop.empty(48).partition([48]), x, 2.0).generics([48]).sync_on(stream)


def test_a_signature_that_disagrees_with_the_kernel_is_refused_without_a_driver(stream, rng):
    wrong = [Out("out", "float32", rank=1), In("x", "float32", rank=1), dop.Scalar("alpha", "float64")]
    with pytest.raises(dop.LaunchError, match=r"parameter 2 of kernel scale<32> is 4 bytes at offset 16, but "
                                              r"the signature declares dop.float64 \(8 bytes at 16\)"):
        _scale_launch(_scale(SCALE, wrong), rng).sync_on(stream)
    fewer = _scale(SCALE, [Out("out", "float32", rank=1), In("x", "float32", rank=1)])
    with pytest.raises(dop.LaunchError, match="kernel scale<32> takes 3 parameters but its declared signature has 2"):
        fewer(dop.empty(64).partition([32]), dop.empty(64)).generics([32]).sync_on(stream)


def test_an_entry_the_source_or_the_cubin_lacks_is_refused(stream, rng):
    """A misspelt entry (C++ or extern "C": NVRTC cannot resolve its name expression), an
    overloaded one, or a mangled symbol the CUBIN lacks: no GPU could load it."""
    source = "__global__ void fill(float* out) { out[threadIdx.x] = 1.0f; }"
    for src, entry, error, match in (
            (source, "fil", dop.CompileError, "fill: the source defines no kernel fil: pass entry= the __global__"),
            ('extern "C" ' + source, "fil", dop.CompileError, "the source defines no kernel fil"),
            (source + "__global__ void fill(int* out) {}", "fill", dop.CompileError, "the source overloads fill"),
            (source, "_Z4fillPi", dop.LaunchError, "no kernel '_Z4fillPi'.*or its exact mangled symbol")):
        k = Kernel("fill", src, [Out("out", "float32", rank=1)], block=32,
                   reference=lambda g, out: out.fill(1.0), entry=entry)
        with pytest.raises(error, match=match):
            k(dop.empty(32).partition([32])).sync_on(stream)


def test_a_template_entry_without_its_generics_is_refused_naming_generics():
    # NVRTC's "cannot determine which instance of function template" came with "check entry= and the generics"
    source = "template <int B, typename T> __global__ void fill(T* out) { out[threadIdx.x] = B; }"
    for generics, values, match in (((), (), r"fill is a template: declare its template parameters, generics="),
                                    (("B",), (4,), r"the generics <4> do not instantiate the template fill")):
        k = Kernel("fill", source, [Out("out", "float32", rank=1)], generics=generics)
        with pytest.raises(dop.CompileError, match=match):
            k.check_compiled("sm_90", values)


def test_the_cubin_says_what_cuFuncGetParamInfo_says():
    """The parameter layout read from the CUBIN's EIATTR_KPARAM_INFO records."""
    from deviceop.kernels import affine, rms_norm, store_row
    expected = {affine: [(0, 8), (8, 8), (16, 4), (20, 4)],
                store_row: [(0, 8), (8, 8), (16, 8), (24, 4)],
                rms_norm: [(0, 8), (8, 8), (16, 8), (24, 4)]}
    gens = {affine: (256,), store_row: (128,), rms_norm: (512, 128)}
    for kernel, layout in expected.items():
        prog, expr = kernel.compile(gens[kernel], arch="sm_90")
        assert prog.param_layout(expr) == layout, kernel.name
        assert prog.param_layout("no_such_kernel") is None


def test_a_kernel_is_compiled_once_per_generics_on_the_reference_device(stream, rng, monkeypatch):
    k = _scale(SCALE)
    compiled = []
    real = k.compile
    monkeypatch.setattr(k, "compile", lambda values=(), arch=None: (compiled.append(values), real(values, arch))[1])
    for alpha in (1.0, 2.0, 3.0):
        x = dop.from_numpy(rng.standard_normal(64).astype(np.float32))
        k(dop.empty(64).partition([32]), x, alpha).generics([32]).sync_on(stream)
    k(dop.empty(64).partition([64]), dop.empty(64), 1.0).generics([64]).sync_on(stream)
    assert compiled == [(32,), (64,)]  # a GPU compiles when it loads, the reference device when it first checks


@pytest.mark.gpu
def test_on_the_gpu_the_cubin_layout_matches_cuFuncGetParamInfo_for_every_shipped_kernel(device):
    from cuda.bindings import driver as cu
    import deviceop.kernels as lib
    cases = [(lib.affine, (256,)), (lib.add, (128,)), (lib.rms_norm, (512, 128)), (lib.matvec, (16, 1, 256)),
             (lib.store_row, (128,)), (lib.load_row, (128,)), (lib.rms_matvec_bf16, (8, 1, 256)),
             (lib.matvec_add, (8, 1, 256)), (lib.matvec_batched, (8, 1, 256, 4))]
    for kernel, gen in cases:
        fn = kernel.function(device, gen)
        actual = []
        while True:
            code, offset, size = cu.cuFuncGetParamInfo(fn.handle, len(actual))
            if code:
                break
            actual.append((offset, size))
        prog, expr = kernel.compile(gen, arch=device.arch)
        assert prog.param_layout(expr) == actual, kernel.name
