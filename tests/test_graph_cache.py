"""GraphCache: graphs keyed by padded batch size, eager fallback, LRU bounds.

The function under test is one batched matvec, y[b] = W x[b] (rows are
independent, as padding requires).  Device-agnostic: on the reference device
the graphs are tapes; under gpu-check they are CUDA graphs.
"""
import threading

import numpy as np
import pytest

import deviceop as dop
from deviceop import GraphCache, default_sizes
from deviceop.kernels import batch_tile, matvec_batched

K, N, BN, BK = 256, 128, 16, 2


@pytest.fixture
def weights(stream, rng):
    w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
    return w, dop.from_numpy(w, stream=stream)


def make_forward(w, calls=None):
    def forward(ws, x):
        if calls is not None:
            calls.append(ws.size)
        y = ws.empty([ws.size, N])
        mb = batch_tile(ws.size)
        return matvec_batched(y.partition([mb, BN]), x, w).generics([BN, BK, K, mb]).first().unpartition()
    return forward


def batch_of(rng, b, stream):
    xs = rng.standard_normal((b, K)).astype(np.float32)
    return xs, dop.from_numpy(xs, stream=stream)


def close(got, xs, w):
    ref = xs.astype(np.float64) @ w.astype(np.float64).T
    return got.shape == ref.shape and np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))


def test_default_sizes_are_fine_at_small_batches_and_coarse_at_large():
    assert default_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_sizes(256)[-6:] == (112, 128, 160, 192, 224, 256)
    assert default_sizes(300)[-1] == 300 and default_sizes(3) == (1, 2, 3)


def test_batches_are_padded_to_a_captured_size_and_sliced_back(stream, weights, rng):
    w, wt = weights
    calls = []
    cache = GraphCache(make_forward(wt, calls), stream=stream, max_size=16)
    for b in [1, 3, 5, 8, 3, 13, 16, 5]:
        xs, x = batch_of(rng, b, stream)
        y = cache(x)
        assert y.shape == (b, N)                        # padded rows are never visible
        assert close(y.numpy(), xs, w)
    assert calls == [1, 4, 8, 16]                       # one capture per size used
    s = cache.stats
    assert (s.captures, s.misses, s.hits, s.fallbacks, s.graphs) == (4, 4, 4, 0, 4)


def test_padding_rows_are_zeroed_in_the_graphs_input(stream, weights, rng):
    _, wt = weights
    cache = GraphCache(make_forward(wt), stream=stream, sizes=[8])
    xs, x = batch_of(rng, 8, stream)
    cache(x)
    xs, x = batch_of(rng, 3, stream)
    cache(x)
    (entry,) = cache._entries.values()
    staged = entry.inputs[0].numpy()
    assert np.array_equal(staged[:3], xs) and np.all(staged[3:] == 0)


def test_eager_fallback_above_the_largest_size_or_on_request(stream, weights, rng):
    w, wt = weights
    cache = GraphCache(make_forward(wt), stream=stream, sizes=[1, 2, 4])
    xs, x = batch_of(rng, 6, stream)
    assert close(cache(x).numpy(), xs, w)
    xs, x = batch_of(rng, 2, stream)
    assert close(cache(x, eager=True).numpy(), xs, w)
    assert cache.stats.fallbacks == 2 and cache.stats.captures == 0
    strict = GraphCache(make_forward(wt), stream=stream, sizes=[1, 2, 4], fallback=False)
    with pytest.raises(dop.ShapeError, match="batch 6 is above every captured size .largest 4."):
        strict(batch_of(rng, 6, stream)[1])


def test_lru_eviction_by_count_closes_the_graph(stream, weights, rng):
    w, wt = weights
    cache = GraphCache(make_forward(wt), stream=stream, sizes=[1, 2, 4], max_graphs=2, share_buffers=False)
    for b in (1, 2):
        cache(batch_of(rng, b, stream)[1])
    first = next(e.graph for k, e in cache._entries.items() if k[0] == 1)
    second = next(e.graph for k, e in cache._entries.items() if k[0] == 2)
    cache(batch_of(rng, 1, stream)[1])                  # size 1 is now the most recently used
    cache(batch_of(rng, 4, stream)[1])                  # evicts size 2
    assert sorted(k[0] for k in cache._entries) == [1, 4] and cache.stats.evictions == 1
    assert second._closed and not first._closed        # the evicted graph is closed, the used one kept
    xs, x = batch_of(rng, 2, stream)
    assert close(cache(x).numpy(), xs, w)               # recaptured on demand
    assert cache.stats.captures == 4 and len(cache) == 2


