"""Kernels compiled by other compilers, declared as deviceop Kernels.

``Kernel.from_binary`` takes what nvcc writes (a CUBIN, a fatbin, PTX: a path
or bytes), ``Kernel.from_triton`` what Triton compiles (a ``CompiledKernel``, or
the ``.json`` beside its ``.cubin`` in Triton's cache).  Either gets the
parameter list its author wrote (``Out``/``InOut``/``In``/``Scalar``, with
shapes), then composes, is checked and captured like an NVRTC kernel; only
its code comes from elsewhere.  The declaration is checked against the binary
where the binary says so (binary.py): the parameter count and sizes of the
entry in every piece of code that can be read, here and on the reference
device alike, and again by the driver when a GPU loads it.  The arch is
checked when it is loaded (binary.Binary.select), naming the fix.

A binary has no NumPy reference of its own: on the reference device such a
kernel runs its ``reference=``, and without one it is refused when it is
loaded (``NoDeviceError`` naming ``reference=``: runtime/reference.py).
"""
from __future__ import annotations

import json
from pathlib import Path

from ..errors import ArchError, CudaError, LaunchError
from ..runtime.params import check_param_layout, null_ptr
from .binary import Binary

# Load errors of an image the driver cannot run on its GPU (the message names the fix)
_ARCH_ERRORS = ("CUDA_ERROR_NO_BINARY_FOR_GPU", "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "CUDA_ERROR_INVALID_PTX",
                "CUDA_ERROR_INVALID_IMAGE", "CUDA_ERROR_JIT_COMPILER_NOT_FOUND", "CUDA_ERROR_INVALID_SOURCE")


def binary_kernel(cls, name: str, binary, params, *, entry=None, hint: str = "", hidden: int = 0, **kw):
    """A ``cls`` (Kernel) running ``entry`` (default ``name``) of ``binary``, its declaration
    (``params``, the geometry and rules of ``kw``) checked against the binary's layouts."""
    image = binary if isinstance(binary, Binary) else Binary(binary, f"kernel {name}")
    symbol = image.resolve(entry or name)
    kernel = cls(name, None, params, entry=entry or name, **kw)   # errors name entry, not its mangled symbol
    kernel.signature += [null_ptr()] * hidden
    kernel.binary, kernel.binary_symbol = image, symbol
    shown = kernel.entry if symbol == kernel.entry else f"{kernel.entry} ({symbol})"
    for code, layout in image.layouts(symbol):
        try:
            check_param_layout(kernel.entry, kernel.signature, layout)
        except LaunchError as exc:
            raise LaunchError(f"kernel {name} is declared with parameters the binary's {shown} does not take "
                              f"({code.describe()} in {image.origin}): {exc}. Declare the parameters in the order "
                              f"and of the types the kernel takes them{hint}") from None
    return kernel


def program(kernel, arch: str, driver: str | None):
    """``(program, entry)``: ``kernel``'s binary for a GPU of ``arch`` with a CUDA ``driver``
    (None: unknown), its entry mapped to the symbol, as NVRTC maps a name expression."""
    prog = kernel.binary.program(arch, driver, kernel.name, {kernel.entry: kernel.binary_symbol})
    return prog, kernel.entry


def program_for(kernel, device):
    """``program(kernel, ...)`` for ``device`` (Kernel._program)."""
    driver = device.driver_version
    if driver is None:  # the reference device stands for a GPU whose driver is this NVRTC's CUDA version
        from ..compile import nvrtc_version
        driver = nvrtc_version()
    return program(kernel, device.arch, driver)


def load_error(kernel, exc: CudaError) -> Exception:
    """The error of a driver that refused to load ``kernel``'s binary."""
    if exc.code_name not in _ARCH_ERRORS:
        return exc
    return ArchError(f"kernel {kernel.name}: the driver cannot run {kernel.binary.describe()} on this GPU ({exc}); "
                     "build a CUBIN for the GPU's exact arch with the toolkit of its driver's CUDA version or older "
                     "(nvcc -cubin -arch=sm_XY)")


# -- Triton ---------------------------------------------------------------------------

_TRITON_HINT = (": Triton's compiled signature drops its constexpr parameters and any int it specialized to the "
                "constant 1, and adds its scratch pointers at the end (deviceop adds those)")


# the metadata fields read as ints, and their values when absent
_TRITON_INTS = {"num_ctas": 1, "num_warps": 4, "warp_size": 32, "shared": 0, "global_scratch_size": 0,
                "profile_scratch_size": 0}


