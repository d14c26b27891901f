"""The eager fast path, generated per kernel (runtime/codegen.py's KERNEL_RUN, which
says why it is generated): a launch whose arguments were all seen before is one
key, one lookup in the kernel's plans and one prepared driver call."""
from __future__ import annotations

from ..op import stats
from ..runtime import codegen
from .launch import KernelLaunch, _Output
from .plan import _KEY_ENV, _launch_key_code


def _fast_launch_type(kernel, dynamic: tuple) -> type:
    """A KernelLaunch subclass for ``kernel`` whose arguments at positions
    ``dynamic`` are ops, with ``_run`` generated for its parameter list, and the
    ``first()`` node to go with it (whose ``_run`` is the same code inlined: one
    frame per launch fewer).  An eager launch whose arguments were all seen
    before is one key (``_launch_key_code``: every tensor's layout id, every
    scalar's type and value), one lookup in ``kernel._plans`` and one prepared
    driver call (Function.prepared): no loop, no argument list, no re-packing.
    Anything else (a first launch, a graph capture, the reference device, a bad
    argument) takes the general ``KernelLaunch._launch``, which checks
    everything the key has not been checked for and names what is wrong."""
    args = ", ".join(f"a{i}" for i in range(len(kernel.params)))
    first = f"a{kernel.grid_index}"  # first(): the output partition (.tensor unpartitioned), or an in-out tensor
    unwrap, key = _launch_key_code(kernel, ("ctx.device", "op._generics", "op._pdl", "op._cooperative"))
    env = {**_KEY_ENV, "stats": stats, "plans": kernel._plans}
    common = dict(args=args, run_ops=[f"a{i} = a{i}._run(ctx)" for i in dynamic], unwrap=unwrap, key=key)
    label = f"<deviceop launch of {kernel.name}>"
    launch_run = codegen.generate(codegen.KERNEL_RUN, "_run", env, label, op=["op = self"],
                                  result=f"({args},)", **common)
    output_run = codegen.generate(codegen.KERNEL_RUN, "_run", env, label,
                                  op=["op = self.launch", "if op._consumed:", "    op._already_executed()",
                                      "op._consumed = True"],
                                  result=f"{first}.tensor if self.as_tensor else {first}" if kernel.first_is_partition
                                  else first,
                                  **common)
    output = type("_Output", (_Output,), {"__slots__": (), "_run": output_run, "_execute": output_run,
                                          "__module__": __name__, "__doc__": _Output.__doc__})
    return type("KernelLaunch", (KernelLaunch,), {"__slots__": (), "_run": launch_run, "_execute": launch_run,
                                                  "_output_type": output, "__module__": __name__,
                                                  "__doc__": KernelLaunch.__doc__})