def test_eviction_by_bytes(stream, weights, rng):
    _, wt = weights
    one = (4 * K + 4 * N) * 4                         # bytes of the size-4 graph's buffers
    cache = GraphCache(make_forward(wt), stream=stream, sizes=[4], key=lambda x: x.shape[1:],
                       max_bytes=one, share_buffers=False)
    cache(batch_of(rng, 4, stream)[1])
    assert cache.stats.bytes == one
    cache2 = GraphCache(make_forward(wt), stream=stream, sizes=[2, 4], max_bytes=one, share_buffers=False)
    cache2(batch_of(rng, 4, stream)[1])
    cache2(batch_of(rng, 2, stream)[1])                 # together over the bound: size 4 goes
    assert [k[0] for k in cache2._entries] == [2] and cache2.stats.bytes <= one


def test_warmup_captures_largest_first_into_shared_buffers(stream, weights, rng):
    w, wt = weights
    calls = []
    shared = GraphCache(make_forward(wt, calls), stream=stream, max_size=32)
    x = batch_of(rng, 1, stream)[1]
    assert shared.warmup(x) == len(shared.sizes)
    assert calls == sorted(shared.sizes, reverse=True)
    largest_alone = (32 * K + 32 * N) * 4
    assert shared.stats.bytes == largest_alone         # every graph views the largest one's buffers
    private = GraphCache(make_forward(wt), stream=stream, max_size=32, share_buffers=False)
    private.warmup(x)
    assert private.stats.bytes == sum((s * K + s * N) * 4 for s in private.sizes)
    for b in (1, 7, 32, 19):                             # shared buffers are still correct
        xs, xb = batch_of(rng, b, stream)
        assert close(shared(xb).numpy(), xs, w)


@pytest.mark.parametrize("cls", [GraphCache, dop.SwitchGraphCache])
def test_warmup_sizes_size_for_and_eager_of_the_wrong_kind_are_refused_before_any_capture(cls, stream, weights, rng):
    _, wt = weights
    calls = []
    cache = cls(make_forward(wt, calls), stream=stream, sizes=[2, 4])
    x = batch_of(rng, 1, stream)[1]
    for sizes, says in ((4, r"sizes is a list of batch sizes .ints >= 1., got 4"),
                        (["4"], r"capture size '4' in sizes must be an int >= 1"),
                        ([4, 3], r"size.s. \[3\] are not among the cache's sizes \(2, 4\)")):  # 4 was captured first
        with pytest.raises(dop.ShapeError, match=says):
            cache.warmup(x, sizes=sizes)
    assert calls == [] and len(cache) == 0 and not stream.is_capturing()
    for batch in ("3", 0, 2.0, None):
        with pytest.raises(dop.ShapeError, match="a batch must be an int >= 1"):
            cache.size_for(batch)
    assert cache.size_for(3) == 4 and cache.size_for(np.int64(5)) is None
    with pytest.raises(dop.LaunchError, match="eager= is True or False .* got 'no'"):
        cache(x, eager="no")                             # 'no' is truthy: it ran eagerly
    assert calls == [] and cache.stats.fallbacks == 0
    assert cache.warmup(x, sizes=(4, np.int64(2), 4)) == (2 if cls is GraphCache else 1)


