"""A cache of CUDA graphs keyed by shape, for work whose batch changes per call
(seed 003; what serving engines do for decode steps).

    def forward(ws, x):                        # x: [size, d], size = a captured batch size
        h = ws.empty([ws.size, d])             # scratch, shared between the cached graphs
        return some_kernel(h.partition(...), x, ...).first().unpartition()

    cache = GraphCache(forward, stream=stream, max_size=64)
    y = cache(x)                               # x: [5, d] -> replays the size-8 graph, y: [5, d]

* A call with batch ``b`` (axis 0 of every input) replays the graph captured
  for the smallest size >= b: the inputs are copied into that graph's input
  buffers, rows b.. are padded (zeros by default), and the outputs come back
  sliced to b rows — padded rows are never visible.  Every output must keep
  the batch axis; rows must not depend on each other (padding would leak).
* Sizes come from ``sizes``, or ``default_sizes(max_size)``: 1, 2, 4, then
  steps of 8, coarser above 64, as serving engines capture them.
* Beyond the largest size (or with ``eager=True``) the call runs eagerly
  instead (``fallback=False`` makes it a ShapeError).
* ``key(*inputs)`` names what else selects a graph (default: the inputs'
  shapes without the batch axis, and their dtypes) — e.g. a sequence length.
* Graphs are captured on first use, or all at once, largest first, by
  ``warmup``.  With ``share_buffers`` (the default) the buffers of
  ``ws.empty`` are views of one arena sized by the largest capture, so the
  whole cache costs about one graph's memory; they are scratch — state that
  must persist between calls belongs outside (pass it in, or close over it).
* Bounded by ``max_graphs`` and/or ``max_bytes``: the least recently used
  graph is evicted (closed, its private buffers released).
* Outputs are the graph's own buffers: valid until the next call on the cache
  (``copy=True`` returns fresh copies).  Calls are serialized by a lock, so
  the cache may be shared between threads.
"""
from __future__ import annotations

import bisect
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..dtypes import dtype as as_dtype
from ..errors import AliasingError, DTypeError, LaunchError, ReentrancyError, ShapeError, StateError
from ..interop import empty
from ..kernel.precompile import progress
from ..execution import executing_now, refuse_reentry
from ..foreign import refuse_uncallable
from ..op import DeviceOp
from ..runtime.stream import refuse_if_captured_elsewhere
from .cache_checks import check_new_key, check_options, check_pad, checked_key, count
from ..tensor import Partition, SharedTensor, Tensor, _shape_tuple


def default_sizes(max_size: int = 64) -> tuple[int, ...]:
    """1, 2, 4, then every 8 up to 64, every 16 to 128, every 32 to 256, every 64 beyond; max_size last."""
    max_size = count("max_size", max_size)
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 129, 16)) + list(range(160, 257, 32))
    sizes += list(range(320, max_size + 1, 64))
    sizes = [s for s in sizes if s <= max_size]
    if sizes[-1] != max_size:
        sizes.append(max_size)
    return tuple(sizes)


@dataclass
class CacheStats:
    """Counters of a GraphCache (a snapshot: ``cache.stats``)."""
    hits: int = 0
    misses: int = 0           # calls that had to capture a graph first
    captures: int = 0
    fallbacks: int = 0        # calls run eagerly (beyond the largest size, or asked for)
    evictions: int = 0
    graphs: int = 0           # graphs held now
    bytes: int = 0            # device bytes held now (inputs, scratch)
    capture_seconds: float = 0.0


class Workspace:
    """What the cache's function receives first: the padded ``size`` it builds
    for, the cache ``key``, and ``empty(shape, dtype)`` for its buffers."""

    def __init__(self, cache: "GraphCache", size: int, key, eager: bool):
        self.cache, self.size, self.key, self.eager = cache, size, key, eager
        self._count = 0
        self.buffers: list = []   # the arena slot behind every buffer handed out

    def empty(self, shape, dtype="float32") -> Tensor:
        """A buffer for this build: fresh when eager, else scratch of the cache."""
        dt = as_dtype(dtype)
        shape = _shape_tuple(shape)  # as dop.empty takes it: 2.7 is refused, not truncated
        if any(d < 0 for d in shape):
            raise ShapeError(f"negative size in shape {shape} (ws.empty of the GraphCache function, size {self.size})")
        index, self._count = self._count, self._count + 1
        if self.eager:
            return empty(shape, dt, device=self.cache.stream.device, stream=self.cache.stream)
        t, slot = self.cache._scratch(("scratch", index, dt), shape, dt)
        self.buffers.append(slot)
        return t


