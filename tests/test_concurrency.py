"""Concurrency: threads capturing and replaying at once, eager work beside a capture,
capture modes, and the compile cache shared by several processes.

deviceop begins every capture in CUDA's *relaxed* mode (docs/robustness.md says
why): other threads — and the capturing thread itself — may allocate, load
modules and run eager work on other streams while a capture is open.  Each
thread's execution lock is its own, so two threads may capture at once, each
on its own stream.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from cuda.bindings import driver as cu

import deviceop as dop
from deviceop import CudaGraph, GraphModel, api, zip_
from deviceop.kernels import add, affine

ROOT = Path(__file__).resolve().parent.parent
N = 1024


def run_threads(*targets, timeout=120):
    """Run each target in its own thread; re-raise the first failure here."""
    errors = []

    def wrap(f):
        def run():
            try:
                f()
            except BaseException as exc:  # reported below, in the test's thread
                errors.append(exc)
        return run

    threads = [threading.Thread(target=wrap(f)) for f in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a thread hung"
    if errors:
        raise errors[0]


def two_steps(x, mid, out, alpha):
    """out = (alpha * x + 1) + x; ``expected`` computes it as the kernels do (one rounding per store)."""
    return zip_(affine(mid.partition([128]), x, alpha, 1.0).generics([128]),
                add(out.partition([128]), mid, x).generics([128]))


def expected(xs, alpha):
    x = xs.astype(np.float64)
    return ((alpha * x + 1).astype(np.float32).astype(np.float64) + x).astype(np.float32)


def test_two_threads_capture_and_replay_on_their_own_streams(device):
    both_capturing = threading.Barrier(2, timeout=60)

    def worker(alpha, seed):
        def run():
            stream = device.new_stream()
            rng = np.random.default_rng(seed)
            x, mid, out = (dop.empty(N, stream=stream) for _ in range(3))
            # the barrier inside the op: both captures are open at the same moment
            op = zip_(dop.value(None).inspect(lambda _: both_capturing.wait()), two_steps(x, mid, out, alpha))
            graph = op.graph_on(stream)
            for _ in range(25):
                xs = rng.standard_normal(N).astype(np.float32)
                graph.update(api.memcpy(x, dop.from_numpy(xs, stream=stream)))
                graph.launch().sync_on(stream)
                np.testing.assert_array_equal(out.numpy(stream=stream), expected(xs, alpha))
            graph.close()
        return run

    run_threads(worker(2.0, 1), worker(-0.5, 2))


def test_eager_work_on_another_thread_while_a_capture_is_open(device, rng):
    opened, finished = threading.Event(), threading.Event()
    xs = rng.standard_normal(N).astype(np.float32)

    def capturing():
        stream = device.new_stream()
        x, mid, out = (dop.empty(N, stream=stream) for _ in range(3))

        def hold(_):  # keep the capture open until the other thread is done
            opened.set()
            assert finished.wait(60), "the eager thread never finished"

        graph = zip_(dop.value(None).inspect(hold), two_steps(x, mid, out, 3.0)).graph_on(stream)
        api.memcpy(x, dop.from_numpy(xs, stream=stream)).sync_on(stream)
        graph.launch().sync_on(stream)
        np.testing.assert_array_equal(out.numpy(stream=stream), expected(xs, 3.0))

    def eager():
        assert opened.wait(60)
        try:
            stream = device.new_stream()
            big = dop.empty(16 * 2**20, stream=stream)  # 64 MiB: the allocator must get new device memory
            x = api.randn([N], seed=5).sync_on(stream)
            y = dop.empty(N, stream=stream)
            # a kernel never used before in this process: compiled and its module loaded now
            scale = dop.Kernel("scale_concurrent", f'extern "C" __global__ void scale_concurrent(float* o, const float* x)'
                               f' {{ int i = blockIdx.x * 128 + threadIdx.x; o[i] = 4.0f * x[i]; }} // {os.getpid()}',
                               [dop.Out("o", "float32"), dop.In("x", "float32")], block=128,
                               reference=lambda g, o, x: np.multiply(x, 4, out=o))
            scale(y.partition([128]), x).sync_on(stream)
            np.testing.assert_array_equal(y.numpy(stream=stream), 4 * x.numpy(stream=stream))
            del big
        finally:
            finished.set()

    run_threads(capturing, eager)


def test_a_thread_that_only_replays(device, rng):
    """A graph captured on one thread replays from another (which never bound the context itself)."""
    stream = device.new_stream()
    x, mid, out = (dop.empty(N, stream=stream) for _ in range(3))
    graph = two_steps(x, mid, out, 2.0).graph_on(stream)
    model = GraphModel(graph, x, out)
    inputs = [rng.standard_normal(N).astype(np.float32) for _ in range(4)]
    uploaded = [dop.from_numpy(a, stream=stream) for a in inputs]
    got = {}

    def replayer():
        for i, t in enumerate(uploaded):
            got[i] = model.forward(t).numpy(stream=stream)

    run_threads(replayer)
    for i, xs in enumerate(inputs):
        np.testing.assert_array_equal(got[i], expected(xs, 2.0))


@pytest.mark.gpu
def test_a_context_wide_sync_on_another_thread_is_refused_while_a_capture_is_open(device):
    """What relaxed mode does not allow: waiting on the whole context (device.synchronize(),
    Tensor.numpy() without a stream) while any stream captures.  The other thread gets a
    CudaError; stream-ordered waits on its own stream work; whatever becomes of the capture,
    the stream is usable afterwards."""
    stream = device.new_stream()
    x, y = dop.empty(N, stream=stream), dop.empty(N, stream=stream)
    seen = {}

    def other():
        own = device.new_stream()
        dop.empty(N, stream=own).numpy(stream=own)  # stream-ordered: fine
        seen["stream-ordered"] = "ok"
        try:
            device.synchronize()
            seen["context"] = "CUDA_SUCCESS"
        except dop.CudaError as exc:
            seen["context"] = exc.code_name

    op = zip_(dop.value(None).inspect(lambda _: run_threads(other)),
              affine(y.partition([128]), x, 2.0, 0.0).generics([128]))
    try:
        op.graph_on(stream).close()
        seen["capture"] = "completed"
    except dop.CaptureError:
        seen["capture"] = "broken (CaptureError)"
    print(f"\ncontext-wide sync during another thread's capture: {seen}")
    assert seen["stream-ordered"] == "ok" and seen["context"] == "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
    assert not stream.is_capturing()
    api.memcpy(x, dop.from_numpy(np.ones(N, dtype=np.float32), stream=stream)).sync_on(stream)
    affine(y.partition([128]), x, 2.0, 0.0).generics([128]).sync_on(stream)
    np.testing.assert_array_equal(y.numpy(stream=stream), np.full(N, 2.0, np.float32))


# -- capture modes, measured on the GPU ---------------------------------------------------

def _alloc_code(device):
    device.bind()
    code, ptr = cu.cuMemAlloc(2**20)  # cuMemAlloc is one of the calls CUDA calls "potentially unsafe"
    if not code:
        cu.cuMemFree(ptr)
    return cu.CUresult(int(code)).name


def _probe(device, mode, where):
    """Begin a capture in ``mode`` and call cuMemAlloc on this thread or another one."""
    stream = device.new_stream()
    stream.begin_capture(mode)
    try:
        if where == "own thread":
            result = _alloc_code(device)
        else:
            out = {}
            t = threading.Thread(target=lambda: out.setdefault("code", _alloc_code(device)))
            t.start()
            t.join(60)
            result = out["code"]
    finally:
        code, graph = cu.cuStreamEndCapture(stream.handle)
        if graph is not None and int(graph):
            cu.cuGraphDestroy(graph)
    assert not stream.is_capturing()
    return result


@pytest.mark.gpu
@pytest.mark.parametrize("mode, own, other", [
    ("relaxed", "CUDA_SUCCESS", "CUDA_SUCCESS"),        # deviceop's mode: nothing is prohibited
    ("thread_local", "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "CUDA_SUCCESS"),
    ("global", "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"),
])
def test_capture_modes_decide_who_may_allocate_during_a_capture(device, mode, own, other):
    """The table in docs/robustness.md: cuMemAlloc during a capture, by mode and thread."""
    assert (_probe(device, mode, "own thread"), _probe(device, mode, "other thread")) == (own, other)


# -- the compile cache, shared by processes ------------------------------------------------

SOURCE = 'extern "C" __global__ void shared_entry(float* p) { p[threadIdx.x] += 1.0f; }\n'

COMPILER = r'''
import hashlib, os, sys, time, warnings
warnings.simplefilter("error")  # a corrupt entry is a warning: make it fail this process
import deviceop as dop
start = sys.argv[1]
open(f"{start}.ready.{os.getpid()}", "w").close()
while not os.path.exists(start):  # all processes start compiling at once
    time.sleep(0.001)
prog = dop.compile_cubin(sys.argv[2], arch="sm_90")
print(prog.origin, hashlib.sha256(prog.cubin).hexdigest())
'''

STRESS = r'''
import os, sys, time, warnings
warnings.simplefilter("error")
from pathlib import Path
from deviceop import compile as comp
role, key, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
path = Path(os.environ["DEVICEOP_CACHE_DIR"]) / f"{key}.cubin"
prog = comp._read_entry(path, key)
n, end = 0, time.time() + seconds
while time.time() < end:
    if role == "writer":
        comp._write_entry(path, prog)   # temporary file, then an atomic rename over the entry
    else:
        assert comp._read_entry(path, key).cubin == prog.cubin
    n += 1
print(role, n)
'''


def _spawn(script, args, cache_dir):
    env = dict(os.environ, DEVICEOP_CACHE_DIR=str(cache_dir),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(procs):
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, f"a process failed:\n{err[-3000:]}"
        outs.append(out.split())
    return outs


def test_processes_compiling_one_kernel_at_once_leave_one_whole_entry(tmp_path):
    start = tmp_path / "start"
    procs = [_spawn(COMPILER, [start, SOURCE], tmp_path / "cache") for _ in range(6)]
    deadline = time.time() + 120
    while len(list(tmp_path.glob("start.ready.*"))) < len(procs) and time.time() < deadline:
        time.sleep(0.01)   # every process has imported deviceop and waits at the line
    start.touch()
    outs = _finish(procs)
    assert len({digest for _, digest in outs}) == 1, "processes got different CUBINs"
    entries = list((tmp_path / "cache").iterdir())
    assert [e.suffix for e in entries] == [".cubin"], f"expected one entry, no leftovers: {entries}"
    from deviceop import compile as comp
    key = entries[0].stem
    assert hashlib.sha256(comp._read_entry(entries[0], key).cubin).hexdigest() == outs[0][1]


# Half a second is thousands of rewrites and reads; the full sweep (gpu-check) stresses for 2 s.
@pytest.mark.parametrize("seconds", [0.5, pytest.param(2.0, marks=pytest.mark.full_sweep)])
def test_readers_never_see_half_an_entry_while_writers_rewrite_it(tmp_path, seconds):
    cache = tmp_path / "cache"
    prog = _finish([_spawn(COMPILER, [tmp_path, SOURCE], cache)])  # tmp_path exists: starts at once
    assert prog[0][0] == "compiled"
    key = next(cache.iterdir()).stem
    procs = [_spawn(STRESS, [role, key, seconds], cache) for role in ("writer", "writer", "reader", "reader", "reader")]
    counts = {}
    for role, n in _finish(procs):
        counts[role] = counts.get(role, 0) + int(n)
    assert counts["writer"] > 10 and counts["reader"] > 10, counts
    assert [e.suffix for e in cache.iterdir()] == [".cubin"]
    print(f"\n{counts['writer']} rewrites, {counts['reader']} whole reads, 0 corrupt")
