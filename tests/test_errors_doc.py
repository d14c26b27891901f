"""docs/errors.md is complete and true: every exception deviceop exports has a row,
every row names a test that exists and raises that exception, and the rows
without an older test are tested here."""
from __future__ import annotations

import ast
import re
import threading
from pathlib import Path

import numpy as np
import pytest

import deviceop as dop
from deviceop import CudaGraph, api, zip_
from deviceop.kernels import add, affine, matvec, rms_norm

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"^\| `(\w+)` \|(.+?)\|(.+?)\| `(tests/\w+\.py)::(test_\w+)` \|$", re.M)


def rows():
    return ROW.findall((ROOT / "docs" / "errors.md").read_text())


def exported_exceptions():
    return {n for n in dop.__all__ if isinstance(getattr(dop, n), type) and issubclass(getattr(dop, n), dop.DeviceOpError)}


def test_every_exported_exception_has_a_row():
    documented = {r[0] for r in rows()}
    assert documented == exported_exceptions(), f"missing: {exported_exceptions() - documented}, " \
                                                f"unknown: {documented - exported_exceptions()}"


def test_every_row_names_a_test_that_exists_and_raises_the_exception():
    for name, when, todo, path, test in rows():
        assert when.strip() and todo.strip(), f"{name}: empty cell"
        tree = ast.parse((ROOT / path).read_text())
        fn = next((f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == test), None)
        assert fn is not None, f"{name}: {path}::{test} does not exist"
        src = ast.get_source_segment((ROOT / path).read_text(), fn)
        named = name in src or (name == "CudaError" and "raise_error" in src)
        assert named or name == "DeviceOpError", f"{path}::{test} never mentions {name}"


# -- the rows tested here --------------------------------------------------------------

def test_every_exception_derives_from_deviceop_error():
    for name in exported_exceptions():
        assert issubclass(getattr(dop, name), dop.DeviceOpError)
    assert issubclass(dop.ShapeError, ValueError) and issubclass(dop.DTypeError, TypeError)
    assert issubclass(dop.OutOfMemoryError, dop.CudaError) and issubclass(dop.KernelFaultError, dop.CudaError)
    assert issubclass(dop.GraphSafetyError, dop.CaptureError) and issubclass(dop.GraphUpdateError, dop.CaptureError)


def test_shape_errors_say_which_shape_fits(stream):
    t = dop.empty(256, stream=stream)
    with pytest.raises(dop.ShapeError, match="tile .100,. does not divide tensor shape .256,.*pick a tile size"):
        t.partition([100])
    with pytest.raises(dop.ShapeError, match="holds 12 elements but the tensor has 256"):
        t.view([3, 4])
    with pytest.raises(dop.ShapeError, match=r"cannot view the non-contiguous tensor .*make a contiguous copy"):
        dop.empty([4, 64], stream=stream)[:, ::2].view([128])
    x, w = dop.empty([1, 256], stream=stream), dop.empty([128, 256], stream=stream)
    with pytest.raises(dop.ShapeError, match=r"matvec<BN=16>: partition out with \[16\], not \[32\]"):
        matvec(dop.empty(128, stream=stream).partition([32]), x, w).generics([16, 2, 256]).sync_on(stream)
    with pytest.raises(dop.ShapeError, match="memcpy from .256,. .256 elements. into .128,."):
        api.memcpy(dop.empty(128, stream=stream), t)


def test_dtype_errors_name_the_argument_and_the_type(stream):
    a, out = dop.empty(256, stream=stream), dop.empty(256, stream=stream)
    with pytest.raises(dop.DTypeError, match="argument b of add must be float32, got a int32 tensor"):
        add(out.partition([128]), a, dop.empty(256, "int32", stream=stream))
    with pytest.raises(dop.DTypeError, match="argument alpha of affine"):
        affine(out.partition([128]), a, "two", 0.0)
    with pytest.raises(dop.DTypeError, match="dtypes must match"):
        api.memcpy(out, dop.empty(256, "int32", stream=stream))


def test_launch_errors_show_the_signature(stream):
    a, out = dop.empty(256, stream=stream), dop.empty(256, stream=stream)
    with pytest.raises(dop.LaunchError, match=r"add takes 3 arguments \(out: out float32 \[N\] tile \[B\], "
                                              r"a: float32 \[N\]"):
        add(out.partition([128]), a)
    x, w = dop.empty([1, 256], stream=stream), dop.empty([256], stream=stream)  # BS is in no shape: say it
    with pytest.raises(dop.LaunchError, match=r"needs generics <D, BS>: call \.generics\(\[\.\.\.\]\)"):
        rms_norm(dop.empty([1, 256], stream=stream).partition([1, 256]), x, w, 1e-5).sync_on(stream)
    with pytest.raises(dop.LaunchError, match="must be a Partition .* pass tensor.partition"):
        add(out, a, a)
    with pytest.raises(dop.LaunchError, match="at most 1024"):
        dop.LaunchConfig(grid=1, block=2048)


def test_capture_on_a_stream_that_is_capturing_is_refused(device):
    """Another thread holds a capture open on the stream; capturing there too is refused,
    and the first capture is not disturbed."""
    stream = device.new_stream()
    opened, release = threading.Event(), threading.Event()
    x, y = dop.empty(256, stream=stream), dop.empty(256, stream=stream)
    result = {}

    def hold(_):
        opened.set()
        release.wait(60)

    def first():
        graph = zip_(dop.value(None).inspect(hold), affine(y.partition([128]), x, 2.0, 0.0).generics([128])) \
            .graph_on(stream)
        result["graph"] = graph

    t = threading.Thread(target=first)
    t.start()
    assert opened.wait(60)
    try:
        with pytest.raises(dop.CaptureError, match="already capturing; end that capture first"):
            affine(y.partition([128]), x, 3.0, 0.0).generics([128]).graph_on(stream)
        with pytest.raises(dop.CaptureError, match="already capturing"):
            CudaGraph.scope(stream, lambda s: None)
    finally:
        release.set()
        t.join(60)
    assert not stream.is_capturing()
    api.memcpy(x, dop.from_numpy(np.arange(256, dtype=np.float32), stream=stream)).sync_on(stream)
    result["graph"].launch().sync_on(stream)  # the first capture completed normally
    np.testing.assert_array_equal(y.numpy(stream=stream), 2 * np.arange(256))


def test_state_errors_say_how_to_get_a_usable_object(stream, rng):
    # a holds data (dop.empty's uninitialized memory may overflow in the reference's float64 sum)
    a, out = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream), dop.empty(256, stream=stream)
    op = add(out.partition([128]), a, a).generics([128])
    op.sync_on(stream)
    with pytest.raises(dop.StateError, match="already executed.*Build it again, or make it .shared"):
        op.sync_on(stream)
    graph = affine(out.partition([128]), a, 1.0, 0.0).generics([128]).graph_on(stream)
    graph.close()
    with pytest.raises(dop.StateError, match="closed; capture a new one"):
        graph.replay()
    handle = a.into_shared()
    handle.release()
    with pytest.raises(dop.StateError, match="released"):
        handle.tensor
