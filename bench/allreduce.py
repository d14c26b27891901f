"""All-reduce latency for small messages inside a CUDA graph (issue 35, item 3), on 2
and 4 GPUs of one machine, with a correctness check against float64 in the same run.

Per world size (those of 1, 2 and 4 the machine has) and message size (4, 8, 16, 64 KB of bfloat16), the GPU time per
all-reduce of a graph holding ``--ops`` back-to-back all-reduces (CUDA events around
``--batch`` replays, median of ``--reps``; rank 0's numbers; every rank replays alike):

* ``nccl``: ncclAllReduce on ordinary buffers (nccl4py, captured with CuPy's stream capture);
* ``nccl_symmetric``: the same on buffers from ncclMemAlloc registered as symmetric windows
  (``register_window(..., WindowFlag.COLL_SYMMETRIC)``: NCCL's symmetric kernels);
* ``dist_nccl``: deviceop's ``dist.all_reduce(algorithm="nccl")`` in a deviceop graph;
* ``oneshot`` / ``oneshot_pdl``: deviceop's one-shot kernel (deviceop/distributed/peer.py)
  in a deviceop graph, without and with programmatic dependent launch.

Correctness, before timing: every form of the one-shot op (out of place, in place,
``out = residual + sum``, ``out += sum``) in float32 and bfloat16 at every size, on
random data, against the float64 sum (and bit for bit against the fp32 rank-ordered
sum, on every rank), after graph replays too; NCCL's results against float64.

    python bench/allreduce.py [--gpus 1 2 4] [--ops 100] [--reps 15]

One GPU gives the floor: the same graphs with one rank (the one-shot kernel then
only reads its input and writes its output), so 2- and 4-GPU rows minus it are
what the communication costs.

The parent starts one process per GPU (``dist.init(rank=, world_size=, store=DIR)``)
for each world size the machine has; rank 0 of each writes its rows to a file the
parent gathers into bench/results/allreduce.json (headline ``allreduce_us_8kb_2gpu``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
SIZES_KB = (4, 8, 16, 64)
TARGETS = {2: 3.0, 4: 5.0}  # us per 4-8 KB all-reduce in a graph (issue 35)
from deviceop.distributed.launch import NO_MULTICAST  # noqa: E402 - after sys.path; loads no NCCL


# -- correctness ------------------------------------------------------------------------------

def check_one_shot(group, bufs, seed: int) -> list:
    """Every form of the one-shot op at every size, both dtypes: max error against the float64
    sum (relative to the largest |sum|), bit-exact against the fp32 rank-ordered sum, and
    the same bits on every rank."""
    import ml_dtypes
    import numpy as np
    import deviceop as dop
    s, rows = group.stream, []
    for dtype, np_dt in (("float32", np.float32), ("bfloat16", ml_dtypes.bfloat16)):
        for kb in SIZES_KB:
            n = kb * 1024 // np.dtype(np_dt).itemsize
            rng = np.random.default_rng([seed, kb, n])
            xs = [rng.standard_normal(n).astype(np_dt) for _ in range(group.world_size)]
            res = rng.standard_normal(n).astype(np_dt)
            x = dop.from_numpy(xs[group.rank], stream=s)
            out, hidden = dop.empty(n, dtype, stream=s), dop.from_numpy(res, stream=s)
            fused = dop.empty(n, dtype, stream=s)
            graph = dop.DeviceOpVec([bufs.all_reduce(x, out) for _ in range(3)]).graph_on(s)
            for _ in range(3):
                graph.replay(s)
            bufs.all_reduce(x, fused, residual=hidden).sync_on(s)
            bufs.all_reduce(x, hidden, residual=hidden).sync_on(s)
            inplace = dop.from_numpy(xs[group.rank], stream=s)
            bufs.all_reduce(inplace).sync_on(s)
            bufs.check()
            got = {k: t.numpy(stream=s) for k, t in
                   (("sum", out), ("residual", fused), ("accumulate", hidden), ("in_place", inplace))}
            total32 = xs[0].astype(np.float32)
            for a in xs[1:]:
                total32 = total32 + a.astype(np.float32)
            exact = np.sum([a.astype(np.float64) for a in xs], axis=0)
            want = {"sum": total32.astype(np_dt), "in_place": total32.astype(np_dt),
                    "residual": (res.astype(np.float32) + total32).astype(np_dt)}
            want["accumulate"] = want["residual"]
            exact_of = {"sum": exact, "in_place": exact, "residual": exact + res.astype(np.float64),
                        "accumulate": exact + res.astype(np.float64)}
            digests = group.exchange({k: v.tobytes() for k, v in got.items()})
            for form, v in got.items():
                err = float(np.max(np.abs(v.astype(np.float64) - exact_of[form])) / np.max(np.abs(exact_of[form])))
                rows.append({"dtype": dtype, "kb": kb, "form": form, "max_rel_err_vs_f64": err,
                             "bit_exact_vs_fp32_rank_order": bool(v.tobytes() == want[form].tobytes()),
                             "same_on_every_rank": all(d[form] == digests[0][form] for d in digests)})
            graph.close()
    return rows


# -- timing -------------------------------------------------------------------------------------

def time_cupy_graph(capture, stream, ops: int, batch: int, reps: int) -> float:
    """us per op of a CuPy-captured graph of ``ops`` calls: median over ``reps`` of ``batch`` replays."""
    import cupy
    stream.begin_capture()
    try:
        capture()
    finally:
        graph = stream.end_capture()
    for _ in range(3):
        graph.launch(stream)
    stream.synchronize()
    runs = []
    for _ in range(reps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        for _ in range(batch):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
        runs.append(cupy.cuda.get_elapsed_time(start, end) * 1e3 / (batch * ops))
    return statistics.median(runs)


def nccl_rows(group, kb: int, ops: int, batch: int, reps: int, comm, low) -> dict:
    """NCCL on plain buffers (deviceop tensors) and on symmetric windows (ncclMemAlloc'd,
    registered with NCCL_WIN_COLL_SYMMETRIC): us per op, and the error against float64.
    nccl4py's low-level calls with raw pointers, as deviceop's NCCL backend makes them."""
    import cupy
    import ml_dtypes
    import numpy as np
    from cuda.bindings import driver as cu
    import deviceop as dop
    from deviceop.runtime.driver import check
    n, nbytes = kb * 1024 // 2, kb * 1024
    rng = np.random.default_rng([group.rank, kb])
    host = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    every = group.exchange(host.tobytes())
    exact = np.sum([np.frombuffer(b, ml_dtypes.bfloat16).astype(np.float64) for b in every], axis=0)
    out, handle = {}, low.Comm(comm.ptr)
    x, y = dop.from_numpy(host, stream=group.stream), dop.empty(n, "bfloat16", stream=group.stream)
    group.stream.synchronize()
    with cupy.cuda.Device(group.device.ordinal):
        stream = cupy.cuda.Stream(non_blocking=True)
        for name in ("nccl", "nccl_symmetric"):
            windows = []
            if name == "nccl":
                send, recv = x.data_ptr, y.data_ptr
            else:
                send, recv = low.mem_alloc(nbytes), low.mem_alloc(nbytes)
                check(cu.cuMemcpyHtoD(send, host.view(np.uint8), nbytes), "cuMemcpyHtoD")
                windows = [low.comm_window_register(handle, p, nbytes, 1) for p in (send, recv)]  # COLL_SYMMETRIC
            cupy.cuda.runtime.deviceSynchronize()

            def capture():
                for _ in range(ops):
                    low.all_reduce(send, recv, n, 9, 0, handle, stream.ptr)  # bfloat16, sum

            us = time_cupy_graph(capture, stream, ops, batch, reps)
            got = np.empty(n, ml_dtypes.bfloat16)
            check(cu.cuMemcpyDtoH(got.view(np.uint8), recv, nbytes), "cuMemcpyDtoH")
            got = got.astype(np.float64)
            out[name] = {"us_per_op": us, "max_rel_err_vs_f64": float(np.max(np.abs(got - exact)) / np.max(np.abs(exact)))}
            for w in windows:
                low.comm_window_deregister(handle, w)
            if name == "nccl_symmetric":
                low.mem_free(send)
                low.mem_free(recv)
    return out


def one_shot_rows(group, bufs, kb: int, ops: int, batch: int, reps: int) -> dict:
    import ml_dtypes
    import numpy as np
    import deviceop as dop
    import deviceop.distributed as dist
    from _common import replay_us
    s, n = group.stream, kb * 1024 // 2
    rng = np.random.default_rng([group.rank, kb, 1])
    host = rng.standard_normal(n).astype(ml_dtypes.bfloat16)
    every = group.exchange(host.tobytes())
    exact = np.sum([np.frombuffer(b, ml_dtypes.bfloat16).astype(np.float64) for b in every], axis=0)
    x, out = dop.from_numpy(host, stream=s), dop.empty(n, "bfloat16", stream=s)
    rows = {}
    builders = {"oneshot": lambda: bufs.all_reduce(x, out),
                "oneshot_pdl": lambda: bufs.all_reduce(x, out).pdl(),
                "dist_nccl": lambda: dist.all_reduce(group, x, out, algorithm="nccl")}
    for name, build in builders.items():
        try:
            graph = dop.DeviceOpVec([build() for _ in range(ops)]).graph_on(s)
            us = replay_us(graph, s, per=ops, batch=batch, reps=reps)
            got = out.numpy(stream=s).astype(np.float64)
            rows[name] = {"us_per_op": us, "max_rel_err_vs_f64": float(np.max(np.abs(got - exact)) / np.max(np.abs(exact)))}
            graph.close()
        except Exception as exc:  # noqa: BLE001 - a row that failed says why; the others still run
            rows[name] = {"us_per_op": None, "error": f"{type(exc).__name__}: {exc}"[:400]}
    bufs.check()
    return rows


def worker(args) -> int:
    for k, v in NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    import deviceop.distributed as dist
    with dist.init(rank=args.rank, world_size=args.world, store=args.store, timeout=120) as group:
        bufs = dist.PeerBuffers(group, max_bytes=max(SIZES_KB) * 1024, timeout=10.0)
        seed = group.exchange(int.from_bytes(os.urandom(4), "little") if group.rank == 0 else None)[0]
        result = {"world_size": group.world_size, "device": group.device.name, "seed": seed,
                  "correctness": check_one_shot(group, bufs, seed), "timing": []}
        comm = low = None
        try:  # a communicator of our own for the NCCL rows (nccl4py's, as deviceop's backend builds one)
            import nccl.bindings.nccl as low
            import nccl.core as nc
            uid = group.exchange(bytes(nc.get_unique_id()) if group.rank == 0 else None)[0]
            group.device.bind()
            comm = nc.Communicator.init(group.world_size, group.rank, nc.UniqueId.from_bytes(uid))
            result["nccl_version"] = str(nc.get_version())
        except Exception as exc:  # noqa: BLE001 - the one-shot rows still run
            result["nccl_version"] = f"unavailable: {type(exc).__name__}: {exc}"[:300]
        for kb in SIZES_KB:
            row = {"kb": kb, "dtype": "bfloat16"}
            row.update(one_shot_rows(group, bufs, kb, args.ops, args.batch, args.reps))
            try:
                if comm is not None:
                    row.update(nccl_rows(group, kb, args.ops, args.batch, args.reps, comm, low))
            except Exception as exc:  # noqa: BLE001
                row["nccl_error"] = f"{type(exc).__name__}: {exc}"[:400]
            result["timing"].append(row)
            group.barrier()
        bufs.close()
        if comm is not None:
            comm.destroy()
        if group.rank == 0:
            Path(args.out).write_text(json.dumps(result))
    return 0


def run_world(world: int, args) -> dict | None:
    with tempfile.TemporaryDirectory(prefix="deviceop-allreduce-") as tmp:
        out = Path(tmp) / "rank0.json"
        env = dict(os.environ, **NO_MULTICAST, PYTHONUNBUFFERED="1")
        procs = [subprocess.Popen([sys.executable, __file__, "--worker", "--rank", str(r), "--world", str(world),
                                   "--store", str(Path(tmp) / "store"), "--out", str(out), "--ops", str(args.ops),
                                   "--batch", str(args.batch), "--reps", str(args.reps)], env=env)
                 for r in range(world)]
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=args.timeout))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append("timeout")
        if any(c != 0 for c in codes) or not out.exists():
            print(f"allreduce: the {world}-GPU run failed (exit codes {codes})")
            return None
        return json.loads(out.read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--ops", type=int, default=100)
    ap.add_argument("--batch", type=int, default=5)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rank", type=int)
    ap.add_argument("--world", type=int)
    ap.add_argument("--store")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from cuda.bindings import driver as cu
    available = cu.cuDeviceGetCount()[1] if cu.cuInit(0)[0] == 0 else 0
    worlds = [w for w in args.gpus if w <= available]
    if not worlds:
        print(f"allreduce measures GPUs; this machine has {available} (asked for {args.gpus}). Nothing to measure.")
        return 0
    from _common import headline, print_headlines, print_table, write_result
    results = {w: run_world(w, args) for w in worlds}
    rows, heads, failed = [], [], [w for w, r in results.items() if r is None]
    algos = ("nccl", "nccl_symmetric", "dist_nccl", "oneshot", "oneshot_pdl")
    for w, r in results.items():
        if r is None:
            continue
        for t in r["timing"]:
            rows.append({"gpus": w, **t})
        bad = [c for c in r["correctness"] if not (c["bit_exact_vs_fp32_rank_order"] and c["same_on_every_rank"])]
        worst = max(c["max_rel_err_vs_f64"] for c in r["correctness"])
        print(f"\n{w} GPUs ({r['device']}, NCCL {r['nccl_version']}): one-shot correctness "
              f"{len(r['correctness']) - len(bad)}/{len(r['correctness'])} bit-exact and identical on every rank; "
              f"worst error vs float64 {worst:.2e} (relative to the largest |sum|)")
        print_table(f"all-reduce, bfloat16, us per op in a CUDA graph ({w} GPUs)", ["KB", *algos],
                    [[t["kb"], *[(f"{t[a]['us_per_op']:.2f}" if t.get(a, {}).get("us_per_op") else "-")
                                 for a in algos]] for t in r["timing"]])
        best8 = [t for t in r["timing"] if t["kb"] == 8][0]
        ours = best8.get("oneshot", {}).get("us_per_op")  # plain launches: what any graph of ours gets
        if w in TARGETS:
            heads.append(headline(f"allreduce_us_8kb_{w}gpu", ours, TARGETS[w], "lower") if ours else
                         {"metric": f"allreduce_us_8kb_{w}gpu", "value": None, "target": TARGETS[w],
                          "better": "lower", "met": False})
            if ours and best8.get("nccl", {}).get("us_per_op"):
                heads.append(headline(f"allreduce_speedup_vs_nccl_8kb_{w}gpu", best8["nccl"]["us_per_op"] / ours,
                                      1.0, "higher"))
        if bad:
            heads.append(headline(f"allreduce_correctness_failures_{w}gpu", len(bad), 0, "lower"))
    device = type("D", (), {"name": next((r["device"] for r in results.values() if r), "unknown")})()
    extra = {"correctness": {w: r["correctness"] for w, r in results.items() if r},
             "nccl_version": {w: r["nccl_version"] for w, r in results.items() if r}, "failed_worlds": failed}
    path = write_result("allreduce", device, rows, heads, extra)
    print_headlines(heads, path)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