class _Entry:
    __slots__ = ("key", "size", "graph", "inputs", "outputs", "single", "slots", "views", "row_bytes")

    def __init__(self, key, size, graph, inputs, outputs, single, slots):
        self.key, self.size, self.graph = key, size, graph
        self.inputs, self.outputs, self.single, self.slots = inputs, outputs, single, slots
        self.views = {}  # batch -> the outputs sliced to it (made once)
        self.row_bytes = [t.nbytes // size for t in inputs]


class GraphCache:
    """Graphs of ``fn(ws, *inputs) -> op`` keyed by padded batch size and ``key`` (see the module docstring)."""

    def __init__(self, fn, *, stream, sizes=None, max_size: int = 64, key=None, max_graphs: int | None = None,
                 max_bytes: int | None = None, fallback: bool = True, share_buffers: bool = True,
                 pad_value: float | None = 0, copy: bool = False):
        check_options(fn, stream, key, pad_value, fallback=fallback, share_buffers=share_buffers, copy=copy)
        self.fn, self.stream, self.key_fn = fn, stream, key
        self.sizes = default_sizes(max_size) if sizes is None else _sizes_of(sizes)
        if max_graphs is not None:
            max_graphs = count("max_graphs (or None)", max_graphs)
        if max_bytes is not None:
            max_bytes = count("max_bytes (or None)", max_bytes)
        self.max_graphs, self.max_bytes = max_graphs, max_bytes
        self.fallback, self.share_buffers, self.pad_value, self.copy = fallback, share_buffers, pad_value, copy
        self._entries: OrderedDict = OrderedDict()  # (size, key) -> _Entry, least recently used first
        self._arena: dict = {}                      # slot key -> the largest buffer made for it
        self._lock = threading.RLock()
        self._pads_checked: set = set()             # input dtypes pad_value is known to fit
        self._stats = CacheStats()
        self._closed = False
        self._building = None                       # the size whose function runs now (on the lock's thread)

    # -- public --------------------------------------------------------------------
    @property
    def stats(self) -> CacheStats:
        with self._lock:
            s = CacheStats(**vars(self._stats))
            s.graphs, s.bytes = len(self._entries), self._held_bytes()
            return s

    def __len__(self) -> int:
        return len(self._entries)

    def size_for(self, batch: int) -> int | None:
        """The captured size a batch is padded to, or None above the largest."""
        i = bisect.bisect_left(self.sizes, count("a batch", batch))
        return self.sizes[i] if i < len(self.sizes) else None

    def __call__(self, *inputs, eager: bool = False):
        """Run for ``inputs`` (batch on axis 0); returns the output tensor(s), enqueued on the cache's stream."""
        if not isinstance(eager, (bool, np.bool_)):
            raise LaunchError(f"GraphCache's eager= is True or False (run this call without a graph), got {eager!r}")
        with self._lock:
            self._check_open()
            batch, inputs = self._batch_of(inputs)
            size = self.size_for(batch)
            if eager or size is None:
                if not eager and not self.fallback:
                    raise ShapeError(f"batch {batch} is above every captured size (largest {self.sizes[-1]}) and "
                                     "fallback is off; raise max_size/sizes, or pass fallback=True")
                self._stats.fallbacks += 1
                return self._eager(batch, inputs)
            if self.pad_value is not None and self.pad_value != 0:
                check_pad(self.pad_value, inputs, self._pads_checked)
            key = self._slot(size, self._key_of(inputs))
            entry = self._entries.get(key)
            if entry is None:
                check_new_key(self.key_fn, key, self._entries)
                self._stats.misses += 1
                entry = self._capture(size, key, inputs)
            else:
                self._stats.hits += 1
                self._entries.move_to_end(key)
            return self._replay(entry, batch, inputs)

    def warmup(self, *inputs, sizes=None) -> int:
        """Capture the graphs for ``inputs``' key at every size (or ``sizes``), largest
        first, so smaller ones share the largest one's buffers; returns how many were captured."""
        with self._lock:
            self._check_open()
            _, inputs = self._batch_of(inputs)
            key = self._key_of(inputs)
            todo = self.sizes if sizes is None else _sizes_of(sizes)
            unknown = [s for s in todo if s not in self.sizes]
            if unknown:  # refused before any is captured
                raise ShapeError(f"size(s) {unknown} are not among the cache's sizes {self.sizes}; warm up sizes it has, "
                                 "or make the cache with them (sizes=...)")
            n, todo = 0, sorted(todo, reverse=True)
            for size in progress(todo, total=len(todo), desc="capturing graphs"):
                slot = self._slot(size, key)
                if slot not in self._entries:
                    check_new_key(self.key_fn, slot, self._entries)
                    self._capture(size, slot, inputs)
                    n += 1
            return n

    def clear(self) -> None:
        """Close every graph and release every buffer."""
        with self._lock:
            self._refuse_while_building("cleared")
            while self._entries:
                self._evict()
            self._arena.clear()

    def close(self) -> None:
        with self._lock:
            self._refuse_while_building("closed")
            self.clear()
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"<GraphCache {len(self._entries)} graphs, sizes {self.sizes[0]}..{self.sizes[-1]}>"

    # -- inputs and keys -----------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise StateError("this GraphCache was closed; make a new one")
        self._refuse_while_building("called")

    def _refuse_while_building(self, what: str) -> None:
        """Only the lock's thread gets here: the cache's own function calls, clears or closes it."""
        if self._building is not None:
            raise ReentrancyError(f"the GraphCache was {what} from inside its own function (while it built size "
                                  f"{self._building}): that would capture again without end, or drop the graphs "
                                  "and buffers the capture uses; the function builds the op for the inputs it "
                                  "gets, call the cache (clear, close) outside it")

    def _build(self, ws: Workspace, *inputs) -> DeviceOp:
        """``fn(ws, *inputs)``, refused unless it returns an op; the cache refuses calls meanwhile."""
        refuse_uncallable("GraphCache", "function", self.fn, ["ws", *(f"inputs[{i}]" for i in range(len(inputs)))],
                          [], "define it as def fn(ws, x, ...) with one parameter per input after ws")
        self._building = ws.size
        try:
            op = self.fn(ws, *inputs)
        finally:
            self._building = None
        if not isinstance(op, DeviceOp):
            raise StateError(f"the GraphCache function must return a DeviceOp, got {type(op).__name__}")
        return op

    @staticmethod
    def _batch_of(inputs) -> tuple:
        """The inputs' batch, and the inputs as tensors (a SharedTensor handle read through, as kernels read it)."""
        if not inputs:
            raise ShapeError("a GraphCache call needs at least one input tensor (the batch is its axis 0)")
        for i, t in enumerate(inputs):
            if not isinstance(t, Tensor):
                if isinstance(t, SharedTensor):  # (.tensor refuses a released handle)
                    return GraphCache._batch_of(tuple(x.tensor if isinstance(x, SharedTensor) else x for x in inputs))
                raise DTypeError(f"GraphCache input {i} must be a deviceop Tensor, got {type(t).__name__}")
            if t.ndim == 0 or not t.is_contiguous:
                raise ShapeError(f"GraphCache input {i} (shape {t.shape}) must be contiguous with a batch axis 0")
        batch = inputs[0].shape[0]
        if batch < 1 or any(t.shape[0] != batch for t in inputs):
            raise ShapeError(f"GraphCache inputs must share a batch (axis 0) >= 1; got shapes "
                             f"{[t.shape for t in inputs]}")
        return batch, inputs

    @staticmethod
    def _slot(size: int, key) -> tuple:
        """What a graph is held under: its padded size and key (SwitchGraphCache: the key alone)."""
        return (size, key)

    def _key_of(self, inputs):
        if self.key_fn is None:
            return tuple((t.shape[1:], t.dtype.name) for t in inputs)
        return checked_key(self.key_fn, inputs)

    # -- buffers -------------------------------------------------------------------
    def _scratch(self, slot_key, shape, dt):
        """A buffer of ``shape`` for a capture: a view of the arena slot (grown if too small)."""
        n = math.prod(shape)
        slot = self._arena.get(slot_key) if self.share_buffers else None
        if slot is None or slot.size < n:
            slot = empty([max(n, 1)], dt, device=self.stream.device, stream=self.stream)
            if self.share_buffers:
                self._arena[slot_key] = slot
        return slot[:n].view(shape), slot

    def _held_bytes(self) -> int:
        seen = {}
        for s in self._arena.values():
            seen[id(s)] = s.nbytes
        for e in self._entries.values():
            for s in e.slots:
                seen[id(s)] = s.nbytes
        return sum(seen.values())

    # -- capture, replay, eager ----------------------------------------------------
    def _capture(self, size, key, inputs) -> _Entry:
        t0 = time.perf_counter()
        ws = Workspace(self, size, key[1], eager=False)
        static, slots = [], []
        for i, x in enumerate(inputs):
            t, slot = self._scratch(("input", i, x.dtype), (size, *x.shape[1:]), x.dtype)
            static.append(t)
            slots.append(slot)
        try:
            op = self._build(ws, *static)
            graph = op.graph_on(self.stream)
        except BaseException as exc:
            exc.add_note(f"(while GraphCache captured size {size}, key {key[1]!r})")
            self._trim_arena()
            raise
        try:
            outputs, single = _outputs_of(graph.take_output(), size)
        except BaseException:
            graph.close()
            self._trim_arena()
            raise
        entry = _Entry(key, size, graph, static, outputs, single, slots + [s for s in ws.buffers])
        self._entries[key] = entry
        self._stats.captures += 1
        self._stats.capture_seconds += time.perf_counter() - t0
        self._enforce_bounds(keep=entry)
        return entry

    def _replay(self, entry: _Entry, batch: int, inputs):
        self._copy_inputs(entry, batch, entry.size, inputs)
        entry.graph.replay(self.stream)
        return self._outputs(entry, batch, entry.size, entry.outputs, entry.single)

    def _copy_inputs(self, entry: _Entry, batch: int, size: int, inputs) -> None:
        """A replay's refusals, then ``inputs`` (``batch`` rows) copied into the graph's inputs of
        ``size`` rows, the padding zeroed: nothing is copied in before a refusal."""
        if executing_now() is not None:  # refused before the inputs are copied in, as graph.replay() is
            raise refuse_reentry("graph.replay() of a GraphCache", executing_now())
        refuse_if_captured_elsewhere("a GraphCache replay", self.stream)
        if self.key_fn is not None:  # the default key already holds every shape and dtype
            self._check_shapes(inputs, entry.inputs)
        for x, t, row in zip(inputs, entry.inputs, entry.row_bytes):
            self._copy_in(t, x, batch * row, (size - batch) * row)

    def _outputs(self, entry: _Entry, batch: int, size: int, outputs, single: bool):
        """The first ``batch`` rows of the graph's ``outputs`` (of ``size`` rows), views kept per
        batch, copied out when the cache copies."""
        views = entry.views.get(batch)
        if views is None:
            views = entry.views[batch] = tuple(o if batch == size else o[:batch] for o in outputs)
        if self.copy:
            views = tuple(_copy_of(v, self.stream) for v in views)
        return views[0] if single else views

    @staticmethod
    def _check_shapes(inputs, static) -> None:
        for x, t in zip(inputs, static):
            if x.shape[1:] != t.shape[1:] or x.dtype is not t.dtype:
                raise ShapeError(f"the key function put inputs of shape {x.shape} ({x.dtype.name}) on the "
                                 f"graph captured for {t.shape} ({t.dtype.name}); include every shape and "
                                 "dtype that differs in the key")

    def _copy_in(self, dst: Tensor, src: Tensor, nbytes: int, pad_bytes: int) -> None:
        """Copy ``src`` into the first ``nbytes`` of the graph's input ``dst``; pad the rest."""
        if src.data_ptr != dst.data_ptr and src.overlaps(dst):
            raise AliasingError("a GraphCache input overlaps the graph's own input buffer; pass a separate tensor")
        pad = pad_bytes and self.pad_value is not None
        stream = self.stream
        if src.data_ptr != dst.data_ptr:  # else the input already is the graph's buffer
            stream.memcpy(dst.data_ptr, src.data_ptr, nbytes, "cuMemcpyAsync (GraphCache input)")
        if pad and self.pad_value == 0 and not math.copysign(1, self.pad_value) < 0:  # -0.0 is filled
            stream.memset8(dst.data_ptr + nbytes, 0, pad_bytes, "cuMemsetD8Async (GraphCache padding)")
        elif pad:
            stream.fill(dst._array.reshape(-1)[nbytes // dst.dtype.itemsize:], self.pad_value)

    def _eager(self, batch, inputs):
        # the function gets copies, as a replay's function got the graph's input buffers: one that
        # writes its inputs in place leaves the caller's tensors as they were, whichever path runs
        inputs = tuple(_copy_of(x, self.stream) for x in inputs)
        ws = Workspace(self, batch, self._key_of(inputs), eager=True)
        op = self._build(ws, *inputs)
        outputs, single = _outputs_of(op.async_on(self.stream), batch)
        return outputs[0] if single else outputs

    # -- bounds --------------------------------------------------------------------
    def _enforce_bounds(self, keep: _Entry) -> None:
        while len(self._entries) > 1 and (
                (self.max_graphs is not None and len(self._entries) > self.max_graphs)
                or (self.max_bytes is not None and self._held_bytes() > self.max_bytes)):
            if next(iter(self._entries.values())) is keep:
                break
            self._evict()

    def _evict(self) -> None:
        _, entry = self._entries.popitem(last=False)
        entry.graph.close()
        entry.inputs = entry.outputs = entry.views = entry.slots = None
        self._stats.evictions += 1
        self._trim_arena()

    def _trim_arena(self) -> None:
        """Drop arena slots no live graph uses (they are re-made by the next capture)."""
        used = {id(s) for e in self._entries.values() for s in e.slots}
        for k in [k for k, s in self._arena.items() if id(s) not in used]:
            del self._arena[k]


def _sizes_of(sizes) -> tuple:
    """``sizes`` (batch sizes, ints >= 1) sorted, without repeats; refused unless a non-empty list of them."""
    if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
        raise ShapeError(f"sizes is a list of batch sizes (ints >= 1), got {sizes!r}")
    sizes = tuple(sorted({count(f"capture size {s!r} in sizes", s) for s in sizes}))
    if not sizes:
        raise ShapeError("sizes is empty: give at least one batch size to capture (or leave it None)")
    return sizes


def _outputs_of(value, batch: int):
    """The op's value as a tuple of tensors, each with ``batch`` rows on axis 0."""
    single = not isinstance(value, (tuple, list))
    items = (value,) if single else tuple(value)
    out = []
    for i, v in enumerate(items):
        t = v.tensor if isinstance(v, (SharedTensor, Partition)) else v
        if not isinstance(t, Tensor):
            raise StateError(f"the GraphCache function's op must produce tensors (or a tuple of them); "
                             f"output {i} is a {type(v).__name__}")
        if t.ndim == 0 or t.shape[0] != batch:
            raise ShapeError(f"GraphCache output {i} has shape {t.shape}: every output must keep the batch axis "
                             f"(axis 0 = {batch} rows) so padded rows can be sliced away")
        out.append(t)
    return tuple(out), single


def _copy_of(t: Tensor, stream) -> Tensor:
    c = empty(t.shape, t.dtype, device=t.device, stream=stream)
    stream.memcpy(c.data_ptr, t.data_ptr, t.nbytes, "cuMemcpyAsync (GraphCache output copy)")
    return c