def test_key_function_selects_graphs_and_mismatches_are_caught(stream, rng):
    calls = []
    by_width = {}
    for k in (256, 512):
        wk = (rng.standard_normal((N, k)) / np.sqrt(k)).astype(np.float32)
        by_width[k] = (wk, dop.from_numpy(wk, stream=stream))

    def forward(ws, x):
        calls.append((ws.size, ws.key))
        k = x.shape[1]
        y = ws.empty([ws.size, N])
        return matvec_batched(y.partition([1, BN]), x, by_width[k][1]).generics([BN, 2, k, 1]).first().unpartition()

    cache = GraphCache(forward, stream=stream, sizes=[4], key=lambda x: ("seq", x.shape[1]))
    for k in (256, 512, 256):
        xs = rng.standard_normal((3, k)).astype(np.float32)
        assert close(cache(dop.from_numpy(xs, stream=stream)).numpy(), xs, by_width[k][0])
    assert calls == [(4, ("seq", 256)), (4, ("seq", 512))]
    lax = GraphCache(forward, stream=stream, sizes=[4], key=lambda x: "one graph")
    lax(dop.from_numpy(np.ones((2, 256), np.float32), stream=stream))
    with pytest.raises(dop.ShapeError, match="include every shape and dtype"):
        lax(dop.from_numpy(np.ones((2, 512), np.float32), stream=stream))
    bad = GraphCache(forward, stream=stream, sizes=[4], key=lambda x: [x.shape])
    with pytest.raises(dop.StateError, match="hashable"):
        bad(dop.from_numpy(np.ones((2, 256), np.float32), stream=stream))


class _Incomparable:
    """A key whose == raises (as some user types do): it could never be looked up."""

    def __hash__(self):
        return 7

    def __eq__(self, other):
        raise RuntimeError("cannot compare")


@pytest.mark.parametrize("key", [lambda x: float("nan"), lambda x: ("seq", float("nan")),
                                 lambda x: np.float32("nan"), lambda x: frozenset([float("nan")])],
                         ids=["nan", "nan-in-a-tuple", "numpy-nan", "nan-in-a-frozenset"])
def test_a_key_that_never_equals_itself_is_refused_not_recaptured_every_call(stream, weights, rng, key):
    _, wt = weights
    cache = GraphCache(make_forward(wt), stream=stream, sizes=[4], key=key)
    for _ in range(3):  # before the fix each call captured (and held) another graph
        with pytest.raises(dop.StateError, match="does not equal itself .NaN never does.*would never hit"):
            cache(batch_of(rng, 2, stream)[1])
    assert len(cache) == 0 and cache.stats.captures == 0


def test_a_key_unequal_to_its_own_copy_is_refused_on_its_second_call(stream, weights, rng):
    """A frozen dataclass holding a fresh NaN equals itself (same object) but no later
    key: the second call finds a held key that prints the same and does not equal it."""
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Key:
        scale: float

    _, wt = weights
    cache = GraphCache(make_forward(wt), stream=stream, sizes=[4], key=lambda x: Key(float("nan")))
    cache(batch_of(rng, 2, stream)[1])
    for _ in range(3):
        with pytest.raises(dop.StateError, match=r"does not equal the key .*Key\(scale=nan\).* held graph"):
            cache(batch_of(rng, 3, stream)[1])
    assert len(cache) == 1 and cache.stats.captures == 1


def test_a_key_whose_comparison_raises_is_refused(stream, weights, rng):
    _, wt = weights
    cache = GraphCache(make_forward(wt), stream=stream, sizes=[4], key=lambda x: _Incomparable())
    for _ in range(2):
        with pytest.raises(dop.StateError, match="cannot compare.*must return a hashable key that equals itself"):
            cache(batch_of(rng, 2, stream)[1])
    assert len(cache) == 0


class _Mode:
    """Compared (and hashed) by identity, as any class without __eq__."""


@pytest.mark.parametrize("cls", [GraphCache, dop.SwitchGraphCache])
@pytest.mark.parametrize("make_key", [lambda x: _Mode(), lambda x: ("decode", object()), lambda x: x],
                         ids=["instance", "object-in-tuple", "tensor"])
def test_a_key_made_anew_by_each_call_and_compared_by_identity_is_refused(stream, weights, rng, cls, make_key):
    # before the fix every call captured and held another graph (5 calls, 5 graphs: unbounded)
    _, wt = weights
    cache = cls(make_forward(wt), stream=stream, sizes=[4], key=make_key)
    cache(batch_of(rng, 2, stream)[1])
    for _ in range(3):
        with pytest.raises(dop.StateError, match="held graph.*identity.*made anew by each call"):
            cache(batch_of(rng, 2, stream)[1])        # (a tensor prints its shape: the same one here)
    assert len(cache) == 1 and cache.stats.captures == 1
    same = _Mode()                              # the same object each call hits, as any key that equals itself
    cache = cls(make_forward(wt), stream=stream, sizes=[4], key=lambda x: same)
    for b in (1, 3, 4):
        cache(batch_of(rng, b, stream)[1])
    assert cache.stats.captures == 1


