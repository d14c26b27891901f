"""The generated code of the eager hot path, from templates that read as plain functions.

Why generate at all: an eager launch is the hot path (bench/launch_overhead.py,
bench/eager_overhead.py), and a function written for one parameter list has no
loop over its arguments, builds no argument list and calls nothing per
argument — what a generic function cannot avoid, and most of a launch's host
cost.  Each template is that function with ``{placeholders}`` for what depends
on the parameter list; ``generate`` fills them in and compiles it.  A
placeholder alone on a line takes a list of lines, indented as it is.

* ``LAUNCHER``: ``Function.launch(stream, config, *args)`` (runtime/launch.py);
* ``LAUNCH_KEY``: a kernel launch's key (kernel/plan.py: what the key is);
* ``KERNEL_RUN``: a kernel launch op's ``_run`` (kernel/fast.py).
"""
from __future__ import annotations

LAUNCHER = """
def launch(stream, config, {params}*extra):
    {arity_check}
    {convert}
    if type(config) is not LaunchConfig: config = as_config(config)
    gx, gy, gz = config.grid
    bx, by, bz = config.block
    smem = config.shared_mem
    if smem > fn._smem_limit: fn.set_max_dynamic_shared_memory(smem)
    acquire()  # one parameter buffer per Function, held while it is filled and the driver copies it
    try:
        pack_into(buf, 0{args_tail})
        {driver_call}
    finally:
        release()
"""

# The driver call of LAUNCHER: cuLaunchKernel (through the cheapest wrapper), or
# cuLaunchKernelEx for a launch with an attribute (PDL, cooperative, cluster).
PLAIN_CALL = """
try:  # costs nothing unless something is raised
    launch_kernel(address, gx, gy, gz, bx, by, bz, smem, stream.ptr, params, 0)
except Exception as exc:
    fn._launch_failed(exc, stream, label)
"""
EX_CALL = """
try:
    ex_config = fn._ex_config(attribute, config, stream.ptr)
except Exception as exc:
    fn._launch_failed(exc, stream, label)
code = cuLaunchKernelEx(ex_config, handle, params, 0)[0]
if code: raise_error(code, label)
"""

LAUNCH_KEY = """
def launch_key(device, gen, pdl, cooperative, {args}):
    {unwrap}
    return {key}
"""

KERNEL_RUN = """
def _run(self, ctx):
    if self._consumed:
        self._already_executed()
    self._consumed = True
    {op}
    {args}, = op.args
    {run_ops}
    if ctx.plain:  # eager, no capture, no read-only borrows to check
        try:
            {unwrap}
            key = {key}
            plan = plans[key]
            call = plan.call
            if call is None:  # checked (by a capture, or a node update), not prepared yet
                raise KeyError(key)
        except KeyError:
            op._launch_and_prepare(ctx, [{args}], key)
            return {result}
        except (AttributeError, TypeError, ValueError):  # not a tensor, unhashable, ...
            op._launch(ctx, [{args}])
            return {result}
        try:  # the driver call with no frame of ours (see PreparedLaunch)
            call(ctx.stream.ptr, plan.params, 0)
        except Exception as exc:
            plan.prepared.failed(exc, ctx.stream)
        stats["launches"] += 1
        return {result}
    op._launch(ctx, [{args}])
    return {result}
"""


def source(template: str, **parts) -> str:
    """``template`` with its placeholders filled: a part is a string, or a list of
    lines for a placeholder alone on its line (an empty list drops the line)."""
    out = []
    for line in template.strip("\n").splitlines():
        name = line.strip()
        if name.startswith("{") and name.endswith("}") and isinstance(parts.get(name[1:-1]), list):
            indent = line[:len(line) - len(line.lstrip())]
            out += [indent + sub for sub in parts[name[1:-1]]]
        else:
            out.append(line.format(**{k: v for k, v in parts.items() if not isinstance(v, list)}))
    return "\n".join(out) + "\n"


def lines(template: str) -> list[str]:
    """A template without placeholders (PLAIN_CALL, EX_CALL) as a list of lines."""
    return template.strip("\n").splitlines()


def generate(template: str, name: str, env: dict, filename: str, **parts):
    """Compile ``template`` filled with ``parts`` in the namespace ``env``; return ``name``."""
    scope = dict(env)
    exec(compile(source(template, **parts), filename, "exec"), scope)
    return scope[name]
