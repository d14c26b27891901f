"""Compiling kernels ahead of time, and progress bars on long work (issue 26, item 10):
a tqdm bar when stderr is a terminal and tqdm is installed, none otherwise."""
import sys
import types

import numpy as np
import pytest

import deviceop as dop
from deviceop import GraphCache
from deviceop.kernel import precompile as pc
from deviceop.kernels import add, batch_tile, matvec_batched


class Terminal:
    """A stand-in stderr that says it is a terminal."""

    def __init__(self, tty: bool):
        self.tty, self.text = tty, []

    def isatty(self):
        return self.tty

    def write(self, s):
        self.text.append(s)

    def flush(self):
        pass


@pytest.fixture
def bars(monkeypatch):
    """A fake tqdm module: each bar it makes is recorded as (desc, total, items seen)."""
    made = []

    def tqdm(iterable, total, desc, **kw):
        made.append([desc, total, 0])
        for x in iterable:
            made[-1][2] += 1
            yield x

    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=tqdm))
    return made


def test_precompile_compiles_in_threads_with_a_bar_on_a_terminal(monkeypatch, bars):
    monkeypatch.setattr(sys, "stderr", Terminal(True))
    generics = [(add, [640]), (add, [768]), (add, [896])]  # multiples of 128 no other test compiles
    assert dop.precompile(generics, arch="sm_90", threads=2) == 3
    assert all(("sm_90", (b,)) in add._compiled for b in (640, 768, 896))
    assert bars == [["compiling for sm_90", 3, 3]]


def test_no_bar_off_a_terminal_or_without_tqdm(monkeypatch, bars):
    monkeypatch.setattr(sys, "stderr", Terminal(False))
    assert dop.precompile([(add, [1152]), (add, [1280])], arch="sm_90") == 2 and bars == []
    monkeypatch.setattr(sys, "stderr", Terminal(True))
    monkeypatch.setitem(sys.modules, "tqdm", None)      # not installed: import fails, no bar, the work is done
    assert dop.precompile([(add, [1408]), (add, [1536])], arch="sm_90") == 2
    assert ("sm_90", (1536,)) in add._compiled and bars == []


def test_precompile_checks_every_item_before_compiling():
    with pytest.raises(dop.LaunchError, match="takes 1 generics"):
        dop.precompile([(add, [1664]), (add, [1, 2])], arch="sm_90")
    assert ("sm_90", (1664,)) not in add._compiled
    with pytest.raises(dop.LaunchError, match=r"\(kernel, generics\) pairs"):
        dop.precompile(["add"], arch="sm_90")


def test_precompile_refuses_generics_the_kernels_limits_refuse():
    # a launch refuses them with the kernel's own message; precompile compiled them anyway
    # (NVRTC's static_assert failure here, an unlaunchable CUBIN without one)
    def limits(g):
        if g["B"] > 1024:
            raise dop.LaunchError(f"B={g['B']} is above 1024: pick a B of at most 1024")

    k = dop.Kernel("capped", "template <int B> __global__ void capped(float* o) { static_assert(B <= 1024); }",
                   [dop.Out("o", "float32", tile=("B",))], generics=["B"], limits=limits)
    with pytest.raises(dop.LaunchError, match="B=2048 is above 1024"):
        dop.precompile([(k, [2048])], arch="sm_90")
    assert k._compiled == set()


def test_graph_cache_warmup_shows_a_bar_over_its_sizes(monkeypatch, bars, stream, rng):
    K, N, BN, BK = 256, 128, 16, 2
    w = dop.from_numpy((rng.standard_normal((N, K)) / 16).astype(np.float32), stream=stream)

    def forward(ws, x):
        y = ws.empty([ws.size, N])
        mb = batch_tile(ws.size)
        return matvec_batched(y.partition([mb, BN]), x, w).generics([BN, BK, K, mb]).first().unpartition()

    cache = GraphCache(forward, stream=stream, max_size=8)
    monkeypatch.setattr(sys, "stderr", Terminal(True))
    x = dop.from_numpy(rng.standard_normal((1, K)).astype(np.float32), stream=stream)
    assert cache.warmup(x) == len(cache.sizes)
    assert bars == [["capturing graphs", len(cache.sizes), len(cache.sizes)]]
    cache.close()
