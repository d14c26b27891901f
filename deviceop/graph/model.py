"""Seed 001's Module: a model is ``forward(input) -> output``; a GraphModel is a
captured forward pass behind it."""
from __future__ import annotations

from threading import get_ident

from ..errors import DTypeError, KernelFaultError, LaunchError
from ..execution import _running
from ..runtime.stream import capturing, stream_key
from ..tensor import SharedTensor, Tensor
from .. import api
from .cudagraph import CudaGraph
from .nodes import KernelNode


class Module:
    """A model: ``forward(input) -> output`` (seed 001's Module trait)."""

    def forward(self, x):  # pragma: no cover - protocol
        raise NotImplementedError

    def __call__(self, x):
        return self.forward(x)


class GraphModel(Module):
    """A captured forward pass behind ``forward``: copy the input into the
    buffer the graph reads, replay, return the buffer the graph writes."""

    def __init__(self, graph: CudaGraph, input, output):
        if not isinstance(graph, CudaGraph):  # refused here, not as an AttributeError at the first forward
            raise LaunchError(f"GraphModel(graph, input, output) takes a CudaGraph (op.graph_on(stream)), "
                              f"got {type(graph).__name__}")
        graph._check_open()
        if not isinstance(input, (Tensor, SharedTensor)):
            raise DTypeError(f"GraphModel's input must be the deviceop Tensor the graph reads (the buffer each "
                             f"forward copies into), got {type(input).__name__}")
        self.graph = graph
        self.input = input.tensor if isinstance(input, SharedTensor) else input
        self.output = output
        self._in_sig = self.input._sig[1:]  # shape, strides, dtype, device
        self._nbytes = self.input.nbytes

    def forward(self, x):
        self.forward_async(x)
        try:
            self.graph.stream.synchronize()
        except KernelFaultError as exc:
            kernels = [n.label for n in self.graph._nodes if isinstance(n, KernelNode)]
            raise exc.naming("GraphModel.forward", kernels) from None
        return self.output

    def forward_async(self, x):
        """``forward`` without waiting: the output is ready once the graph's stream gets there.

        The common case — a contiguous tensor exactly like the input buffer, no
        execution on this thread, no capture of the stream — is two driver calls
        (copy, replay) after a few attribute tests, each a dict's emptiness first
        (the hot path: bench/token_loop.py holds it to the bare driver calls);
        anything else goes through ``api.memcpy`` and ``graph.launch()``, which
        check everything and name what is wrong."""
        graph, inp = self.graph, self.input
        stream = graph._stream
        if graph._checks:  # refused before the input is copied in (a collective's group was closed)
            for check in graph._checks:
                check.check_replay()
        if (type(x) is Tensor and x._sig[1:] == self._in_sig and x._contig and x._alloc is not inp._alloc
                and not graph._closed
                and (not _running or get_ident() not in _running)
                and (not capturing or stream_key(stream) not in capturing)):
            stream.memcpy(inp._ptr, x._ptr, self._nbytes)
            graph._graphs.launch(graph._exec, stream)
            return self.output
        graph.update(api.memcpy(inp, x))
        graph.launch().async_on(stream)
        return self.output
