"""The eager fast path, generated per kernel: a launch whose arguments were all
seen before is one key, one lookup and one prepared driver call.

Generated rather than written as a loop because this is the hot path of every
eager launch, and a generated ``_run`` has no loop, no argument list and no
frame beyond its own (bench/eager_overhead.py measures what that buys).
"""
from __future__ import annotations

from ..op import stats
from .launch import KernelLaunch, _Output
from .plan import _KEY_ENV, _launch_key_code


def _fast_launch_type(kernel, dynamic: tuple) -> type:
    """A KernelLaunch subclass for ``kernel`` whose arguments at positions
    ``dynamic`` are ops, with ``_run`` generated for its parameter list, and the
    ``first()`` node to go with it (whose ``_run`` is the same code inlined: one
    frame per launch fewer).  An eager launch whose arguments were all seen
    before is one key (``_launch_key_code``: every tensor's layout id, every
    scalar's type and value), one lookup in ``kernel._prepared`` and one
    prepared driver call (Function.prepared): no loop, no argument list, no
    re-packing.  Anything else (a first launch, a graph capture, the reference
    device, a bad argument) takes the general ``KernelLaunch._launch``, which
    checks everything the key has not been checked for and names what is wrong."""
    n = len(kernel.params)
    a = [f"a{i}" for i in range(n)]
    unwrap, key = _launch_key_code(kernel, ("ctx.device", "op._generics", "op._pdl", "op._cooperative"))
    unwrap = [f"            {line}" for line in unwrap]
    values = f"[{', '.join(a)}]"

    def run(head: list, result: str) -> list:
        """The body of a ``_run``: ``op`` is the launch, ``result`` its value."""
        return ["def _run(self, ctx):",
                *head,
                f"    {', '.join(a)}, = op.args",
                *[f"    a{i} = a{i}._run(ctx)" for i in dynamic],
                "    if ctx.capture is None:",
                "        try:",
                *unwrap,
                f"            key = {key}",
                "            call, params, launch = prepared[key]",
                "        except KeyError:",
                f"            op._launch_and_prepare(ctx, {values}, key)",
                f"            return {result}",
                "        except (AttributeError, TypeError, ValueError):  # not a tensor, unhashable, ...",
                f"            op._launch(ctx, {values})",
                f"            return {result}",
                "        try:  # the driver call with no frame of ours (see PreparedLaunch)",
                "            call(ctx.stream.ptr, params, 0)",
                "        except Exception as exc:",
                "            launch.failed(exc, ctx.stream)",
                "        stats['launches'] += 1",
                f"        return {result}",
                f"    op._launch(ctx, {values})",
                f"    return {result}"]

    consume = ["    if self._consumed:",
               "        self._already_executed()",
               "    self._consumed = True"]
    launch_run = run(consume + ["    op = self"], f"({', '.join(a)},)")
    output_run = run(consume + ["    op = self.launch",
                                "    if op._consumed:",
                                "        op._already_executed()",
                                "    op._consumed = True"], "a0.tensor if self.as_tensor else a0")
    env = {**_KEY_ENV, "stats": stats, "prepared": kernel._prepared}
    made = []
    for body in (launch_run, output_run):
        scope = dict(env)
        exec(compile("\n".join(body), f"<deviceop launch of {kernel.name}>", "exec"), scope)
        made.append(scope["_run"])
    output = type("_Output", (_Output,), {"__slots__": (), "_run": made[1], "_execute": made[1],
                                          "__module__": __name__, "__doc__": _Output.__doc__})
    return type("KernelLaunch", (KernelLaunch,), {"__slots__": (), "_run": made[0], "_execute": made[0],
                                                  "_output_type": output, "__module__": __name__,
                                                  "__doc__": KernelLaunch.__doc__})
