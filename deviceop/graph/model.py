"""Seed 001's Module: a model is ``forward(input) -> output``; a GraphModel is a
captured forward pass behind it."""
from __future__ import annotations

from ..errors import KernelFaultError
from ..execution import executing_now
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
        self.graph = graph
        self.input = input.tensor if isinstance(input, SharedTensor) else input
        self.output = output
        self._in_sig = self.input._sig[1:]  # shape, strides, dtype

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

        The common case — a contiguous tensor exactly like the input buffer — is
        two driver calls (copy, replay) and a few attribute checks; anything
        else goes through ``api.memcpy``, which checks everything and names
        what is wrong."""
        graph, inp = self.graph, self.input
        stream = graph._stream
        if (type(x) is Tensor and x._sig[1:] == self._in_sig and x._contig
                and x._alloc is not inp._alloc and executing_now() is None and not graph._closed
                and not (capturing and stream_key(stream) in capturing)):
            stream.memcpy(inp._ptr, x._ptr, inp.nbytes)
            graph._replay(stream)
            return self.output
        graph.update(api.memcpy(inp, x))
        graph.launch().async_on(stream)
        return self.output