class _Drifting:
    """A key whose hash changes at every hash (it hashes a counter), equal to any other."""
    hashes = 0

    def __hash__(self):
        _Drifting.hashes += 1
        return _Drifting.hashes

    def __eq__(self, other):
        return isinstance(other, _Drifting)


@pytest.mark.parametrize("cls", [GraphCache, dop.SwitchGraphCache])
def test_a_key_whose_hash_changes_is_refused_not_lost_in_the_cache(stream, weights, rng, cls):
    # before the fix the graph was stored under one hash and looked up under another: a raw
    # KeyError from the cache's own dict at the second call, and the cache broken for good
    _, wt = weights
    cache = cls(make_forward(wt), stream=stream, sizes=[4], key=lambda x: _Drifting())
    for _ in range(2):
        with pytest.raises(dop.StateError, match="hashes to another value.*return a key whose hash is fixed"):
            cache(batch_of(rng, 2, stream)[1])
    assert len(cache) == 0 and cache.stats.captures == 0


def test_options_are_checked_when_the_cache_is_made(device, stream, weights):
    _, wt = weights
    forward = make_forward(wt)
    for max_bytes in ("100", 0, -1, 2.5, True):
        with pytest.raises(dop.ShapeError, match="max_bytes .or None. must be an int >= 1"):
            GraphCache(forward, stream=stream, max_bytes=max_bytes)
    for not_a_stream in (None, 0, "stream"):
        with pytest.raises(dop.LaunchError, match="GraphCache.* needs a deviceop stream"):
            GraphCache(forward, stream=not_a_stream)
    closed = device.new_stream()
    closed.close()
    with pytest.raises(dop.StateError, match="closed"):
        GraphCache(forward, stream=closed)
    for pad_value in ("x", True, [0], 1j):
        with pytest.raises(dop.DTypeError, match="pad_value must be a number .or None"):
            GraphCache(forward, stream=stream, pad_value=pad_value)
    for flag in ("fallback", "share_buffers", "copy"):
        with pytest.raises(dop.LaunchError, match=f"{flag} must be True or False, got 'no'"):
            GraphCache(forward, stream=stream, **{flag: "no"})
    with pytest.raises(dop.LaunchError, match="GraphCache's function must be callable"):
        GraphCache("forward", stream=stream)
    with pytest.raises(dop.LaunchError, match="key must be a callable .or None"):
        GraphCache(forward, stream=stream, key=("seq", 1))
    made = GraphCache(forward, stream=stream, max_bytes=np.int64(1 << 20), pad_value=np.float32(-1))
    assert made.max_bytes == 1 << 20


@pytest.mark.parametrize("cls", [GraphCache, dop.SwitchGraphCache])
def test_a_function_that_cannot_take_the_inputs_is_refused_naming_its_signature(stream, weights, rng, cls):
    # before the fix: a raw TypeError ("takes 1 positional argument but 2 were given") from inside the capture
    w, wt = weights
    for eager in (False, True):
        cache = cls(lambda x: x, stream=stream, sizes=[4])
        with pytest.raises(dop.LaunchError, match=r"function <lambda>\(x\) cannot be called as "
                                                  r"function\(ws, inputs\[0\]\).*def fn\(ws, x, ...\)"):
            cache(batch_of(rng, 3, stream)[1], eager=eager)
        assert len(cache) == 0
    cache = cls(make_forward(wt), stream=stream, sizes=[4])   # a fitting function still runs
    xs, x = batch_of(rng, 3, stream)
    assert close(cache(x).numpy(), xs, w)


