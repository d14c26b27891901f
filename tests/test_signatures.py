"""Typed kernel signatures: shapes in terms of generics (cuTile's ``Tensor<f32, {[B]}>``),
generics inferred from the arguments, given ones checked, and seed 001's tutorial
code exactly as the seed writes it (``add(...)`` with no ``.generics()``)."""
import sys
from pathlib import Path

import copy
import pickle

import numpy as np
import pytest

import deviceop as dop
from deviceop import CudaGraph, DeviceOpVec, GraphModel, Module, api, shared, zip_
from deviceop.kernel import In, Kernel, Out, Scalar
from deviceop.kernels import add, matvec, rms_norm

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
from token_model import Config, numpy_forward  # noqa: E402

SCALE = Kernel(
    "scale", r"""template <int B> __global__ void scale(float* y, const float* x, const float* w, float a) {
        int i = blockIdx.x * B + threadIdx.x; y[i] = a * x[i] * w[i % B]; }""",
    [Out("y", "float32", shape=("N",), tile=("B",)), In("x", "float32", shape=("N",)),
     In("w", "float32", shape=("B",)), Scalar("a", "float32")],
    generics=["B"], block=lambda g: g["B"],
    reference=lambda g, y, x, w, a: y.__setitem__(..., a * x * np.tile(w, x.size // g["B"])))


def test_a_generic_named_by_a_tile_is_inferred(stream, rng):
    xs, ws = rng.standard_normal(256).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    y = dop.empty(256, stream=stream)
    out = SCALE(y.partition([64]), dop.from_numpy(xs), dop.from_numpy(ws), 2.0).first().unpartition().sync_on(stream)
    np.testing.assert_allclose(out.numpy(stream=stream), 2 * xs * np.tile(ws, 4), rtol=1e-6)


def test_a_given_generic_that_disagrees_names_the_parameter_the_generic_and_both_values(stream, rng):
    x, w, y = dop.empty(256, stream=stream), dop.empty(64, stream=stream), dop.empty(256, stream=stream)
    with pytest.raises(dop.ShapeError, match=r"scale<B=32>: partition y with \[32\], not \[64\] "
                                             r"\(y's tile axis 0 is B: 32 from \.generics\(\), 64 here\)"):
        SCALE(y.partition([64]), x, w, 1.0).generics([32]).sync_on(stream)


def test_arguments_that_disagree_with_an_inferred_generic_are_refused(stream):
    x, y = dop.empty(256, stream=stream), dop.empty(256, stream=stream)
    with pytest.raises(dop.ShapeError, match=r"scale<B=64>: argument w has shape \[128\], but its axis 0 is B: 64 "
                                             r"from y's tile, 128 here; pass a w of shape \[64\]"):
        SCALE(y.partition([64]), x, dop.empty(128, stream=stream), 1.0).sync_on(stream)
    with pytest.raises(dop.ShapeError, match=r"scale<N=256>: argument x has shape \[128\], but its axis 0 is N: "
                                             r"256 from y's shape"):
        SCALE(y.partition([64]), dop.empty(128, stream=stream), dop.empty(64, stream=stream), 1.0).sync_on(stream)


def test_generics_no_shape_names_must_still_be_given(stream):
    x, w = dop.empty([1, 256], stream=stream), dop.empty([256], stream=stream)
    with pytest.raises(dop.LaunchError, match=r"rms_norm needs generics <D, BS>: call \.generics\(\[\.\.\.\]\) on "
                                              r"the launch \(the shapes of its parameters do not determine them all\)"):
        rms_norm(dop.empty([1, 256], stream=stream).partition([1, 256]), x, w, 1e-5).sync_on(stream)


def test_declarations_are_checked_and_shown():
    assert str(add) == "Kernel add<B>(out: out float32 [N] tile [B], a: float32 [N], b: float32 [N])"
    assert "x: float32 [-1, K]" in str(matvec)
    with pytest.raises(dop.LaunchError, match=r"parameter x: rank=1 but \[-1, K\] has 2 dimensions"):
        In("x", "float32", rank=1, shape=(-1, "K"))
    with pytest.raises(dop.LaunchError, match=r"an int, -1 \(any\), the name of a generic or size, or arithmetic on them .*got 1.5"):
        Out("y", "float32", tile=(1.5,))
    assert Out("y", "float32", rank=2).rank == 2 and In("x", "bfloat16", rank=2).shape is None  # rank= still works


SRC = "template <int B> __global__ void k(float* o) {}"
OUT = Out("o", "float32", shape=("N",), tile=("B",))


@pytest.mark.parametrize("args,kw,says", [
    ((5, SRC, [OUT]), {}, "a Kernel's name is a non-empty str"),
    (("k", 5, [OUT]), {}, "the source is CUDA C.. as a str, or a .cu file's Path"),
    (("k", SRC, None), {}, "params= is a list, got None"),
    (("k", SRC, OUT), {}, r"params= is a list, got Param\(name='o'"),     # one Param, not in a list
    (("k", SRC, [OUT, "x"]), {}, "each parameter is declared with Out.*got 'x'"),
    (("k", SRC, [OUT]), {"generics": "B"}, r"generics= is a list, got 'B'"),  # "BK" would be two generics
    (("k", SRC, [OUT]), {"options": "-lineinfo"}, "options= is a list"),     # one option per character
    (("k", SRC, [OUT]), {"options": ["-DN=4", None]}, r"options= is a str each.*got None"),
    (("k", SRC, [OUT]), {"include_dirs": [3]}, r"include_dirs= is a str or Path each.*got 3"),
    (("k", SRC, [OUT]), {"generics": [2]}, "names are identifiers.*got 2"),
    (("k", SRC, [OUT, In("o", "float32")]), {"generics": ["B"]}, "declares the parameter o more than once"),
    (("k", SRC, [OUT]), {"generics": ["B", "B"]}, "declares the generic B more than once"),
    (("k", SRC, [OUT]), {"generics": ["B"], "entry": 3}, "entry= is the kernel's name"),
    (("k", SRC, [OUT]), {"generics": ["B"], "reference": np.zeros(3)}, "reference= is a function"),
    (("k", SRC, [OUT]), {"generics": ["B"], "validate": True}, "validate= is a function")])
def test_a_declaration_of_the_wrong_kind_is_refused_naming_the_argument(args, kw, says):
    # each of these was taken apart by tuple(), or accepted and failed at the first launch with a raw error
    with pytest.raises(dop.LaunchError, match=says):
        Kernel(*args, **kw)


def test_a_source_that_cannot_be_read_or_compiled_is_refused_naming_it(tmp_path):
    # a missing or binary source file was a raw FileNotFoundError/UnicodeDecodeError; source=None an
    # AttributeError at the first compile
    with pytest.raises(dop.LaunchError, match=r"cannot read its source .*nope.cu \(No such file"):
        Kernel("k", tmp_path / "nope.cu", [OUT], generics=["B"])
    (tmp_path / "k.cubin").write_bytes(b"\x7fELF\xff\xfe")
    with pytest.raises(dop.LaunchError, match="not UTF-8 text.*Kernel.from_binary"):
        Kernel("k", tmp_path / "k.cubin", [OUT], generics=["B"])
    with pytest.raises(dop.LaunchError, match="has no source to compile.*Kernel.from_binary"):
        Kernel("k", None, [OUT], generics=["B"]).check_compiled("sm_90", (128,))


def test_a_source_files_quoted_include_is_the_one_beside_it(tmp_path, monkeypatch):
    # the file was compiled under its bare name, so NVRTC looked in the working directory first:
    # a c.cuh there was compiled in place of the one beside the .cu
    (tmp_path / "src").mkdir(), (tmp_path / "cwd").mkdir()
    (tmp_path / "src" / "c.cuh").write_text("#define V 7\n")
    (tmp_path / "cwd" / "c.cuh").write_text("#define V 99\n")
    (tmp_path / "src" / "k.cu").write_text('#include "c.cuh"\nstatic_assert(V == 7, "the c.cuh of the working '
                                           'directory");\ntemplate <int B> __global__ void k(float* o) {}\n')
    monkeypatch.chdir(tmp_path / "cwd")
    Kernel("k", tmp_path / "src" / "k.cu", [OUT], generics=["B"]).check_compiled("sm_90", (128,))


def _twice_reference(g, out, x):
    out[...] = 2 * x


TWICE = Kernel("twice", 'extern "C" __global__ void twice(float* o, const float* x) '
               "{ int i = blockIdx.x * blockDim.x + threadIdx.x; o[i] = 2 * x[i]; }",
               [Out("o", "float32", tile=(128,)), In("x", "float32")], block=128, reference=_twice_reference)


def test_a_kernel_pickles_and_deep_copies(stream, rng):
    # both were a raw TypeError (cannot pickle '_thread.lock'), and so was a deepcopy of anything holding one
    assert copy.deepcopy({"k": add})["k"] is add
    assert pickle.loads(pickle.dumps(dop.float32)) is dop.float32  # a new instance failed every dtype check
    x = dop.from_numpy(rng.standard_normal(256).astype(np.float32))
    out = dop.empty(256, stream=stream)
    TWICE(out.partition([128]), x).sync_on(stream)   # plans, loaded functions: not pickled, made anew
    again = pickle.loads(pickle.dumps(TWICE))
    assert str(again) == str(TWICE) and again._plans == {} and again._functions == {}
    out2 = dop.empty(256, stream=stream)
    again(out2.partition([128]), x).sync_on(stream)
    np.testing.assert_array_equal(out2.numpy(stream=stream), 2 * x.numpy())


def test_the_inferred_generics_are_the_compiled_ones_in_a_graph(stream, rng):
    """A captured launch whose generics were inferred becomes the node of that instantiation."""
    a, b = (dop.from_numpy(rng.standard_normal(256).astype(np.float32)) for _ in range(2))
    out = dop.empty(256, stream=stream)
    step = add(out.partition([128]), a, b)
    graph = step.graph_on(stream)
    assert graph.node(step).label == "add<128>" and graph.node(step).generics == (128,)
    graph.launch().sync_on(stream)
    np.testing.assert_allclose(out.numpy(stream=stream), a.numpy() + b.numpy(), rtol=1e-6)


# -- seed 001, as the seed writes it (DESIGN.md's "Target usage") ---------------------------

def build_forward(cfg, weights, input, buffers):
    ops, hidden = [], shared(input)
    for w, bufs in zip(weights, buffers):
        norm = (rms_norm(bufs.norm.try_partition([1, cfg.d]),
                         hidden.clone().reshape([1, cfg.d]), w.norm_w, cfg.eps)
                .generics(cfg.rms_generics()).first().unpartition().shared())
        q = (matvec(bufs.q.try_partition([cfg.bn]), norm.clone(), w.wq)
             .generics(cfg.mv_generics()).first().unpartition().shared())
        o = (matvec(bufs.o.try_partition([cfg.bn]), q.clone().reshape([1, cfg.d]), w.wo)
             .generics(cfg.mv_generics()).first().unpartition().shared())
        residual = (add(bufs.residual.try_partition([cfg.block]),
                        hidden.clone().reshape([cfg.d]), o.clone())
                    .first().unpartition().shared())
        hidden = residual.clone()
        ops.append(zip_(norm, q, o, residual).map(lambda _: None).boxed())
    return DeviceOpVec(ops), hidden


class Weights:
    def __init__(self, norm_w, wq, wo):
        self.norm_w, self.wq, self.wo = norm_w, wq, wo


class Buffers:
    def __init__(self, d, stream):
        self.norm, self.q, self.o, self.residual = (dop.empty(s, stream=stream).into_shared()
                                                    for s in ([1, d], [d], [d], [d]))


def test_seed_001_tutorial_as_the_seed_writes_it(stream, rng):
    cfg = Config(d=256, n_layers=3, bk=2)
    host = [(1 + 0.1 * rng.standard_normal(cfg.d).astype(np.float32),
             (rng.standard_normal((cfg.d, cfg.d)) / 16).astype(np.float32),
             (rng.standard_normal((cfg.d, cfg.d)) / 16).astype(np.float32)) for _ in range(cfg.n_layers)]
    weights = [Weights(*(dop.from_numpy(a, stream=stream).into_shared() for a in h)) for h in host]
    buffers = [Buffers(cfg.d, stream) for _ in range(cfg.n_layers)]
    xs = rng.standard_normal(cfg.d).astype(np.float32)
    input_arc = dop.from_numpy(xs, stream=stream)

    forward_op, out = build_forward(cfg, weights, input_arc, buffers)  # nothing runs yet
    graph = forward_op.graph_on(stream)       # runs once under stream capture
    output = out.sync_on(stream)              # the buffer the graph rewrites
    graph.launch().sync_on(stream)            # the capture recorded; a replay computes
    np.testing.assert_allclose(output.numpy(stream=stream), numpy_forward(cfg, host, xs), rtol=1e-4, atol=1e-5)

    class SeedGraphModel(Module):             # forward = copy input in, replay
        def __init__(self, graph, input, output):
            self.graph, self.input, self.output = graph, input, output

        def forward(self, x):
            self.graph.update(api.memcpy(self.input, x))
            self.graph.launch().sync_on(self.graph.stream)
            return self.output

    model = SeedGraphModel(graph, input_arc, output)
    for _ in range(2):
        x2 = rng.standard_normal(cfg.d).astype(np.float32)
        got = model.forward(dop.from_numpy(x2, stream=stream))
        np.testing.assert_allclose(got.numpy(stream=stream), numpy_forward(cfg, host, x2), rtol=1e-4, atol=1e-5)
    assert isinstance(GraphModel(graph, input_arc, output), Module)

    d, eps, inp = cfg.d, cfg.eps, dop.from_numpy(xs, stream=stream)
    plain = [[dop.empty(s, stream=stream) for s in ([1, d], [d], [d], [d])] for _ in range(cfg.n_layers)]

    def body(s):                              # imperative capture
        for w, (norm, q, o, res) in zip(weights, plain):
            s.record(rms_norm(norm.partition([1, d]), inp.view([1, d]), w.norm_w, eps)
                     .generics(cfg.rms_generics()))
            s.record(matvec(q.partition([cfg.bn]), norm, w.wq).generics(cfg.mv_generics()))
            s.record(matvec(o.partition([cfg.bn]), q.view([1, d]), w.wo).generics(cfg.mv_generics()))
            s.record(add(res.partition([cfg.block]), inp, o))
            s.record(api.memcpy(inp, res))
    graph = CudaGraph.scope(stream, body)
    graph.launch().sync_on(stream)
    np.testing.assert_allclose(inp.numpy(stream=stream), numpy_forward(cfg, host, xs), rtol=1e-4, atol=1e-5)
