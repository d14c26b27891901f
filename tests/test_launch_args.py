"""How launch arguments are converted and packed, checked without a GPU.

A stand-in for the driver calls a Function makes (the parameter layout of
the CUBIN, and the launch: ``launch_kernel``, or cuLaunchKernelEx for launches
with an attribute) lets CI check the conversion rules: Tensors
become device pointers, numbers are range- and kind-checked, the packed bytes
match the kernel's C layout, and a bad argument stops the launch before the
driver sees it.
"""
import ctypes
import struct

import numpy as np
import pytest
from cuda.bindings import driver as real_cu

import deviceop as dop
from deviceop.runtime import launch as launch_mod


class FakeDriver:
    """Answers cuFuncGetParamInfo from a C layout (and the default shared memory), records cuLaunchKernel calls."""

    CUfunction_attribute = real_cu.CUfunction_attribute
    CUlaunchConfig, CUlaunchAttribute = real_cu.CUlaunchConfig, real_cu.CUlaunchAttribute
    CUlaunchAttributeID = real_cu.CUlaunchAttributeID

    def __init__(self, layout):
        self.layout, self.launches = layout, []

    def cuFuncGetParamInfo(self, handle, index):
        if index < len(self.layout):
            return (0, *self.layout[index])
        return (1, 0, 0)

    def cuFuncGetAttribute(self, attribute, handle):   # a kernel without static shared memory
        if attribute == self.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
            return (0, 48 * 1024)
        raise AssertionError(f"unexpected cuFuncGetAttribute({attribute})")

    def launch_kernel(self, address, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        """launch_kernel's signature (CuPy's launchKernel): every argument a C int."""
        if not all(type(v) is int for v in (address, gx, gy, gz, bx, by, bz, smem, stream, params, extra)):
            raise TypeError("an integer is required")  # what the typed wrapper raises
        n = len(self.layout)
        addrs = (ctypes.c_void_p * n).from_address(params)
        raw = [ctypes.string_at(addrs[i], self.layout[i][1]) for i in range(n)]
        self.launches.append(((gx, gy, gz), (bx, by, bz), smem, raw))

    def cuLaunchKernelEx(self, config, handle, params, extra):
        self.launch_kernel(int(handle), config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX,
                           config.blockDimY, config.blockDimZ, config.sharedMemBytes, int(config.hStream), params, extra)
        self.ex_configs = getattr(self, "ex_configs", []) + [config]
        return (0,)


class FakeStream:
    ptr = 0  # a stream's address (CudaStream.ptr)


def make_function(monkeypatch, signature, layout):
    fake = FakeDriver(layout)
    monkeypatch.setattr(launch_mod, "cu", fake)
    monkeypatch.setattr(launch_mod, "launch_kernel", fake.launch_kernel)
    return launch_mod.Function(module=None, handle=0, name="k", signature=signature), fake


SAXPY_LAYOUT = [(0, 8), (8, 8), (16, 4), (20, 4)]  # float*, const float*, float, int


def test_tensors_become_pointers_and_numbers_their_c_types(monkeypatch, rng):
    fn, fake = make_function(monkeypatch, [dop.ptr("float32"), dop.ptr, dop.float32, dop.int32], SAXPY_LAYOUT)
    y, x = dop.from_numpy(rng.standard_normal(4).astype(np.float32)), dop.empty(4)
    fn.launch(FakeStream(), dop.LaunchConfig((2, 3), 128), y, x, 1.5, 7)
    grid, block, smem, raw = fake.launches[-1]
    assert grid == (2, 3, 1) and block == (128, 1, 1) and smem == 0
    assert struct.unpack("<Q", raw[0])[0] == y.data_ptr and struct.unpack("<Q", raw[1])[0] == x.data_ptr
    assert struct.unpack("<f", raw[2])[0] == 1.5 and struct.unpack("<i", raw[3])[0] == 7


def test_slow_paths_accept_numpy_scalars_ints_for_floats_and_raw_addresses(monkeypatch):
    fn, fake = make_function(monkeypatch, [dop.ptr, dop.ptr, dop.float32, dop.int32], SAXPY_LAYOUT)
    fn.launch(FakeStream(), (1, 32), 0x1000, None, np.float32(2.0), np.int64(3))
    raw = fake.launches[-1][3]
    assert struct.unpack("<Q", raw[0])[0] == 0x1000 and struct.unpack("<Q", raw[1])[0] == 0
    assert struct.unpack("<f", raw[2])[0] == 2.0 and struct.unpack("<i", raw[3])[0] == 3
    fn.launch(FakeStream(), (1, 32), 0, 0, 2, 3)  # an int for a float parameter is exact
    assert struct.unpack("<f", fake.launches[-1][3][2])[0] == 2.0


def test_bad_arguments_never_reach_the_driver(monkeypatch):
    fn, fake = make_function(monkeypatch, [dop.ptr("float32"), dop.ptr, dop.float32, dop.int32], SAXPY_LAYOUT)
    y = dop.empty(4)
    cases = [
        ((y, y, 1.0), dop.LaunchError, "takes 4 arguments"),
        ((y, y, 1.0, 2.5), dop.DTypeError, "argument 3 of k.*never truncates"),
        ((y, y, 1.0, 2**40), dop.DTypeError, "does not fit in int32"),
        ((y, y, "a", 1), dop.DTypeError, "argument 2 of k"),
        ((y, y, 1.0, True), dop.DTypeError, "got a bool"),
        ((dop.empty(4, dop.int32), y, 1.0, 1), dop.DTypeError, "must be a float32 tensor, got int32"),
        ((y, "x", 1.0, 1), dop.LaunchError, "device pointer"),
    ]
    for args, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            fn.launch(FakeStream(), (1, 32), *args)
    with pytest.raises(dop.LaunchError, match="LaunchConfig"):
        fn.launch(FakeStream(), "grid", y, y, 1.0, 1)
    assert fake.launches == []


def test_a_failed_driver_call_is_a_cuda_error_naming_the_kernel(monkeypatch):
    """What the driver refuses comes back as a CudaError naming the launch and the
    CUDA error, without the driver wrapper's own exception chained to it."""
    fn, fake = make_function(monkeypatch, [dop.ptr, dop.ptr, dop.float32, dop.int32], SAXPY_LAYOUT)
    monkeypatch.setattr(launch_mod, "DriverError", launch_mod.DriverCallError)

    def refuse(*args):
        raise launch_mod.DriverCallError(1)  # CUDA_ERROR_INVALID_VALUE
    monkeypatch.setattr(launch_mod, "launch_kernel", refuse)
    fn = launch_mod.Function(module=None, handle=0, name="k", signature=fn.signature)  # launchers made now
    for launch in (lambda: fn.launch(FakeStream(), (1, 32), 0, 0, 1.0, 1),
                   lambda: fn.prepared(None, dop.LaunchConfig(1, 32), 0, 0, 1.0, 1)(FakeStream())):
        with pytest.raises(dop.CudaError, match=r"cuLaunchKernel\(k\) failed with CUDA_ERROR_INVALID_VALUE") as info:
            launch()
        assert info.value.__suppress_context__ and info.value.code == 1
    assert not fn._lock.locked()  # the parameter buffer's lock was released


def test_a_launch_needs_a_live_deviceop_stream(monkeypatch):
    """A closed stream (its ptr is None) and an object that is no stream are
    refused by name; neither reaches the driver."""
    fn, fake = make_function(monkeypatch, [dop.ptr, dop.ptr, dop.float32, dop.int32], SAXPY_LAYOUT)
    closed = FakeStream()
    closed.ptr = None
    go = fn.prepared(None, dop.LaunchConfig(1, 32), 0, 0, 1.0, 1)
    for stream, exc, pattern in ((closed, dop.StateError, "on a stream that was closed"),
                                 (object(), dop.LaunchError, "launches on a deviceop stream.*got object")):
        with pytest.raises(exc, match=pattern):
            fn.launch(stream, (1, 32), 0, 0, 1.0, 1)
        with pytest.raises(exc, match=pattern):
            go(stream)
        with pytest.raises(exc, match=pattern):
            fn.launch_pdl(stream, (1, 32), 0, 0, 1.0, 1)
    assert fake.launches == []


def test_signature_must_match_the_kernels_layout(monkeypatch):
    with pytest.raises(dop.LaunchError, match="takes 4 parameters but its declared signature has 3"):
        make_function(monkeypatch, [dop.ptr, dop.ptr, dop.float32], SAXPY_LAYOUT)
    with pytest.raises(dop.LaunchError, match="parameter 2 of kernel k is 4 bytes at offset 16"):
        make_function(monkeypatch, [dop.ptr, dop.ptr, dop.float64, dop.int32], SAXPY_LAYOUT)


def test_half_and_bfloat16_scalars(monkeypatch):
    fn, fake = make_function(monkeypatch, [dop.float16, dop.bfloat16], [(0, 2), (2, 2)])
    fn.launch(FakeStream(), (1, 1), 1.5, 1.0)
    raw = fake.launches[-1][3]
    assert np.frombuffer(raw[0], np.float16)[0] == 1.5
    assert raw[1] == (0x3F80).to_bytes(2, "little")


def test_pack_shows_the_bytes(monkeypatch):
    fn, _ = make_function(monkeypatch, [dop.ptr, dop.ptr, dop.float32, dop.int32], SAXPY_LAYOUT)
    assert fn.pack(16, 32, 1.0, 2) == struct.pack("@PPfi", 16, 32, 1.0, 2)


def test_pdl_launches_carry_the_programmatic_serialization_attribute(monkeypatch, rng):
    fn, fake = make_function(monkeypatch, [dop.ptr("float32"), dop.ptr, dop.float32, dop.int32], SAXPY_LAYOUT)
    y, x = dop.from_numpy(rng.standard_normal(4).astype(np.float32)), dop.empty(4)
    config, stream = dop.LaunchConfig(4, 256), FakeStream()
    fn.launch_pdl(stream, config, y, x, 2.5, 3)
    fn.launch_pdl(stream, config, y, x, 2.5, 3)
    grid, block, _, raw = fake.launches[-1]
    assert grid == (4, 1, 1) and block == (256, 1, 1) and struct.unpack("<f", raw[2])[0] == 2.5
    c = fake.ex_configs[-1]
    assert c is fake.ex_configs[0]               # one CUlaunchConfig per (config, stream), reused
    assert c.numAttrs == 1 and c.attrs[0].value.programmaticStreamSerializationAllowed == 1
    assert c.attrs[0].id == real_cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def test_cooperative_launches_carry_the_cooperative_attribute(monkeypatch, rng):
    """A grid whose CTAs wait for each other (a grid barrier) must be resident at
    once: launched cooperatively, the driver refuses a grid that cannot be."""
    fn, fake = make_function(monkeypatch, [dop.ptr("float32"), dop.ptr, dop.float32, dop.int32], SAXPY_LAYOUT)
    y, x = dop.from_numpy(rng.standard_normal(4).astype(np.float32)), dop.empty(4)
    fn.launch_cooperative(FakeStream(), dop.LaunchConfig(4, 256), y, x, 2.5, 3)
    c = fake.ex_configs[-1]
    assert c.numAttrs == 1 and c.attrs[0].value.cooperative == 1
    assert c.attrs[0].id == real_cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE


def test_a_launch_is_pdl_or_cooperative_not_both():
    from deviceop.kernels import add
    launch = add(dop.empty([1024]).partition([1024]), dop.empty([1024]), dop.empty([1024])).pdl()
    with pytest.raises(dop.LaunchError, match="either PDL or cooperative"):
        launch.cooperative()



def test_pdl_and_cooperative_take_a_bool():
    # .pdl("no") was bool("no"): PDL on, for a kernel that may not wait for the one before it
    from deviceop.kernels import add
    for what in ("pdl", "cooperative"):
        launch = add(dop.empty([1024]).partition([1024]), dop.empty([1024]), dop.empty([1024]))
        for wrong in ("no", None, 2, 0.0):
            with pytest.raises(dop.LaunchError, match=rf"\.{what}\(\) takes True or False, got {wrong!r}"):
                getattr(launch, what)(wrong)
        assert getattr(launch, what)(np.bool_(False)) is launch and getattr(launch, "_" + what) is False
        launch.discard()


def test_cluster_launches_carry_the_cluster_dimension(monkeypatch, rng):
    """A LaunchConfig with cluster=(x, y, z) launches the grid in thread-block
    clusters (cuLaunchKernelEx with CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)."""
    fn, fake = make_function(monkeypatch, [dop.ptr("float32"), dop.ptr, dop.float32, dop.int32], SAXPY_LAYOUT)
    y, x = dop.from_numpy(rng.standard_normal(4).astype(np.float32)), dop.empty(4)
    config = dop.LaunchConfig((2, 3, 4), 256, cluster=(1, 1, 4))
    fn.launch_cluster(FakeStream(), config, y, x, 2.5, 3)
    c = fake.ex_configs[-1]
    assert (c.gridDimX, c.gridDimY, c.gridDimZ) == (2, 3, 4)
    assert c.numAttrs == 1 and c.attrs[0].id == real_cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert (c.attrs[0].value.clusterDim.x, c.attrs[0].value.clusterDim.y, c.attrs[0].value.clusterDim.z) == (1, 1, 4)


def test_a_cluster_must_divide_the_grid_and_stay_portable():
    assert dop.LaunchConfig(8, 128, cluster=1).cluster is None          # a cluster of one CTA is no cluster
    assert dop.LaunchConfig((4, 2, 6), 128, cluster=(1, 1, 6)).cluster == (1, 1, 6)
    with pytest.raises(dop.LaunchError, match="does not divide grid"):
        dop.LaunchConfig((4, 2, 6), 128, cluster=(1, 1, 4))
    with pytest.raises(dop.LaunchError, match="at most 8 are portable"):
        dop.LaunchConfig(16, 128, cluster=16)
    with pytest.raises(dop.LaunchError, match="1 to 3 positive ints"):
        dop.LaunchConfig(16, 128, cluster=0)


def test_a_kernel_declares_its_cluster_from_generics_and_grid():
    """Kernel(cluster=f): f(generics, grid) gives the cluster of each launch config."""
    from deviceop.kernel import Kernel, Out, In, _launcher
    k = Kernel("k", "__global__ void k(float* y, const float* x) {}",
               [Out("y", "float32", rank=3), In("x", "float32", rank=1)], cluster=lambda g, grid: (1, 1, grid[2]))
    cfg = k.config((4, 2, 3))
    assert cfg.cluster == (1, 1, 3) and k.config((4, 2, 1)).cluster is None

    class Fn:
        name, launch, launch_pdl, launch_cooperative, launch_cluster = "k", "plain", "pdl", "coop", "cluster"
    assert _launcher(Fn, False, False, cfg) == ("cluster", cfg)
    assert _launcher(Fn, False, False, k.config((4, 2, 1)))[0] == "plain"
    with pytest.raises(dop.LaunchError, match="cannot also be PDL"):
        _launcher(Fn, True, False, cfg)


def test_cluster_occupancy_needs_a_cluster(monkeypatch):
    """max_active_clusters asks the driver about clusters; a config without one is refused first."""
    fn, _ = make_function(monkeypatch, [dop.ptr("float32"), dop.ptr, dop.float32, dop.int32], SAXPY_LAYOUT)
    with pytest.raises(dop.LaunchError, match="needs a LaunchConfig with cluster"):
        fn.max_active_clusters(dop.LaunchConfig(8, 128))