@pytest.mark.parametrize("cls", [GraphCache, dop.SwitchGraphCache])
def test_a_shared_tensor_handle_is_an_input_as_a_kernel_reads_it(stream, weights, rng, cls):
    # before the fix: DTypeError "input 0 must be a deviceop Tensor, got SharedTensor", which kernels
    # and GraphModel take as a read
    w, wt = weights
    cache = cls(make_forward(wt), stream=stream, sizes=[2, 4])
    xs, x = batch_of(rng, 3, stream)
    handle = x.into_shared()
    assert cache.warmup(handle) >= 1
    assert close(cache(handle).numpy(), xs, w) and close(cache(handle, eager=True).numpy(), xs, w)
    handle.release()
    with pytest.raises(dop.StateError, match="released"):
        cache(handle)


@pytest.mark.parametrize("cls", [GraphCache, dop.SwitchGraphCache])
def test_a_function_that_writes_its_input_leaves_the_callers_tensor_alone_eager_or_replayed(stream, rng, cls):
    # a replay's function writes the graph's copy of the input; before the fix the eager path
    # (eager=True, or a batch above every size) handed the function the caller's tensor itself
    def forward(ws, x):  # copy x out, then zero x in place
        out = ws.empty([ws.size, 8])
        return dop.api.memcpy(out, x).then(lambda o: dop.api.fill(x, 0.0).map(lambda _: o))

    cache = cls(forward, stream=stream, sizes=[4])
    for b, eager in ((3, False), (3, True), (5, False)):
        xs = rng.standard_normal((b, 8)).astype(np.float32)
        x = dop.from_numpy(xs, stream=stream)
        y = cache(x, eager=eager)
        assert np.array_equal(y.numpy(), xs) and np.array_equal(x.numpy(), xs)
    assert cache.stats.fallbacks == 2


def test_a_pad_value_the_inputs_dtype_cannot_hold_is_refused_before_any_capture(stream, rng):
    def forward(ws, x):  # int8 rows copied through: the padding is visible in the graph's input
        return dop.api.memcpy(ws.empty([ws.size, 8], "int8"), x)

    cache = GraphCache(forward, stream=stream, sizes=[4], pad_value=300)
    for batch in (2, 4):  # a full batch too: the cache's inputs can never hold its padding
        with pytest.raises(dop.DTypeError, match="pad_value 300 does not fit GraphCache input 0 .int8.*-128, 127"):
            cache(dop.from_numpy(rng.integers(-100, 100, (batch, 8)).astype(np.int8), stream=stream))
    assert len(cache) == 0 and cache.stats.captures == 0
    fits = rng.integers(-100, 100, (2, 8)).astype(np.int8)
    padded = GraphCache(forward, stream=stream, sizes=[4], pad_value=-7)
    np.testing.assert_array_equal(padded(dop.from_numpy(fits, stream=stream)).numpy(stream=stream), fits)
    graph_input = next(iter(padded._entries.values())).inputs[0].numpy(stream=stream)
    np.testing.assert_array_equal(graph_input[2:], -7)


def test_a_negative_zero_pad_value_pads_negative_zeros(stream, rng):
    def forward(ws, x):
        return dop.api.memcpy(ws.empty([ws.size, 8]), x)

    cache = GraphCache(forward, stream=stream, sizes=[4], pad_value=-0.0)
    cache(dop.from_numpy(rng.standard_normal((1, 8)).astype(np.float32), stream=stream))
    graph_input = next(iter(cache._entries.values())).inputs[0].numpy(stream=stream)
    assert np.all(graph_input[1:] == 0) and np.all(np.signbit(graph_input[1:]))


def test_a_function_that_cannot_handle_a_key_leaves_the_cache_usable(stream, weights, rng):
    w, wt = weights
    forward = make_forward(wt)

    def picky(ws, x):
        if ws.size > 4:
            raise ValueError("this model is only defined up to 4 rows")
        return forward(ws, x)

    cache = GraphCache(picky, stream=stream, sizes=[2, 8])
    with pytest.raises(ValueError, match="only defined") as info:
        cache(batch_of(rng, 5, stream)[1])
    assert any("GraphCache captured size 8" in n for n in info.value.__notes__)
    assert len(cache) == 0 and cache.stats.bytes == 0
    xs, x = batch_of(rng, 2, stream)
    assert close(cache(x).numpy(), xs, w)


