"""Kernel declarations and the launch plan (see declare.py for what a kernel is).

* ``shapes``: shape expressions (``"HQ*HD"``), parsed once at declaration, and what they determine;
* ``signature``: parameters (``Out``, ``InOut``, ``In``, ``Scalar``), the check of one argument, and
  ``bind``: the arguments' dimensions against the shapes;
* ``geometry``: a declared launch geometry (``grid=``, and block, shared memory, cluster as expressions);
* ``plan``: the launch key, every check of a launch, the verdict cache;
* ``launch``: the lazy launch op and its ``first()``;
* ``fast``: the generated eager fast path;
* ``declare``: ``Kernel``;
* ``precompile``: compiling many kernels ahead of time, and the progress bar of long work.
* ``binary``: CUBIN, fatbin and PTX images read without a driver (arch, PTX ISA, parameter layouts);
* ``prebuilt``: kernels another compiler built (``Kernel.from_binary``, ``Kernel.from_triton``).
"""
from .declare import Kernel
from .launch import KernelLaunch
from .plan import _launcher, check_launch, checked_launch
from .precompile import precompile, progress
from .signature import In, InOut, Out, Param, Scalar, check_arg

__all__ = ["_launcher", "In", "InOut", "Kernel", "KernelLaunch", "Out", "Param", "Scalar", "check_arg", "check_launch",
           "checked_launch", "precompile", "progress"]
