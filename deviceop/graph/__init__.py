"""Graphs: CudaGraph and Scope (capture, replay, recapture), the kernel nodes of
a captured graph, device loops and branches, the shape-keyed GraphCache, and Module/GraphModel.

The top layer: it imports the ones below, and installs ``CudaGraph.capture``
as what ``op.graph_on(stream)`` calls (``execution.set_capture``), so that the op
layer never imports it.
"""
from ..execution import set_capture
from .branches import if_, switch
from .cache import CacheStats, GraphCache, Workspace, default_sizes
from .capture import Capture
from .copy_nodes import MemcpyNode, MemsetNode
from .child import ChildGraphNode, GraphLaunch
from .cudagraph import CudaGraph, Scope
from .loops import Loop, While, loop, while_
from .model import GraphModel, Module
from .nodes import KernelNode, Node
from .switch_cache import SwitchGraphCache

set_capture(CudaGraph.capture)  # what DeviceOp.graph_on calls (the op layer cannot import this one)

__all__ = ["CacheStats", "Capture", "ChildGraphNode", "CudaGraph", "GraphCache", "GraphLaunch", "GraphModel",
           "KernelNode", "Loop", "MemcpyNode", "MemsetNode", "Module", "Node", "Scope", "SwitchGraphCache", "While",
           "Workspace", "default_sizes", "if_", "loop", "switch", "while_"]
