"""Errors a new user meets first name the fix (issue 26, item 5)."""
import numpy as np
import pytest

import deviceop as dop
from deviceop import CudaGraph, api
from deviceop.kernels import add


def test_tensor_is_not_a_constructor_and_dop_zeros_exists(stream):
    with pytest.raises(dop.LaunchError, match=r"not a constructor.*dop\.zeros\(shape\)"):
        dop.Tensor([1, 2])
    z = dop.zeros([2, 3], "int32", stream=stream)   # the function the message names
    assert z.shape == (2, 3) and z.dtype is dop.int32
    assert np.array_equal(z.numpy(stream=stream), np.zeros((2, 3), np.int32))


def test_a_launch_passed_where_a_tensor_is_expected_names_first_unpartition(stream, rng):
    a = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    inner = add(dop.empty(256, stream=stream).partition([128]), a, a)
    outer = add(dop.empty(256, stream=stream).partition([128]), inner, a)
    with pytest.raises(dop.LaunchError, match=r"got tuple.*\.first\(\)\.unpartition\(\)"):
        outer.sync_on(stream)
    fixed = add(dop.empty(256, stream=stream).partition([128]),
                add(dop.empty(256, stream=stream).partition([128]), a, a).first().unpartition(), a)
    np.testing.assert_allclose(fixed.first().unpartition().sync_on(stream).numpy(stream=stream),
                               3 * a.numpy(stream=stream))


def test_an_ndarray_where_a_tensor_is_expected_names_from_numpy(stream, rng):
    xs = rng.standard_normal(256).astype(np.float32)
    t = dop.from_numpy(xs, stream=stream)
    with pytest.raises(dop.DTypeError, match=r"got ndarray; .*dop\.from_numpy\(array\)"):
        api.memcpy(t, xs)
    with pytest.raises(dop.LaunchError, match=r"got ndarray \(.*dop\.from_numpy\(array\)"):
        add(dop.empty(256, stream=stream).partition([128]), xs, t)
    graph = add(dop.empty(256, stream=stream).partition([128]), t, t).graph_on(stream)
    model = dop.GraphModel(graph, t, None)
    with pytest.raises(dop.DTypeError, match=r"dop\.from_numpy\(array\)"):
        model.forward(xs)


def test_sync_on_inside_a_scope_names_s_record(stream, rng):
    a = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)

    def body(s):
        add(dop.empty(256, stream=stream).partition([128]), a, a).sync_on(stream)

    with pytest.raises(dop.ReentrancyError, match=r"s\.record\(op\)"):
        CudaGraph.scope(stream, body)


def test_a_released_shared_tensor_says_how_to_get_a_fresh_handle(stream, rng):
    h = dop.from_numpy(rng.standard_normal(4).astype(np.float32), stream=stream).into_shared()
    h.release()
    with pytest.raises(dop.StateError, match=r"released.*\.clone\(\) of a live one.*into_shared\(\)"):
        h.clone()
