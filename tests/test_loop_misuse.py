"""Loops and branches used wrongly: each mistake is refused with a deviceop error
before anything runs (eagerly and captured alike), and an odd but valid control
cell (int32 of shape [1, 1]) works as a [1] one does, as it does on a GPU (the
control kernel reads one int through a pointer)."""
import numpy as np
import pytest

import deviceop as dop
from deviceop import api
from deviceop.kernels import affine


def _cell(v, stream, shape=(1,)):
    return dop.from_numpy(np.full(shape, v, np.int32), stream=stream)


def _scaled(y, x, a):
    return affine(y.partition([128]), x, a, 0.0).generics([128])


@pytest.mark.parametrize("captured", [False, True])
def test_control_cells_of_shape_1x1_work_like_shape_1(stream, rng, captured):
    x = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    y = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    z = dop.empty([256], stream=stream)
    index, count = _cell(0, stream, (1, 1)), _cell(3, stream, (1, 1))
    pick, flag = _cell(1, stream, (1, 1)), _cell(0, stream, (1, 1))
    op = dop.zip_(dop.loop(count, index, lambda i: api.memcpy(y, x)),       # y = x (3 times)
                  dop.switch(pick, [lambda: _scaled(y, x, 5.0), lambda: _scaled(z, y, 2.0)]),  # z = 2x
                  dop.if_(flag, lambda: _scaled(y, z, 7.0), lambda: _scaled(y, z, 3.0)))       # y = 6x
    if captured:
        op.graph_on(stream).replay()
    else:
        op.sync_on(stream)
    stream.synchronize()
    assert index.numpy(stream=stream).flat[0] == 3
    assert np.allclose(y.numpy(stream=stream), 6 * x.numpy(stream=stream), rtol=1e-5)


@pytest.mark.parametrize("make", [
    lambda c, i, b: dop.loop(c, i, b),
    lambda c, i, b: dop.while_(c, b),
    lambda c, i, b: dop.if_(c, b),
    lambda c, i, b: dop.switch(c, [b, b]),  # the cell (1) picks branch 1
])
@pytest.mark.parametrize("captured", [False, True])
def test_a_body_that_returns_no_op_is_refused(stream, make, captured):
    ran = []
    op = make(_cell(1, stream), _cell(0, stream), lambda *i: ran.append(1))  # a missing `return`
    with pytest.raises(dop.LaunchError, match="returned NoneType, not an op"):
        op.graph_on(stream) if captured else op.sync_on(stream)
    assert len(ran) <= 1  # built once, to be checked, and refused before any iteration


def test_a_body_of_the_wrong_arity_is_refused_when_the_loop_is_built(stream):
    y = dop.empty([128], stream=stream)
    with pytest.raises(dop.LaunchError, match="called with 1 argument"):
        dop.loop(2, _cell(0, stream), lambda: api.fill(y, 1.0))
    with pytest.raises(dop.LaunchError, match="called with 0 argument"):
        dop.while_(_cell(0, stream), lambda i: api.fill(y, 1.0))
    with pytest.raises(dop.LaunchError, match="called with 0 argument"):
        dop.switch(_cell(0, stream), [lambda: api.fill(y, 1.0), lambda i: api.fill(y, 2.0)])
    dop.loop(1, _cell(0, stream), lambda *a, **k: api.fill(y, 1.0)).sync_on(stream)  # any fitting signature runs


def test_a_float_count_is_refused_naming_int(stream):
    with pytest.raises(dop.DTypeError, match="float 2.5"):
        dop.loop(2.5, _cell(0, stream), lambda i: dop.zip_())


@pytest.mark.parametrize("loop", ["loop", "while_"])
@pytest.mark.parametrize("captured", [False, True])
@pytest.mark.parametrize("prebuilt", ["op", "shared source"])
def test_a_body_holding_an_op_built_before_it_is_refused(stream, rng, loop, captured, prebuilt):
    # Captured, such an op would run at every iteration; eagerly it runs once (an op
    # describes one execution), so the two modes would part: both refuse it up front.
    x = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    y = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    before = y.numpy(stream=stream)
    early = _scaled(y, x, 2.0) if prebuilt == "op" else _scaled(y, x, 2.0).shared()
    body = (lambda *i: early) if prebuilt == "op" else (lambda *i: dop.zip_(early.clone(), _scaled(y, x, 3.0)))
    op = dop.loop(3, _cell(0, stream), body) if loop == "loop" else dop.while_(_cell(1, stream), body)
    with pytest.raises(dop.LaunchError, match="built before the body function was called"):
        op.graph_on(stream) if captured else op.sync_on(stream)
    assert not stream.is_capturing()
    np.testing.assert_array_equal(y.numpy(stream=stream), before)  # no iteration ran


@pytest.mark.parametrize("captured", [False, True])
def test_a_shared_op_that_already_ran_is_a_value_a_body_may_hold(stream, rng, captured):
    x = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    y, z = dop.empty([256], stream=stream), dop.empty([256], stream=stream)
    done = _scaled(y, x, 2.0).shared()
    done.clone().sync_on(stream)  # y = 2x, once
    op = dop.loop(3, _cell(0, stream), lambda i: dop.zip_(done.clone(), api.memcpy(z, y)))
    op.graph_on(stream).replay() if captured else op.sync_on(stream)
    stream.synchronize()
    np.testing.assert_allclose(z.numpy(stream=stream), 2 * x.numpy(stream=stream), rtol=1e-6)


@pytest.mark.parametrize("captured", [False, True])
def test_a_shared_op_not_yet_run_in_a_body_is_refused_naming_the_run_that_makes_it_a_value(stream, rng, captured):
    # the body builds the clone (w.clone()); what was built before is the shared op's source, so the
    # fix is to run it before the loop, not "build your ops in the function" (they are)
    x = dop.from_numpy(rng.standard_normal(256).astype(np.float32), stream=stream)
    y, z = dop.empty([256], stream=stream), dop.empty([256], stream=stream)
    w = _scaled(y, x, 2.0).shared()
    op = dop.loop(3, _cell(0, stream), lambda i: dop.zip_(w.clone(), api.memcpy(z, y)))
    with pytest.raises(dop.LaunchError, match=r"holds shared\(affine<128>\), which has not run.*Run it "
                                              r"before the loop \(e.g. shared.clone\(\).sync_on\(stream\)\)"):
        op.graph_on(stream) if captured else op.sync_on(stream)
    w.clone().sync_on(stream)  # the fix: now a value the body may hold
    op = dop.loop(3, _cell(0, stream), lambda i: dop.zip_(w.clone(), api.memcpy(z, y)))
    op.graph_on(stream).replay() if captured else op.sync_on(stream)
    stream.synchronize()
    np.testing.assert_allclose(z.numpy(stream=stream), 2 * x.numpy(stream=stream), rtol=1e-6)