def triton_kernel(cls, compiled, params, *, name=None, grid=None, **kw):
    """A ``cls`` (Kernel) of a Triton-compiled kernel (see ``Kernel.from_triton``)."""
    md, cubin, origin = _triton_parts(compiled)
    if not isinstance(md, dict):
        raise LaunchError(f"Kernel.from_triton: the metadata of the Triton kernel {origin} is a {type(md).__name__}, not the dict Triton "
                          "writes (its cache entry's .json holds one object): pass the .json of an entry of Triton's "
                          "cache, or the CompiledKernel itself")
    label = f"Triton kernel {name or md.get('name')}"
    target = md.get("target") or {}
    backend = target.get("backend") if isinstance(target, dict) else getattr(target, "backend", None)
    if md.get("backend_name", backend) not in (None, "cuda"):
        raise LaunchError(f"{label}: {origin} is not a Triton kernel compiled for CUDA (backend "
                          f"{md.get('backend_name', backend)!r}); compile it for an NVIDIA GPU")
    if not isinstance(md.get("name"), str) or not md["name"]:  # (it said "backend 'cuda'": not what was wrong)
        raise LaunchError(f"{label}: {origin}'s metadata has name={md.get('name')!r}, where Triton writes the "
                          "kernel's name (a str): the metadata is not what Triton wrote; pass the CompiledKernel, or "
                          "its cache entry's .json unchanged")
    for field, default in _TRITON_INTS.items():  # what the checks and the geometry below read, as Triton writes it
        v = md.get(field, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise LaunchError(f"{label}: {origin}'s metadata has {field}={v!r}, where Triton writes an int >= 0: "
                              "the metadata is not what Triton wrote; pass the CompiledKernel, or its cache entry's "
                              ".json unchanged")
    refuse = {"num_ctas": md.get("num_ctas", 1) != 1,
              "global_scratch_size": md.get("global_scratch_size", 0) > 0,
              "profile_scratch_size": md.get("profile_scratch_size", 0) > 0,
              "launch_cooperative_grid": bool(md.get("launch_cooperative_grid")),
              "tensordesc_meta": bool(md.get("tensordesc_meta"))}
    needs = [k for k, bad in refuse.items() if bad]
    if needs:
        raise LaunchError(f"{label} needs what Triton's own launcher sets up at each launch "
                          f"({', '.join(f'{k}={md[k]!r}' for k in needs)}: thread-block clusters, scratch memory, a "
                          "cooperative grid or host-side tensor descriptors); deviceop launches a Triton kernel without "
                          "them. Compile it without (num_ctas=1, no on-device descriptors or scratch), or launch it "
                          "through Triton inside dop.foreign(...)")
    # the scratch pointers recent Triton adds after the arguments: NULL when no scratch is needed
    hidden = ("global_scratch_size" in md) + ("profile_scratch_size" in md)
    image = Binary(cubin, label)
    image.origin = origin
    block = int(md.get("num_warps", 4)) * int(md.get("warp_size", 32))
    return binary_kernel(cls, name or md["name"], image, params, entry=md["name"], hint=_TRITON_HINT,
                         hidden=hidden, grid=grid, block=block, shared_mem=int(md.get("shared", 0)), **kw)


def _triton_parts(compiled) -> tuple[dict, bytes, str]:
    """``(metadata, cubin, where from)`` of a CompiledKernel or a Triton cache entry's .json."""
    if isinstance(compiled, (str, Path)):
        path = Path(compiled)
        cubin_path = path.with_suffix(".cubin")
        try:
            md, cubin = json.loads(path.read_text()), cubin_path.read_bytes()
        except (OSError, ValueError) as exc:
            raise LaunchError(f"cannot read the Triton kernel {path} and the {cubin_path.name} beside it ({exc}); pass "
                              "the .json metadata file of an entry of Triton's cache (its .cubin next to it), or the "
                              "CompiledKernel itself") from None
        return md, cubin, str(cubin_path)
    md, asm = getattr(compiled, "metadata", None), getattr(compiled, "asm", None)
    if md is None or not isinstance(asm, dict) or "cubin" not in asm:
        raise LaunchError(f"Kernel.from_triton takes a Triton CompiledKernel (what triton.compile(...), "
                          f"kernel.warmup(...) or a launch kernel[grid](...) returns) or the .json of an entry of "
                          f"Triton's cache; got {type(compiled).__name__}. A @triton.jit function is not compiled yet: "
                          "compile it first")
    if hasattr(md, "_asdict"):
        md = md._asdict()
    elif not isinstance(md, dict) and hasattr(md, "__dict__"):
        md = dict(vars(md))  # (else a list or an int: triton_kernel refuses what is not a dict, naming it)
    return md, asm["cubin"], f"the CompiledKernel {md.get('name') if isinstance(md, dict) else type(compiled).__name__}"