def test_bad_inputs_and_outputs(stream, weights, rng):
    _, wt = weights
    cache = GraphCache(make_forward(wt), stream=stream, sizes=[4])
    with pytest.raises(dop.DTypeError, match="must be a deviceop Tensor"):
        cache(np.ones((2, K), np.float32))
    with pytest.raises(dop.ShapeError, match="at least one input"):
        cache()
    with pytest.raises(dop.ShapeError, match="share a batch"):
        cache(batch_of(rng, 2, stream)[1], batch_of(rng, 3, stream)[1])

    def reduces(ws, x):  # an output without the batch axis cannot be sliced back
        return make_forward(wt)(ws, x).reshape([-1])

    with pytest.raises(dop.ShapeError, match="keep the batch axis"):
        GraphCache(reduces, stream=stream, sizes=[4])(batch_of(rng, 2, stream)[1])
    cache.close()
    with pytest.raises(dop.StateError, match="closed"):
        cache(batch_of(rng, 2, stream)[1])


def test_threads_share_one_cache(stream, weights, rng):
    w, wt = weights
    cache = GraphCache(make_forward(wt), stream=stream, max_size=16, copy=True)
    inputs = [batch_of(rng, b, stream) for b in (1, 3, 5, 9, 16, 2, 7, 12)]
    results, errors = {}, []

    def worker(i):
        try:
            for j in range(i, len(inputs), 4):
                results[j] = cache(inputs[j][1])        # a fresh copy: later calls cannot touch it
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    stream.synchronize()
    assert all(close(results[j].numpy(), inputs[j][0], w) for j in range(len(inputs)))


@pytest.mark.gpu
@pytest.mark.parametrize("mb", [1, 2, 4, 8])
def test_matvec_batched_at_model_size(stream, rng, mb, device):
    """The token model's shape (K = N = 2048): float64-exact to 1e-5, and no register spills."""
    k = n = 2048
    w = (rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)
    xs = rng.standard_normal((8, k)).astype(np.float32)
    y = dop.empty([8, n], stream=stream)
    gen = [16, 16, k, mb]
    matvec_batched(y.partition([mb, 16]), dop.from_numpy(xs, stream=stream), dop.from_numpy(w, stream=stream)) \
        .generics(gen).sync_on(stream)
    ref = xs.astype(np.float64) @ w.astype(np.float64).T
    assert np.max(np.abs(y.numpy() - ref)) / np.max(np.abs(ref)) < 1e-5
    assert matvec_batched.function(device, tuple(gen)).attributes["local_bytes"] == 0


@pytest.mark.parametrize("kind", ["GraphCache", "SwitchGraphCache"])
@pytest.mark.parametrize("misuse", ["call", "warmup", "clear", "close"])
def test_a_function_that_calls_its_own_cache_is_refused_not_recursed(stream, weights, rng, kind, misuse):
    w, wd = weights
    inner = make_forward(wd)
    cache = None

    def forward(ws, x):   # the cache from inside its own capture: it would capture again, or drop its buffers
        {"call": cache, "warmup": cache.warmup}[misuse](x) if misuse in ("call", "warmup") else getattr(cache, misuse)()
        return inner(ws, x)
    cache = getattr(dop, kind)(forward, stream=stream, sizes=[4])
    xs, x = batch_of(rng, 3, stream)
    with pytest.raises(dop.ReentrancyError, match="from inside its own function"):
        cache(x)
    assert cache.stats.graphs == 0
    cache.fn = inner                    # the cache is still usable afterwards
    y = cache(x)
    stream.synchronize()
    assert close(y.numpy(), xs, w)


@pytest.mark.parametrize("shape", [[2.7, N], ["a"], None, [-1, N]])
def test_a_workspace_buffer_of_a_bad_shape_is_refused_as_dop_empty_refuses_it(stream, weights, rng, shape):
    w, wd = weights
    inner = make_forward(wd)

    def forward(ws, x):
        ws.empty(shape)                 # 2.7 was truncated to 2, -1 made a buffer of one element
        return inner(ws, x)
    cache = GraphCache(forward, stream=stream, sizes=[4])
    with pytest.raises(dop.ShapeError, match="shape"):
        cache(batch_of(rng, 3, stream)[1])
    assert cache.stats.graphs == 0
