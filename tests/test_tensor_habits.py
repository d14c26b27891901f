"""A CuPy/NumPy/PyTorch user's habits on a Tensor: len, iteration,
indexing past the end, copy/pickle, NumPy dtype spellings, 0-d host arrays.
Each either works as those libraries do or is refused with a deviceop error."""
import copy
import pickle

import numpy as np
import pytest

import deviceop as dop


def test_len_and_iteration_walk_the_first_dimension(rng):
    host = rng.standard_normal((3, 4)).astype(np.float32)
    t = dop.from_numpy(host)
    assert len(t) == 3
    rows = list(t)
    assert len(rows) == 3 and all(r.shape == (4,) for r in rows)
    np.testing.assert_array_equal(np.stack([r.numpy() for r in rows]), host)
    with pytest.raises(dop.ShapeError, match="0-d tensor"):
        len(dop.empty([]))
    with pytest.raises(dop.StateError, match=r"value in tensor\.numpy\(\)"):
        host[1, 2] in t  # (was False: it compared the rows' objects)
    assert dop.empty([]) and dop.empty([0, 3])  # truth stays an object's: `out or default` keeps `out`


def test_out_of_range_and_mask_indices_are_shape_errors(rng):
    t = dop.from_numpy(rng.standard_normal((3, 4)).astype(np.float32))
    with pytest.raises(dop.ShapeError, match="out of bounds"):
        t[5]
    with pytest.raises(dop.ShapeError, match="too many indices"):
        t[1, 2, 3]
    with pytest.raises(dop.ShapeError, match="got bool"):  # NumPy's mask index: a copy, not a view
        t[True]
    assert t[-1, ::-2].numpy().tolist() == t.numpy()[-1, ::-2].tolist()


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, pickle.dumps])
def test_copying_or_pickling_a_tensor_is_refused(rng, how):
    t = dop.from_numpy(rng.standard_normal(4).astype(np.float32))
    with pytest.raises(dop.StateError, match=r"api\.dup\(tensor\)"):
        how(t)


@pytest.mark.parametrize("spec, name", [("f4", "float32"), ("<f2", "float16"), ("float", "float64"),
                                        ("int", "int64"), ("u1", "uint8"), ("?", "bool")])
def test_numpy_dtype_strings_are_understood(spec, name):
    assert dop.empty([2], dtype=spec).dtype is dop.dtype(name)


def test_unknown_and_unsupported_dtype_strings_are_refused():
    with pytest.raises(dop.DTypeError, match="unknown dtype 'float33'"):
        dop.empty([2], dtype="float33")
    with pytest.raises(dop.DTypeError, match="complex64 is not supported"):
        dop.empty([2], dtype="complex64")


def test_a_0d_host_array_makes_a_0d_tensor(rng):
    v = np.float32(rng.standard_normal())
    t = dop.from_numpy(v)
    assert t.shape == () and t.numpy().shape == () and t.numpy() == v
    t16 = dop.from_numpy(np.array(3.0), dtype="float16")  # the converting path too
    assert t16.shape == () and t16.numpy() == np.float16(3.0)


def test_copy_of_a_shared_handle_is_a_counted_clone(rng):
    handle = dop.from_numpy(rng.standard_normal(4).astype(np.float32)).into_shared()
    twin = copy.copy(handle)
    assert handle.live_handles == 2
    with pytest.raises(dop.OwnershipError, match="1 other live"):
        handle.try_partition([2])  # the copy still reaches the buffer
    twin.release()
    del twin
    assert handle.live_handles == 1 and handle.try_partition([2]).tensor.shape == (4,)
    other = dop.empty([2]).into_shared()
    for how in (copy.deepcopy, pickle.dumps):
        with pytest.raises(dop.StateError, match="SharedTensor"):
            how(other)


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, pickle.dumps])
def test_copying_or_pickling_an_op_is_refused(rng, how):
    from deviceop import api
    op = api.randn([4], seed=int(rng.integers(1 << 30)))
    with pytest.raises(dop.StateError, match="an op runs once"):
        how(op)
    stream = dop.Device().new_stream()
    assert op.sync_on(stream).shape == (4,)  # the refusal left the op usable


def test_streams_events_and_graphs_copy_as_themselves_and_refuse_pickling(rng):
    from deviceop import api
    stream = dop.Device().new_stream()
    host = rng.standard_normal(4).astype(np.float32)
    src, dst = dop.from_numpy(host), dop.empty([4])
    graph = api.memcpy(dst, src).graph_on(stream)
    event = stream.record_event()
    for handle in (stream, event, graph):
        assert copy.copy(handle) is handle and copy.deepcopy({"h": handle})["h"] is handle
        with pytest.raises(dop.StateError, match=f"pickling a {type(handle).__name__}"):
            pickle.dumps(handle)
    copy.deepcopy(graph).replay(stream)  # the same graph, still usable
    np.testing.assert_array_equal(dst.numpy(stream=stream), host)


def test_a_cuda_array_interface_import_of_host_data_is_refused_on_either_device(rng):
    host = rng.standard_normal(3)
    for obj in (host, host.tolist()):  # on a GPU CuPy alone would copy it: no zero-copy view
        with pytest.raises(dop.DTypeError, match=r"no __cuda_array_interface__.*dop\.from_numpy"):
            dop.Tensor.from_cuda_array_interface(obj)


@pytest.mark.parametrize("pick", ["first", "last"])
def test_first_and_last_of_an_op_producing_a_tensor_are_refused(rng, pick):
    from deviceop import api
    stream = dop.Device().new_stream()
    op = getattr(api.randn([4], seed=int(rng.integers(1 << 30))), pick)()
    with pytest.raises(dop.ShapeError, match=f"{pick}\\(\\) needs an op producing a tuple"):
        op.sync_on(stream)  # (was the tensor's element 0 / -1, silently)


@pytest.mark.parametrize("combinator", ["map", "then", "inspect"])
def test_a_combinator_given_no_function_is_refused_when_built(combinator):
    from deviceop import api
    op = api.randn([4], seed=0)
    with pytest.raises(dop.LaunchError, match=f"op.{combinator}\\(f\\) takes a function"):
        getattr(op, combinator)(3)  # (was a raw TypeError when the op ran)
    op.discard()
