"""A tensor-parallel rank's decode kernels run alone at its shard's shapes: each kernel's current
plan against a sweep of plan variants, on one GPU (issue 35: the TP targets are bounded by the
kernels' fixed costs at a shard's smaller matrices).

Shapes (bench/_shard_plans.py): Llama-3.2-1B and Llama-3.1-8B whole and as one rank of TP=2 and
TP=4 (1b, 1b/2, 1b/4, 8b, 8b/2, 8b/4: hidden size unchanged; heads, KV heads, intermediate size and
vocabulary divided), and SmolLM2-135M whole (smollm2, issue 37's small model).  Kernels:
rms_qkv_rope, attn_decode (KV capacity 4096, at positions 56 -- the middle of a 32-token prompt and
48 new tokens -- and 1023), matvec_residual as the O and as the down projection, rms_gate_up_silu,
rms_lm_head_argmax.  "current" is the plan examples/llama launches
(checked against its launch_plans), so a rerun after TUNED entries are added times those.

Timing, as bench/llama_kernels_proj.py: a CUDA graph of n launches of one kernel and plan, each with
PDL and its own weights (windows of a 2 GB pool of random bf16 at advancing addresses; n >= 16, the
LM head >= 4, and enough that a replay streams >= 160 MB, 3x the L2), replayed back to back, median
of 5 runs; a launch's time = the graph's / n.  floor = the launch's bytes / the device-to-device
copy rate measured in the same run ("x fl" = us / floor).  Each variant's output (the last
launch's) is compared with the current plan's: one that computes something else is BAD, never chosen.

Sweep, per shape and kernel: stage 1 the grid and CTA shape (_shard_plans.sweep), stage 2 the loads
in flight around stage 1's fastest (_shard_plans.refine), then the current plan and the contenders
timed again (reported: the mean of both timings; attention ranks by position 56 among plans at most
3% slower than the current at 1023).  Printed per shape: each kernel's current and best plan (us,
x floor, registers, CTAs a SM holds, "fill": the share of the SMs' room one wave takes), the
estimated saving a layer and a token, the runners-up; then a chain of 16 layers (qkv, attention, O,
gate/up, down) in one graph, us a layer at both positions, with the current plans, the fastest, the
fastest the fused TP all-reduce can launch (O and down: <= 132 CTAs, rows in pairs), and the fastest
leaving half the SMs' room free among those (fill <= 0.5: the next kernel's CTAs fit beside them
under PDL).  Last, the kernels/llama_tuned.py TUNED entries the numbers support, ready to paste
(and, commented, a shape's room-leaving set where its chain was the fastest).

    PYTHONPATH=. python bench/llama_kernels_shard.py [--shape all|1b|1b/2|1b/4|8b|8b/2|8b/4 ...] [--budget 280]

Runtime: about 2-3 minutes on one H100 or H200 (~900 plans compiled on every core, then ~1300 timed
graphs); past --budget seconds (from the start) the sweeps stop, shape by shape (the current plans,
the contenders found so far and the chains are still timed; "skipped" counts what was not).
DEVICEOP_BENCH_OUT=dir also writes every row to dir/llama_kernels_shard.json.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "examples")]
from deviceop.distributed.launch import NO_MULTICAST  # noqa: E402 - loads no NCCL

os.environ.update(NO_MULTICAST)  # nothing here uses NCCL; should anything load it, multicast stays off
import ml_dtypes  # noqa: E402

import _shard_plans as sp  # noqa: E402
import deviceop as dop  # noqa: E402
from _common import gpu_device, print_table, replay_us, write_result  # noqa: E402
from _copy import copy_rate  # noqa: E402
from deviceop import api, zip_  # noqa: E402
from deviceop.kernels import llama_attn as la  # noqa: E402
from deviceop.kernels import llama_proj as lp  # noqa: E402

EPS, QKV_CAP, CHAIN_LAYERS, POSITIONS = 1e-5, 64, 16, sp.POSITIONS
POOL = 1 << 30             # bf16 elements of the weight pool (2 GB)
SAVE_MIN, SAVE_FRAC = 0.10, 0.03   # a TUNED entry is suggested for a saving of >= both (us, share)


class Pool:
    """Random bf16 ~N(0, 0.02), cut into windows at advancing addresses: a window's bytes come
    round again only after the rest of the pool (or are too many for the L2 anyway)."""

    def __init__(self, stream):
        chunk = min(1 << 25, POOL)
        host = (np.random.default_rng(0).standard_normal(chunk, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
        src = dop.from_numpy(host, stream=stream)
        self.t = dop.empty([POOL], "bfloat16", stream=stream)
        for a in range(0, POOL, chunk):
            n = min(chunk, POOL - a)
            api.memcpy(self.t[a:a + n], src[:n]).sync_on(stream)
        self.at = 0

    def take(self, *shape):
        n = math.prod(shape)
        if self.at + n > POOL:
            self.at = 0
        view = self.t[self.at:self.at + n].view(list(shape))
        self.at += -(-n // 128) * 128
        return view


class Bench:
    def __init__(self, device, stream, rate):
        self.device, self.stream, self.rate = device, stream, rate
        self.pool = Pool(stream)
        self.sms = device.sm_count or 132

    # -- buffers of one shape -------------------------------------------------------------------
    def setup(self, s: dict) -> None:
        st, rng = self.stream, np.random.default_rng(1)
        f32 = lambda n: dop.from_numpy(rng.standard_normal(n, dtype=np.float32), stream=st)  # noqa: E731
        ints = lambda v, t=np.int32: dop.from_numpy(np.asarray(v, t), stream=st)  # noqa: E731
        d, q, inter, hd, hkv = s["d"], s["q"], s["inter"], s["hd"], s["hkv"]
        self.s = s
        self.h_in, self.h_res, self.q_in, self.act_in, self.h0_init = f32(d), f32(d), f32(q), f32(inter), f32(d)
        self.q_out, self.attn_out, self.act_out = f32(q), f32(q), f32(inter)
        self.h_out, self.h0, self.h1 = f32(d), f32(d), f32(d)
        self.kc, self.vc = (dop.zeros([hkv, QKV_CAP, hd], "bfloat16", stream=st) for _ in range(2))
        self.ck, self.cv = (dop.zeros([CHAIN_LAYERS, hkv, sp.CAP, hd], "bfloat16", stream=st) for _ in range(2))
        self.inv_freq = dop.from_numpy((1.0 / 500000 ** (np.arange(0, hd, 2) / hd)).astype(np.float32), stream=st)
        self.qpos, self.pos, self.error, self.token = ints([QKV_CAP - 8]), ints([POSITIONS[0]]), ints([0]), ints([0])
        self.work = ints([0, 0], np.uint64)
        self.logits = {}

    def set_pos(self, p: int) -> None:
        api.memcpy(self.pos, dop.from_numpy(np.array([p], np.int32), stream=self.stream)).sync_on(self.stream)

    def alone(self, kind: str) -> dict:
        """The vectors a launch of ``kind`` reads and writes when timed on its own."""
        return {"qkv": dict(x=self.h_in, out=self.q_out), "attn": dict(x=self.q_in, out=self.attn_out),
                "o": dict(x=self.q_in, out=self.h_out, res=self.h_res), "gate_up": dict(x=self.h_in, out=self.act_out),
                "down": dict(x=self.act_in, out=self.h_out, res=self.h_res), "lm_head": dict(x=self.h_in)}[kind]

    def op(self, v: sp.Variant, ws=None, io: dict | None = None):
        """One launch of ``v`` on fresh windows of the pool; ``io``: its vectors (default: alone's),
        and in a chain the layer's caches ``kc``/``vc`` (at the position attention reads)."""
        s, pool, tile, k = self.s, self.pool, v.tile, v.kind
        io = io or self.alone(k)
        d, x, chained = s["d"], io["x"], "kc" in io
        if k == "qkv":
            rows = (s["hq"] + 2 * s["hkv"]) * s["hd"]
            kc, vc, pos, cap = (io["kc"], io["vc"], self.pos, sp.CAP) if chained else (self.kc, self.vc, self.qpos,
                                                                                      QKV_CAP)
            launch = lp.rms_qkv_rope(io["out"].partition([tile]), x, pool.take(d), pool.take(rows, d), self.inv_freq,
                                     pos, kc, vc, self.error, EPS, cap)
        elif k in ("o", "down"):
            launch = lp.matvec_residual(io["out"].partition([tile]), x, pool.take(d, x.shape[0]), io["res"])
        elif k == "gate_up":
            launch = lp.rms_gate_up_silu(io["out"].partition([tile]), x, pool.take(d), pool.take(2 * s["inter"], d), EPS)
        elif k == "lm_head":
            rows = v.plan[1]
            if rows not in self.logits:
                self.logits[rows] = dop.empty([rows], stream=self.stream)
            launch = lp.rms_lm_head_argmax(self.logits[rows].partition([tile]), x, pool.take(d),
                                           pool.take(s["vocab"], d), self.token, self.work, self.error, EPS, s["vocab"])
        else:
            shape = (s["hkv"], sp.CAP, s["hd"])
            kc, vc = (io["kc"], io["vc"]) if chained else (pool.take(*shape), pool.take(*shape))
            launch = la.attn_decode(io["out"].partition([tile]), x, kc, vc, self.pos, ws[0], ws[1], sp.CAP)
        return launch.generics(v.gen).pdl(True)

    def output(self, v: sp.Variant) -> np.ndarray:
        st, k = self.stream, v.kind
        if k == "lm_head":
            return np.append(self.logits[v.plan[1]].numpy(stream=st)[:self.s["vocab"]], self.token.numpy(stream=st))
        return self.alone(k)["out"].numpy(stream=st)

    def ws(self, splits: int):
        s = self.s
        return la.attn_buffers(s["hkv"], s["hd"], s["group"], splits, stream=self.stream)

    def graph_us(self, graph) -> float:
        graph.replay()
        one = replay_us(graph, self.stream, batch=1, reps=1, warmup=1)
        return replay_us(graph, self.stream, batch=max(2, min(64, int(1500 / max(one, 1.0)))), reps=5, warmup=1)

    def measure(self, v: sp.Variant) -> dict:
        """us a launch (attention: at each position) and the last launch's output."""
        n, self.pool.at = sp.launches(v.kind, self.s), 0
        ws = self.ws(v.gen[2]) if v.kind == "attn" else None
        graph = zip_(*[self.op(v, ws) for _ in range(n)]).graph_on(self.stream)
        out = {}
        for p in (POSITIONS if v.kind == "attn" else (None,)):
            if p is not None:
                self.set_pos(p)
            out[p] = (self.graph_us(graph) / n, self.output(v))
        graph.close()
        return out

    def resources(self, v: sp.Variant) -> dict:
        """Registers, spill bytes, CTAs a SM holds, and the share of the SMs' room a wave takes."""
        fn = sp.KERNELS[v.kind].function(self.device, tuple(v.gen))
        dyn = 4 * v.gen[4] * v.gen[0] if v.kind == "attn" else lp.x_shared(v.gen[0])
        try:
            from cuda.bindings import driver as cu
            a = fn.attributes
            err, occ = cu.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn.handle, 32 * v.warps, dyn)
            occ = int(occ) if int(err) == 0 else 0
        except Exception:  # noqa: BLE001 - a device without the query (the reference device): unknown
            a, occ = {"num_regs": 0, "local_bytes": 0}, 0
        fill = -(-v.grid(self.s) // self.sms) / occ if occ else float("inf")
        return dict(regs=a["num_regs"], spill=a["local_bytes"], occ=occ, fill=round(fill, 2))


# -- the sweep of one kernel at one shape ------------------------------------------------------------

def compile_all(items) -> set:
    """Compile (kernel, generics) pairs on every core; the keys of those that fail."""
    items = list({(k.name, tuple(g)): (k, list(g)) for k, g in items}.values())
    try:
        dop.precompile(items)
        return set()
    except Exception:  # find which, one at a time (still in parallel)
        from concurrent.futures import ThreadPoolExecutor

        def fails(item):
            try:
                dop.precompile([item], threads=1)
            except Exception as exc:  # noqa: BLE001 - a variant that does not compile is dropped, named
                print(f"  does not compile: {item[0].name}{item[1]}: {str(exc).splitlines()[0][:160]}")
                return (item[0].name, tuple(item[1]))
        with ThreadPoolExecutor(os.cpu_count()) as ex:
            return {f for f in ex.map(fails, items) if f}


def rel_diff(a: np.ndarray, ref: np.ndarray) -> float:
    if not np.isfinite(a).all():
        return math.inf
    return float(np.max(np.abs(a.astype(np.float64) - ref)) / max(np.max(np.abs(ref)), 1e-30))


class KernelSweep:
    """Every plan timed for one kernel at one shape: key (tile, generics) -> record."""

    def __init__(self, bench: Bench, kind: str, s: dict):
        self.b, self.kind, self.s = bench, kind, s
        self.recs, self.ref, self.skipped = {}, None, 0
        self.cur = self.run(sp.current(kind, s), "current")

    def run(self, v: sp.Variant, stage: str) -> dict:
        key = (v.tile, tuple(v.gen))
        m = self.b.measure(v)
        rec = self.recs.get(key)
        if rec is None:
            if self.ref is None:
                self.ref = {p: out.astype(np.float64) for p, (_, out) in m.items()}
            rel = max(rel_diff(out, self.ref[p]) for p, (_, out) in m.items())
            same_token = v.kind != "lm_head" or all(out[-1] == self.ref[p][-1] for p, (_, out) in m.items())
            rec = self.recs[key] = dict(v=v, stage=stage, runs=[], rel=rel, ok=rel < 2e-3 and same_token,
                                        **self.b.resources(v))
        rec["runs"].append({p: us for p, (us, _) in m.items()})
        rec["us"] = {p: float(np.mean([r[p] for r in rec["runs"]])) for p in rec["runs"][0]}
        return rec

    def score(self, rec: dict) -> float:
        """What ranks a plan: its us (attention: at the first position, unless slower at the last
        by more than 3% than the current plan); a plan that computes something else never wins."""
        if not rec["ok"]:
            return math.inf
        us = rec["us"]
        if self.kind == "attn":
            return us[POSITIONS[0]] if us[POSITIONS[-1]] <= 1.03 * self.cur["us"][POSITIONS[-1]] else math.inf
        return us[None]

    def best(self, where=lambda rec: True) -> dict:
        return min((r for r in self.recs.values() if where(r)), key=self.score, default=self.cur)

    def best_tp(self) -> dict:
        return self.best(lambda r: r["v"].tp_ok(self.s))

    def room(self) -> dict:
        """The fastest plan the fused TP all-reduce can launch whose wave leaves half the SMs' room
        free (else the fastest it can launch)."""
        def roomy(r):
            return r["fill"] <= 0.5 and r["v"].tp_ok(self.s)
        found = any(roomy(r) and self.score(r) < math.inf for r in self.recs.values())
        return self.best(roomy) if found else self.best_tp()

    def sweep(self, variants, stage: str, deadline: float, failed: set) -> None:
        for v in variants:
            if (v.tile, tuple(v.gen)) in self.recs or (sp.KERNELS[v.kind].name, tuple(v.gen)) in failed:
                continue
            if time.monotonic() > deadline:
                self.skipped += 1
                continue
            try:
                self.run(v, stage)
            except Exception as exc:  # noqa: BLE001 - one plan that cannot launch must not cost the others
                failed.add((sp.KERNELS[v.kind].name, tuple(v.gen)))
                print(f"  {self.s['name']} {self.kind} {v.label(self.s)} failed: {str(exc).splitlines()[0][:160]}")

    def confirm(self) -> None:
        """Time the current plan and the contenders once more (the mean of both is reported)."""
        top = sorted(self.recs.values(), key=self.score)[:3]
        seen = set()
        for rec in [self.cur, self.best(), self.best_tp(), self.room(), *top]:
            key = (rec["v"].tile, tuple(rec["v"].gen))
            if key not in seen and len(rec["runs"]) == 1:
                seen.add(key)
                self.run(rec["v"], rec["stage"])


def sweep_shape(b: Bench, s: dict, shape_deadline: float, failed: set) -> dict:
    out = {}
    for i, kind in enumerate(sp.KINDS):
        t0 = time.monotonic()
        deadline = t0 + (shape_deadline - t0) / (len(sp.KINDS) - i)   # an equal share of what is left
        ks = KernelSweep(b, kind, s)
        ks.sweep(sp.sweep(kind, s), "sweep", deadline, failed)
        around = [v for v in sp.refine(ks.best()["v"], s) if (v.tile, tuple(v.gen)) not in ks.recs]
        around = around if time.monotonic() < deadline else []
        failed |= compile_all([(sp.KERNELS[kind], v.gen) for v in around]) if around else set()
        ks.sweep(around, "refine", deadline, failed)
        ks.confirm()
        ks.seconds = time.monotonic() - t0
        out[kind] = ks
    return out


# -- the chain: 16 layers in one graph ----------------------------------------------------------------

def chain(b: Bench, plans: dict) -> dict:
    """us a layer of 16 x (qkv, attention, O, gate/up, down) at each position, and the hidden
    vector after one step from the same start (to compare the plan sets)."""
    b.pool.at, st = 0, b.stream
    ws = b.ws(plans["attn"].gen[2])
    ops = []
    for i in range(CHAIN_LAYERS):
        cache = dict(kc=b.ck[i], vc=b.cv[i])
        ops += [b.op(plans["qkv"], io=dict(x=b.h0, out=b.q_out, **cache)),
                b.op(plans["attn"], ws, io=dict(x=b.q_out, out=b.attn_out, **cache)),
                b.op(plans["o"], io=dict(x=b.attn_out, out=b.h1, res=b.h0, **cache)),
                b.op(plans["gate_up"], io=dict(x=b.h1, out=b.act_out, **cache)),
                b.op(plans["down"], io=dict(x=b.act_out, out=b.h0, res=b.h1, **cache))]
    graph = zip_(*ops).graph_on(st)
    res = {}
    for p in POSITIONS:
        b.set_pos(p)
        api.memcpy(b.h0, b.h0_init).sync_on(st)
        graph.replay()
        h = b.h0.numpy(stream=st)
        res[p] = (b.graph_us(graph) / CHAIN_LAYERS, h)
    graph.close()
    return res


def chain_sets(sweeps: dict) -> dict:
    """name -> kind -> Variant: the current plans, the fastest, the fastest the fused TP all-reduce
    can launch, the fastest leaving half the SMs' room free; each set once."""
    sets = {"current": {k: ks.cur["v"] for k, ks in sweeps.items()},
            "best": {k: ks.best()["v"] for k, ks in sweeps.items()},
            "best, TP-fusable O/down": {k: ks.best_tp()["v"] for k, ks in sweeps.items()},
            "TP-fusable leaving room": {k: ks.room()["v"] for k, ks in sweeps.items()}}
    out, seen = {}, set()
    for name, plans in sets.items():
        key = tuple((plans[k].tile, tuple(plans[k].gen)) for k in sp.LAYER)
        if key not in seen:
            seen.add(key)
            out[name] = plans
    return out


# -- reporting ---------------------------------------------------------------------------------------------

def row_name(kind: str, p) -> str:
    return f"attn@{p}" if p is not None else kind


def report(b: Bench, s: dict, sweeps: dict, chains: dict) -> list:
    """Print the shape's tables; return its JSON rows."""
    rate, rows, table, layer = b.rate, [], [], {"current": {}, "best": {}}
    for kind, ks in sweeps.items():
        cur, best = ks.cur, ks.best()
        for p in (POSITIONS if kind == "attn" else (None,)):
            floor = sp.launch_bytes(kind, s, p if p is not None else POSITIONS[0]) / rate * 1e6
            c, bb = cur["us"][p], best["us"][p]
            table.append([row_name(kind, p), f"{floor:.2f}", cur["v"].label(s), f"{c:.2f}", f"{c / floor:.2f}",
                          cur["regs"], cur["occ"], cur["fill"], best["v"].label(s), f"{bb:.2f}", f"{bb / floor:.2f}",
                          best["occ"], best["fill"], f"{bb - c:+.2f}",
                          f"{len(ks.recs)}" + (f"+{ks.skipped} skipped" if ks.skipped else "")])
            if kind in sp.LAYER and p in (None, POSITIONS[0]):
                layer["current"][kind], layer["best"][kind] = c, bb
        for rec in ks.recs.values():
            v = rec["v"]
            rows.append(dict(shape=s["name"], kernel=kind, label=v.label(s), stage=rec["stage"], kwargs=v.kwargs(s),
                             generics=v.gen, grid=v.grid(s), warps=v.warps, tp_ok=v.tp_ok(s), ok=rec["ok"],
                             rel_diff=rec["rel"], regs=rec["regs"], spill=rec["spill"], occ=rec["occ"],
                             fill=rec["fill"], us={str(p): round(u, 3) for p, u in rec["us"].items()},
                             runs=[{str(p): round(u, 3) for p, u in r.items()} for r in rec["runs"]],
                             current=rec is cur))
    print(f"\n== {s['name']}: hidden {s['d']}, heads {s['hq']}/{s['hkv']} x {s['hd']}, intermediate {s['inter']}, "
          f"vocab {s['vocab']} (a rank of TP={s['tp']}); copy rate {rate / 1e12:.3f} TB/s ==")
    print_table("per launch (us; x fl = x the copy-rate floor; occ = CTAs a SM holds; fill = share of the SMs' room "
                "one wave takes)",
                ["kernel", "floor", "current", "us", "x fl", "regs", "occ", "fill", "best", "us", "x fl", "occ", "fill",
                 "change", "timed"], table)
    cur_l, best_l = sum(layer["current"].values()), sum(layer["best"].values())
    head = sweeps["lm_head"]
    head_save = head.cur["us"][None] - head.best()["us"][None]
    print(f"a layer (qkv + attn@{POSITIONS[0]} + o + gate_up + down, alone): current {cur_l:.2f} us, best "
          f"{best_l:.2f} ({best_l - cur_l:+.2f} us a layer, {(best_l - cur_l) * s['layers']:+.1f} a token over "
          f"{s['layers']} layers; LM head {-head_save:+.2f})")
    for kind in ("o", "down"):
        ks = sweeps[kind]
        tp = ks.best_tp()
        if tp is not ks.best():
            print(f"{kind}: best the fused TP all-reduce can launch: {tp['v'].label(s)} {tp['us'][None]:.2f} us")
    for kind, ks in sweeps.items():
        p = POSITIONS[0] if kind == "attn" else None
        top = sorted((r for r in ks.recs.values() if r is not ks.cur), key=ks.score)[:4]
        bad = sum(not r["ok"] for r in ks.recs.values())
        print(f"  {row_name(kind, p)} runners-up: " + "; ".join(f"{r['v'].label(s)} {r['us'][p]:.2f}" for r in top)
              + (f"  [{bad} BAD: output differs]" if bad else "") + f"  ({ks.seconds:.1f} s)")
    floors = {p: sum(sp.launch_bytes(k, s, p) for k in sp.LAYER) / rate * 1e6 for p in POSITIONS}
    ref = chains.get("current")
    ctab = []
    for name, res in chains.items():
        diff = max(rel_diff(res[p][1], ref[p][1].astype(np.float64)) for p in POSITIONS)
        ctab.append([name] + [f"{res[p][0]:.2f} ({res[p][0] - floors[p]:+.2f})" for p in POSITIONS]
                    + [f"{diff:.1e}" + ("" if diff < 1e-2 else " DIFFERS")])
        rows.append(dict(shape=s["name"], chain=name, us_per_layer={str(p): round(res[p][0], 3) for p in POSITIONS},
                         floor_per_layer={str(p): round(floors[p], 3) for p in POSITIONS}))
    print_table(f"chain: {CHAIN_LAYERS} layers in one graph, us a layer (over its floor)",
                ["plans"] + [f"pos {p}" for p in POSITIONS] + ["hidden vs current"], ctab)
    return rows


def suggestions(shapes: dict) -> list:
    """The TUNED entries the numbers support: per key, the largest saving >= SAVE_MIN us and
    SAVE_FRAC of the current; O and down: the best the fused TP all-reduce can launch.  Each
    says how its shape's chain of the chosen plans differs a layer from the current plans'."""
    found = {}
    for s, sweeps, chains in shapes.values():
        chosen = chains.get("best, TP-fusable O/down", chains["best"]) if "best" in chains else chains["current"]
        change = {p: chosen[p][0] - chains["current"][p][0] for p in POSITIONS}
        for kind, ks in sweeps.items():
            cur = ks.cur
            picks = [ks.best_tp()] if kind in ("o", "down") else [ks.best()]
            if kind in ("o", "down") and ks.best() is not picks[0]:
                picks.append(ks.best())
            for i, rec in enumerate(picks):
                p = POSITIONS[0] if kind == "attn" else None
                save = cur["us"][p] - rec["us"][p]
                if rec is cur or save < SAVE_MIN or save < SAVE_FRAC * cur["us"][p]:
                    continue
                key = sp.table_key(kind, s)
                note = (f"{s['name']} {row_name(kind, p)}: {cur['v'].label(s)} {cur['us'][p]:.2f} -> "
                        f"{rec['v'].label(s)} {rec['us'][p]:.2f} us" + (" (not TP-fusable)" if i else "")
                        + f"; its shape's chain {', '.join(f'@{q} {c:+.2f}' for q, c in change.items())} us/layer")
                found.setdefault(key, []).append((i, -save, rec["v"].kwargs(s), note))
    lines = []
    for key, options in found.items():
        options.sort(key=lambda o: (o[0], o[1]))
        lines.append(f"    {key!r}: {options[0][2]!r},  # {options[0][3]}")
        lines += [f"    # or {o[2]!r}  # {o[3]}" for o in options[1:]]
    for s, sweeps, chains in shapes.values():   # where leaving room beat the fastest plans in the chain
        room, p = chains.get("TP-fusable leaving room"), POSITIONS[0]
        rivals = [chains[n][p][0] for n in ("current", "best, TP-fusable O/down", "best") if n in chains]
        if room is None or room[p][0] > 0.99 * min(rivals):
            continue
        lines.append(f"    # {s['name']}: the chain of TP-fusable plans leaving room was fastest "
                     f"({room[p][0]:.2f} us a layer at {p}, others {', '.join(f'{r:.2f}' for r in rivals)}); its entries:")
        for kind in sp.LAYER:
            ks = sweeps[kind]
            rec = ks.room()
            if rec is not ks.cur:
                lines.append(f"    #   {sp.table_key(kind, s)!r}: {rec['v'].kwargs(s)!r},  # {kind} {rec['v'].label(s)}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=["all"], choices=["all", *sp.SHAPES])
    parser.add_argument("--budget", type=float, default=280.0, help="seconds before the sweeps stop (default 280)")
    args = parser.parse_args()
    t0 = time.monotonic()
    names = list(sp.SHAPES) if "all" in args.shape else args.shape
    device = gpu_device("llama_kernels_shard")
    if device is None:
        return 0
    check_current_plans(names)
    stream = device.new_stream()
    rate = copy_rate(stream)
    items = {(sp.KERNELS[k].name, tuple(v.gen)): (sp.KERNELS[k], v.gen) for n in names for k in sp.KINDS
             for v in [sp.current(k, sp.shape(n)), *sp.sweep(k, sp.shape(n))]}
    failed = compile_all(items.values())
    t_compile = time.monotonic() - t0
    b = Bench(device, stream, rate)
    print(f"device {device.name}, {b.sms} SMs; copy rate {rate / 1e12:.3f} TB/s; {len(items)} plans compiled in "
          f"{t_compile:.0f} s ({len(failed)} failed); setup {time.monotonic() - t0 - t_compile:.0f} s")
    shapes, rows = {}, []
    for i, name in enumerate(names):
        s = sp.shape(name)
        b.setup(s)
        left = args.budget - (time.monotonic() - t0) - 6 * (len(names) - i)   # ~6 s a shape for its chains
        deadline = time.monotonic() + left / (len(names) - i)
        sweeps = sweep_shape(b, s, deadline, failed)
        chains = {n: chain(b, plans) for n, plans in chain_sets(sweeps).items()}
        rows += report(b, s, sweeps, chains)
        shapes[name] = (s, sweeps, chains)
        err = int(b.error.numpy(stream=stream)[0])
        if err:
            print(f"WARNING: the kernels set the error word to {err} at {name}")
    lines = suggestions(shapes)
    print("\nllama_tuned.TUNED entries these numbers support (kernels/llama_tuned.py; saving >= "
          f"{SAVE_MIN} us and >= {SAVE_FRAC:.0%}; O/down: the best the fused TP all-reduce can launch):")
    print("\n".join(lines) if lines else "    (none)")
    print(f"\nelapsed {time.monotonic() - t0:.0f} s")
    if os.environ.get("DEVICEOP_BENCH_OUT"):
        path = write_result("llama_kernels_shard", device, rows, [], extra={
            "copy_rate_GBps": round(rate / 1e9, 1), "positions": list(POSITIONS), "tuned_suggestions": lines})
        print(f"wrote {path}")
    return 0


def check_current_plans(names) -> None:
    """The plans called current here are the ones examples/llama launches at each shard."""
    from llama.config import LLAMA_3_1_8B, LLAMA_3_2_1B, SMOLLM2_135M
    from llama.plans import launch_plans
    from llama.tp import Shard
    for name in names:
        s = sp.shape(name)
        cfg = {"1b": LLAMA_3_2_1B, "8b": LLAMA_3_1_8B, "smollm2": SMOLLM2_135M}[name.partition("/")[0]]
        plans = launch_plans(cfg, sp.CAP, Shard(cfg, 0, s["tp"]))
        for kind in sp.KINDS:
            model = plans["head" if kind == "lm_head" else kind]
            assert model == sp.plan(kind, s), f"{name} {kind}: the model launches {model}, not {sp.plan(kind, s)}"


if __name__ == "__main__":
    raise SystemExit(main())
