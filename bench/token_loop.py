"""Seed 001's token loop on the GPU: deviceop eager and graphs vs PyTorch eager
and torch.cuda.CUDAGraph, one process, same weights (shared through DLPack).

Two times per variant: the GPU time of one token (CUDA events around 40 forwards
enqueued back to back, median of 5 such runs: what the floors and the
headline ratios use, as the floor is itself a GPU time), and the wall time of
one token that ends in a synchronization (median of many; it adds the host's
launch and wake-up, ~15-20 us here).  The floor is the weight bytes over the
measured device-to-device copy rate (bytes read + written per second): every
token must read every weight once.  Also: host time of one GraphModel.forward (enqueue
only) for 88 and 880 nodes, capture + instantiate time, and seed 001's
exercise 2 (graph speedup over eager vs n_layers); 512 tokens in one launch
(a device loop) vs 512 graph launches.

    python bench/token_loop.py [--tokens 200]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "examples")]
import deviceop as dop  # noqa: E402
from _common import gpu_device, headline, load_example, print_headlines, print_table, write_result  # noqa: E402
from _copy import copy_rate  # noqa: E402
from token_model import Config, random_weights  # noqa: E402


_example = load_example("token_loop")
capture_combinators, capture_scope, eager_forward = (_example.capture_combinators, _example.capture_scope,
                                                     _example.eager_forward)


def per_token_us(step, tokens: int, sync, stream=None, step_async=None) -> tuple[float, float, float, float]:
    """(median, p10, p90) of synchronized single tokens, then the back-to-back GPU time
    of one token (None without ``stream``), enqueued by ``step_async`` (default ``step``,
    which must then not synchronize)."""
    for i in range(5):
        step(i)
    sync()
    gpu = None
    if stream is not None:
        runs, n, enqueue = [], 40, step_async or step
        for _ in range(5):
            start = stream.record_event()
            for i in range(n):
                enqueue(i)
            end = stream.record_event()
            end.synchronize()
            runs.append(start.elapsed_ms(end) * 1e3 / n)
        gpu = statistics.median(runs)
    times = []
    for i in range(tokens):
        t0 = time.perf_counter()
        step(i)
        sync()
        times.append((time.perf_counter() - t0) * 1e6)
    times.sort()
    return statistics.median(times), times[len(times) // 10], times[-len(times) // 10 - 1], gpu


def cycled(weights, n_layers):
    return [weights[i % len(weights)] for i in range(n_layers)]


def torch_model(cfg, weights):
    import torch
    tw = [(torch.from_dlpack(w.norm_w.tensor), torch.from_dlpack(w.wq.tensor), torch.from_dlpack(w.wo.tensor))
          for w in weights]

    def forward(h):
        for norm_w, wq, wo in tw:
            n = h * torch.rsqrt(torch.mean(h * h) + cfg.eps) * norm_w
            h = h + torch.mv(wo, torch.mv(wq, n))
        return h
    return forward


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=200)
    args = ap.parse_args()
    device = gpu_device("token_loop")
    if device is None:
        return 0
    import torch
    stream = device.new_stream()
    cfg = Config()
    weights, _ = random_weights(cfg, seed=0, stream=stream)
    weight_bytes = sum(w.norm_w.tensor.nbytes + w.wq.tensor.nbytes + w.wo.tensor.nbytes for w in weights)
    rate = copy_rate(stream)
    floor_us = weight_bytes / rate * 1e6
    rng = np.random.default_rng(1)
    emb = [dop.from_numpy(rng.standard_normal(cfg.d).astype(np.float32), stream=stream) for _ in range(8)]
    raw = [[dop.empty(s, stream=stream) for s in ([1, cfg.d], [cfg.d], [cfg.d], [cfg.d])] for _ in range(cfg.n_layers)]
    sync = stream.synchronize

    eager_forward(cfg, weights, emb[0], raw, stream)  # warm-up: compile + load
    sync()
    t0 = time.perf_counter()
    combi = capture_combinators(cfg, weights, stream)
    capture_total_ms = (time.perf_counter() - t0) * 1e3
    # capture + instantiate alone: graph_on of an already-built forward (median of 5)
    from token_model import LayerBuffers, build_forward
    cap_ms = []
    for _ in range(5):
        bufs = [LayerBuffers.allocate(cfg.d, stream) for _ in range(cfg.n_layers)]
        fwd, _out = build_forward(cfg, weights, dop.empty(cfg.d, stream=stream), bufs)
        t0 = time.perf_counter()
        g = fwd.graph_on(stream)
        cap_ms.append((time.perf_counter() - t0) * 1e3)
        g.close()
    capture_ms = statistics.median(cap_ms)
    scope = capture_scope(cfg, weights, stream)

    # correctness: both graphs and torch agree with eager
    ref = eager_forward(cfg, weights, emb[1], raw, stream).sync_on(stream).numpy(stream=stream)
    tf = torch_model(cfg, weights)
    torch_stream = torch.cuda.ExternalStream(int(stream.handle))
    with torch.cuda.stream(torch_stream):
        t_out = tf(torch.from_dlpack(emb[1])).cpu().numpy()
    errs = {"graph (combinators)": combi.forward(emb[1]).numpy(stream=stream),
            "graph (scope)": scope.forward(emb[1]).numpy(stream=stream), "torch eager": t_out}
    errs = {k: float(np.linalg.norm(v - ref) / np.linalg.norm(ref)) for k, v in errs.items()}
    assert all(e < 1e-4 for e in errs.values()), f"outputs disagree: {errs}"

    res = {}
    res["deviceop eager"] = per_token_us(lambda i: eager_forward(cfg, weights, emb[i % 8], raw, stream), args.tokens, sync,
                                          stream)
    for label, model in (("combinators", combi), ("scope", scope)):
        res[f"deviceop graph ({label})"] = per_token_us(lambda i, m=model: m.forward(emb[i % 8]), args.tokens, sync,
                                                        stream, lambda i, m=model: m.forward_async(emb[i % 8]))
    temb = [torch.from_dlpack(e) for e in emb]
    with torch.cuda.stream(torch_stream):
        res["torch eager"] = per_token_us(lambda i: tf(temb[i % 8]), args.tokens, torch.cuda.synchronize, stream)
        static_in = temb[0].clone()
        for _ in range(3):
            tf(static_in)
        torch.cuda.synchronize()
        tg = torch.cuda.CUDAGraph()
        with torch.cuda.graph(tg, stream=torch_stream):
            static_out = tf(static_in)

        def torch_graph_step(i):
            static_in.copy_(temb[i % 8])
            tg.replay()
        torch_graph_step(1)
        torch.cuda.synchronize()
        assert np.linalg.norm(static_out.cpu().numpy() - ref) / np.linalg.norm(ref) < 1e-4
        res["torch.cuda.CUDAGraph"] = per_token_us(torch_graph_step, args.tokens, torch.cuda.synchronize, stream)

    # issue 7: the fused model (2 kernels a layer), fp32 and bf16 weights, with and without PDL
    from token_model import bf16_weights, build_fused_forward, fused_buffers
    wbf = bf16_weights(weights)
    bf16_bytes = sum(w.norm_w.tensor.nbytes + w.wq.tensor.nbytes + w.wo.tensor.nbytes for w in wbf)
    bf16_floor_us = bf16_bytes / rate * 1e6
    fused = {}
    for label, ws, pdl in [("fused fp32", weights, False), ("fused fp32 + PDL", weights, True),
                           ("fused bf16", wbf, False), ("fused bf16 + PDL", wbf, True)]:
        x_in = dop.empty(cfg.d, stream=stream)
        g = build_fused_forward(cfg, ws, x_in, fused_buffers(cfg, stream), pdl=pdl).graph_on(stream)
        model = dop.GraphModel(g, x_in, g.take_output())
        got = model.forward(emb[1]).numpy(stream=stream)
        err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        assert err < (1e-4 if ws is weights else 2e-2), f"{label} disagrees with eager: {err}"
        errs[label] = err
        res[f"deviceop graph, {label}"] = per_token_us(lambda i, m=model: m.forward(emb[i % 8]), args.tokens, sync,
                                                       stream, lambda i, m=model: m.forward_async(emb[i % 8]))
        fused[label] = res[f"deviceop graph, {label}"][3]

    # issue 7, part 3: 512 tokens in one graph launch (dop.loop: a conditional WHILE
    # node) vs 512 launches of the per-token graph (row in, replay, row out: bare driver calls)
    from cuda.bindings import driver as cu
    from token_model import build_device_loop
    T = 512
    inputs = dop.from_numpy(rng.standard_normal((T, cfg.d)).astype(np.float32), stream=stream)
    loop_out, launch_out = (dop.from_numpy(np.zeros((T, cfg.d), np.float32), stream=stream) for _ in range(2))
    index = dop.from_numpy(np.zeros(1, np.int32), stream=stream)
    loop_graph = build_device_loop(cfg, weights, inputs, loop_out, index, T, fused_buffers(cfg, stream), pdl=True,
                                   stream=stream).graph_on(stream)
    x_tok = dop.empty(cfg.d, stream=stream)
    tok_graph = build_fused_forward(cfg, weights, x_tok, fused_buffers(cfg, stream), pdl=True).graph_on(stream)
    h_tok, row_bytes = tok_graph.take_output(), cfg.d * 4

    def launches():
        sh, ex = stream.handle, tok_graph._exec
        for t in range(T):
            cu.cuMemcpyAsync(x_tok.data_ptr, inputs.data_ptr + t * row_bytes, row_bytes, sh)
            cu.cuGraphLaunch(ex, sh)
            cu.cuMemcpyAsync(launch_out.data_ptr + t * row_bytes, h_tok.data_ptr, row_bytes, sh)

    loop_runs, launch_runs = [], []
    for rep in range(6):  # interleaved; the first of each is a warm-up
        for run, out in ((loop_graph.replay, loop_runs), (launches, launch_runs)):
            sync()
            t0 = time.perf_counter()
            run()
            t1 = time.perf_counter()
            sync()
            if rep:
                out.append(((t1 - t0) * 1e6, (time.perf_counter() - t0) * 1e6 / T))
    assert np.array_equal(loop_out.numpy(stream=stream), launch_out.numpy(stream=stream)), \
        "the device loop and the per-token launches disagree"
    loop_host = statistics.median(h for h, _ in loop_runs)
    loop_tok = statistics.median(t for _, t in loop_runs)
    launch_host = statistics.median(h for h, _ in launch_runs)
    launch_tok = statistics.median(t for _, t in launch_runs)
    # (512 tokens end in one synchronization: their wall time per token is their GPU time)
    res["deviceop device loop (512 tokens, 1 launch), fused fp32 + PDL"] = (loop_tok, min(t for _, t in loop_runs),
                                                                           max(t for _, t in loop_runs), loop_tok)
    res["deviceop 512 graph launches, fused fp32 + PDL"] = (launch_tok, min(t for _, t in launch_runs),
                                                            max(t for _, t in launch_runs), launch_tok)
    loop_graph.close()
    tok_graph.close()

    # host time of one GraphModel.forward (enqueue only), 88 vs 880 nodes, interleaved
    # sample by sample with the same two driver calls made bare (the floor), so
    # that drift of the shared host hits both alike

    def host_forward_us(model, n=400):
        g, inp, sh = model.graph._exec, model.input, stream.handle
        ours, bare = [], []
        for i in range(n):
            sync()
            t0 = time.perf_counter()
            model.forward_async(emb[i % 8])
            t1 = time.perf_counter()
            sync()
            t2 = time.perf_counter()
            cu.cuMemcpyAsync(inp.data_ptr, emb[i % 8].data_ptr, inp.nbytes, sh)
            cu.cuGraphLaunch(g, sh)
            t3 = time.perf_counter()
            ours.append((t1 - t0) * 1e6)
            bare.append((t3 - t2) * 1e6)
        sync()
        return statistics.median(ours), statistics.median(bare)
    big_cfg = Config(n_layers=220)
    big = capture_combinators(big_cfg, cycled(weights, 220), stream)
    (host88, raw88), (host880, raw880) = host_forward_us(combi), host_forward_us(big)
    nodes88, nodes880 = combi.graph.summary()["nodes"], big.graph.summary()["nodes"]
    big.graph.close()

    # exercise 2: graph speedup over eager vs n_layers
    sweep = []
    for n in (1, 2, 4, 8, 22, 44):
        c = Config(n_layers=n)
        w = cycled(weights, n)
        r = [[dop.empty(s, stream=stream) for s in ([1, c.d], [c.d], [c.d], [c.d])] for _ in range(n)]
        m = capture_combinators(c, w, stream)
        e_us = per_token_us(lambda i: eager_forward(c, w, emb[i % 8], r, stream), 60, sync)[0]
        g_us = per_token_us(lambda i: m.forward(emb[i % 8]), 60, sync)[0]
        sweep.append({"n_layers": n, "eager_us": round(e_us, 1), "graph_us": round(g_us, 1),
                      "speedup": round(e_us / g_us, 2)})
        m.graph.close()

    graph_us = min(res["deviceop graph (combinators)"][3], res["deviceop graph (scope)"][3])
    torch_graph_us = res["torch.cuda.CUDAGraph"][3]
    rows, table = [], []
    for name, (med, p10, p90, gpu) in res.items():
        floor = bf16_floor_us if "bf16" in name else floor_us  # each against the bytes it must read
        rows.append({"variant": name, "gpu_us_per_token": round(gpu, 1), "vs_floor": round(gpu / floor, 3),
                     "synced_us_per_token": round(med, 1), "synced_p10": round(p10, 1), "synced_p90": round(p90, 1),
                     "synced_vs_floor": round(med / floor, 3)})
        table.append([name, f"{gpu:.1f}", f"{gpu / floor:.2f}x", f"{med:.1f}", f"{p10:.0f}-{p90:.0f}"])
    rows.append({"variant": "floor (weights / copy rate)", "us_per_token": round(floor_us, 1),
                 "weight_bytes": weight_bytes, "copy_rate_TBps": round(rate / 1e12, 3)})
    rows.append({"variant": "bf16 floor (weights / copy rate)", "us_per_token": round(bf16_floor_us, 1),
                 "weight_bytes": bf16_bytes})
    fp32_fused = min(fused["fused fp32"], fused["fused fp32 + PDL"])
    bf16_fused = min(fused["fused bf16"], fused["fused bf16 + PDL"])
    heads = [headline("graph_vs_floor", graph_us / floor_us, 1.6, "lower"),
             headline("fused_graph_vs_floor", fp32_fused / floor_us, 1.15, "lower"),
             headline("fused_speedup_vs_torch_graph", torch_graph_us / fp32_fused, 2.0, "higher"),
             headline("bf16_graph_vs_floor", bf16_fused / bf16_floor_us, 1.2, "lower"),
             headline("speedup_vs_torch_graph", torch_graph_us / graph_us, 1.4, "higher"),
             headline("forward_host_us_880_nodes", host880, 10, "lower"),
             headline("capture_ms_88_nodes", capture_ms, 50, "lower"),
             headline("device_loop_host_us_512_tokens", loop_host, 100, "lower"),
             headline("device_loop_vs_graph_launches_per_token", loop_tok / launch_tok, 1.0, "lower")]
    extra = {"floor_us": round(floor_us, 1), "copy_rate_TBps": round(rate / 1e12, 3),
             "host_forward_us": {"88_nodes": round(host88, 2), "880_nodes": round(host880, 2),
                                 "raw_driver_88_nodes": round(raw88, 2), "raw_driver_880_nodes": round(raw880, 2),
                                 "nodes": [nodes88, nodes880]},
             "capture_ms": {"graph_on_median": round(capture_ms, 2), "alloc_build_capture": round(capture_total_ms, 2)},
             "rel_err_vs_eager": errs, "exercise2_speedup_vs_layers": sweep,
             "bf16_floor_us": round(bf16_floor_us, 1),
             "device_loop_512_tokens": {"host_us_one_launch": round(loop_host, 1),
                                        "us_per_token": round(loop_tok, 2),
                                        "graph_launches_host_us": round(launch_host, 1),
                                        "graph_launches_us_per_token": round(launch_tok, 2)},
             "pdl_gain": {"fp32": round(fused["fused fp32"] / fused["fused fp32 + PDL"], 3),
                          "bf16": round(fused["fused bf16"] / fused["fused bf16 + PDL"], 3)}}
    path = write_result("token_loop", device, rows, heads, extra)
    print_table(f"token loop, 22 layers, d=2048, on {device.name} (us/token; synced: median of {args.tokens})",
                ["variant", "GPU us/token", "vs floor", "synced us/token", "p10-p90"], table)
    print(f"floor {floor_us:.1f} us ({weight_bytes / 1e6:.0f} MB at {rate / 1e12:.2f} TB/s); bf16 floor "
          f"{bf16_floor_us:.1f} us ({bf16_bytes / 1e6:.0f} MB)")
    print(f"PDL: fp32 {fused['fused fp32']:.1f} -> {fused['fused fp32 + PDL']:.1f} us, "
          f"bf16 {fused['fused bf16']:.1f} -> {fused['fused bf16 + PDL']:.1f} us")
    print(f"GraphModel.forward host time: {host88:.2f} us ({nodes88} nodes), {host880:.2f} us ({nodes880} nodes); "
          f"the bare driver calls: {raw88:.2f} / {raw880:.2f} us")
    print(f"capture + instantiate (88 nodes): {capture_ms:.2f} ms")
    print(f"512 tokens: device loop {loop_tok:.1f} us/token, {loop_host:.1f} us of host time for one launch; "
          f"512 graph launches {launch_tok:.1f} us/token, {launch_host:.0f} us of host time")
    print("exercise 2 (graph speedup over eager): " + ", ".join(f"{s['n_layers']}L {s['speedup']}x" for s in sweep))
    print_headlines(heads, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
