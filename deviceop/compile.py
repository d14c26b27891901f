"""CUDA C++ → CUBIN with NVRTC, cached in memory and on disk.

Always CUBIN for the exact architecture, never PTX: PTX from a newer NVRTC is
refused by an older driver (CUDA_ERROR_UNSUPPORTED_PTX_VERSION), while its
CUBIN loads.  Compiling needs no GPU, so CI compiles every kernel for sm_90.

Cache key: SHA-256 of the source, the file name, the options, the name
expressions, the NVRTC version, the arch, the contents of every header in
the user's include directories and of every file the source ``#include``s
(or an ``-include`` option pre-includes), wherever NVRTC finds it (beside the
including file, in the working directory, in an ``-I`` option's directory;
``.inc`` or no suffix; toolkit headers are identified by their path and the
NVRTC version).  Disk entries carry a checksum of their metadata
and CUBIN; a corrupt, edited or truncated entry is recompiled and rewritten,
never loaded.  Writes go to a temporary file that is renamed into place, so
concurrent processes never see half an entry.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import struct
import tempfile
import threading
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

from cuda.bindings import nvrtc

from .compile_inputs import dir_digest, includes_digest
from .errors import ArchError, CompileError, ConfigError

DEFAULT_OPTIONS = ("-std=c++17", "-lineinfo")
# Format 2: the checksum covers the metadata as well as the CUBIN (format 1's
# covered only the CUBIN, so an edited lowered name loaded as a hit).
_MAGIC = b"DEVICEOP-CUBIN-2\n"
_MAGIC_FAMILY = b"DEVICEOP-CUBIN-"


@dataclass(frozen=True)
class CompiledProgram:
    """The result of one compile: a CUBIN and the mangled name of each name expression."""

    cubin: bytes
    arch: str
    lowered_names: dict = field(default_factory=dict)  # name expression -> mangled symbol
    log: str = ""
    key: str = ""
    origin: str = "compiled"  # "compiled" | "disk" | "memory"

    def symbol(self, name: str) -> str:
        """The symbol to look up in the module for ``name`` (an entry name or name expression)."""
        return self.lowered_names.get(name, name)

    def param_layout(self, name: str) -> list[tuple[int, int]] | None:
        """``(offset, size)`` in bytes of each parameter of the kernel ``name`` (an entry
        name or name expression), read from the CUBIN without a driver: the facts
        ``cuFuncGetParamInfo`` reports once it is loaded.  None if the CUBIN has no
        kernel of that name (``cuModuleGetFunction`` would fail)."""
        return cubin_param_layout(self.cubin, self.symbol(name))


# -- what a CUBIN says about its kernels, read without a driver ------------------
#
# A CUBIN is a 64-bit little-endian ELF file.  Each kernel ``sym`` has a code
# section ``.text.<sym>`` and an attribute section ``.nv.info.<sym>``: a run of
# records, each a format byte, an attribute byte and then
#   * format EIFMT_SVAL (4): a 2-byte payload size and that many bytes;
#   * the others (EIFMT_NVAL 1, EIFMT_BVAL 2, EIFMT_HVAL 3): a 2-byte value.
# An EIATTR_KPARAM_INFO record (attribute 0x17, EIFMT_SVAL, 12 bytes) describes
# one parameter: a 4-byte index (0), a 2-byte ordinal, a 2-byte byte offset in
# the parameter buffer, and 4 bytes whose top 14 bits are its size in bytes
# (the low 18 hold its alignment, address space and constant bank).  This is
# the layout nvdisasm prints and CUDA's loader reads; it is not a documented
# API: a section that does not parse as such raises ValueError, which callers
# take as "cannot tell" (the GPU checks the loaded kernel), never as a refusal.

_EIFMT_SVAL = 4
_EIATTR_KPARAM_INFO = 0x17


def _elf_sections(image: bytes) -> dict[str, bytes]:
    """Section name -> contents of a 64-bit little-endian ELF file."""
    if image[:4] != b"\x7fELF" or image[4:6] != b"\x02\x01":
        raise ValueError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", image, 0x28)              # e_shoff: the section header table
    entsize, count, names = struct.unpack_from("<HHH", image, 0x3A)  # e_shentsize, e_shnum, e_shstrndx
    # each header: sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size (the fields read here)
    headers = [struct.unpack_from("<IIQQQQ", image, shoff + i * entsize) for i in range(count)]
    strings = headers[names][4]
    sections = {}
    for name, _type, _flags, _addr, offset, size in headers:
        start = strings + name
        sections[image[start:image.index(b"\0", start)].decode()] = image[offset:offset + size]
    return sections


def cubin_param_layout(cubin: bytes, symbol: str) -> list[tuple[int, int]] | None:
    """``(offset, size)`` of each parameter of the kernel ``symbol`` in ``cubin``, by
    ordinal; None if there is no such kernel.  Raises ValueError if the CUBIN or
    its records do not have the layout described above."""
    try:
        sections = _elf_sections(cubin)
    except (struct.error, IndexError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the CUBIN's ELF sections ({exc})") from None
    if ".text." + symbol not in sections:
        return None
    info = sections.get(".nv.info." + symbol, b"")
    params, at = {}, 0
    while at + 4 <= len(info):
        fmt, attribute, value = info[at], info[at + 1], int.from_bytes(info[at + 2:at + 4], "little")
        if fmt != _EIFMT_SVAL:
            at += 4
            continue
        payload = info[at + 4:at + 4 + value]
        at += 4 + value
        if attribute == _EIATTR_KPARAM_INFO:
            if len(payload) != 12:
                raise ValueError(f"an EIATTR_KPARAM_INFO record of {len(payload)} bytes (expected 12)")
            _index, ordinal, offset, word = struct.unpack("<IHHI", payload)
            params[ordinal] = (offset, word >> 18)
    if at != len(info) or sorted(params) != list(range(len(params))):
        raise ValueError(f"the .nv.info section of {symbol} does not parse as attribute records")
    return [params[i] for i in range(len(params))]


# -- NVRTC facts ---------------------------------------------------------------

def _nvrtc_check(result, call: str):
    code = result[0]
    if code != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        err, text = nvrtc.nvrtcGetErrorString(code)
        raise CompileError(f"{call} failed: {text.decode() if isinstance(text, bytes) else text}")
    return result[1] if len(result) == 2 else result[1:]


def nvrtc_version() -> str:
    try:
        major, minor = _nvrtc_check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    except CompileError:
        raise
    except Exception as exc:  # the library is missing
        raise CompileError(f"NVRTC is not available ({exc}); install the CUDA NVRTC wheel: "
                           "pip install 'cuda-toolkit[nvrtc]>=13,<14'") from exc
    return f"{major}.{minor}"


def supported_archs() -> list[int]:
    return list(_nvrtc_check(nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs"))


def normalize_arch(arch) -> str:
    """``"sm_90"``, ``"90"``, ``90``, ``(9, 0)`` or ``"sm_90a"`` → ``"sm_90"``/``"sm_90a"``,
    checked against what this NVRTC can target."""
    if isinstance(arch, tuple):
        if len(arch) != 2:  # (10,) was an IndexError, (9, 0, 1) read as sm_90
            raise ArchError(f"cannot read {arch!r} as a GPU architecture: a tuple is (major, minor), a compute "
                            "capability like (9, 0); or write it like 'sm_90'")
        arch = f"{arch[0]}{arch[1]}"
    text = str(arch).lower().removeprefix("sm_").removeprefix("compute_")
    m = re.fullmatch(r"(\d+)([af]?)", text)
    if not m:
        raise ArchError(f"cannot read {arch!r} as a GPU architecture; write it like 'sm_90'")
    number = int(m.group(1))
    known = supported_archs()
    if number not in known:
        raise ArchError(f"NVRTC {nvrtc_version()} cannot compile for sm_{number}; it supports "
                        + ", ".join(f"sm_{a}" for a in known))
    return f"sm_{number}{m.group(2)}"


def toolkit_include_dirs() -> list[str]:
    """CUDA runtime and CCCL header directories: from the NVIDIA wheels
    (found by cuda-pathfinder), else ``CUDA_HOME``/``CUDA_PATH``."""
    dirs: list[str] = []
    try:
        import cuda.pathfinder as pf
        for lib in ("cudart", "cccl"):
            try:
                d = pf.find_nvidia_header_directory(lib)
            except Exception:
                d = None
            if d and d not in dirs:
                dirs.append(d)
    except ImportError:
        pass
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        for d in (os.path.join(home, "include"), os.path.join(home, "include", "cccl")):
            if os.path.isdir(d) and d not in dirs:
                dirs.append(d)
    return dirs


# -- the cache -----------------------------------------------------------------

def cache_dir() -> Path:
    """``$DEVICEOP_CACHE_DIR``, else ``$XDG_CACHE_HOME/deviceop``, else ``~/.cache/deviceop``."""
    env = os.environ.get("DEVICEOP_CACHE_DIR")
    if env:  # "~/cache", quoted where no shell expands it, made a folder named ~ in the working directory
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "deviceop"


_OFF, _ON = ("0", "false", "no", "off"), ("1", "true", "yes", "on")


def disk_cache_enabled() -> bool:
    """``DEVICEOP_DISK_CACHE``: 0/false/no/off or 1/true/yes/on, any case; unset or empty is on.
    Anything else is refused, not read as on: a typo must not leave the cache on unnoticed."""
    value = os.environ.get("DEVICEOP_DISK_CACHE", "")
    word = value.strip().lower()
    if word in _OFF:
        return False
    if word in _ON or not word:
        return True
    raise ConfigError(f"DEVICEOP_DISK_CACHE={value!r} is not understood: set it to {', '.join(_OFF[:-1])} or "
                      f"{_OFF[-1]} to compile without the disk cache, or {', '.join(_ON[:-1])} or {_ON[-1]} "
                      "(or unset it) to use it")


def _cache_problem(what: str, path: Path, exc: OSError, then: str) -> None:
    """Warn about a disk-cache entry or directory deviceop cannot use; compiling goes on without it."""
    reason = exc.strerror or str(exc)
    if path.parent.exists() and not path.parent.is_dir():
        reason = f"{path.parent} is a file, not a directory"
    warnings.warn(f"deviceop: {what} {path} ({reason}); {then}. The compile cache lives in {cache_dir()} "
                  "(DEVICEOP_CACHE_DIR, else $XDG_CACHE_HOME/deviceop): make it a directory you can read and "
                  "write (remove what is in the way), point DEVICEOP_CACHE_DIR elsewhere, or turn the disk cache "
                  "off with DEVICEOP_DISK_CACHE=0", stacklevel=4)


def cache_stats() -> dict:
    """Entries and bytes in the on-disk cache (what cannot be read is not counted)."""
    d = cache_dir()
    entries = size = 0
    try:
        files = list(d.glob("*.cubin")) if d.is_dir() else []
    except OSError:
        files = []
    for f in files:
        try:
            st = f.stat()
        except OSError:  # removed meanwhile, or unreadable
            continue
        if stat.S_ISREG(st.st_mode):
            entries, size = entries + 1, size + st.st_size
    return {"dir": str(d), "entries": entries, "bytes": size}


def clear_cache(memory: bool = True, disk: bool = True) -> None:
    """Forget compiled programs: in this process and/or on disk (what cannot be removed is warned about)."""
    if memory:
        with _memory_lock:
            _memory.clear()
    if disk and cache_dir().is_dir():
        for f in cache_dir().glob("*.cubin"):
            try:
                f.unlink(missing_ok=True)
            except OSError as exc:
                _cache_problem("could not remove compile-cache entry", f, exc, "it was left in place")


_memory: dict[str, CompiledProgram] = {}
_memory_lock = threading.Lock()
def _cache_key(source: str, filename: str, options: list[str], names: tuple, arch: str,
               user_dirs: list[str], toolkit_dirs: list[str]) -> str:
    h = hashlib.sha256()
    for part in (source, filename, "\x1f".join(options), "\x1f".join(names), arch,
                 nvrtc_version(), "\x1f".join(toolkit_dirs)):
        h.update(part.encode() + b"\0")
    for d in user_dirs:
        h.update(dir_digest(d).encode())
    h.update(includes_digest(source, filename, user_dirs, toolkit_dirs, options).encode())
    return h.hexdigest()


def _entry_digest(meta: bytes, cubin: bytes) -> bytes:
    """SHA-256 over the metadata (length-prefixed, so no byte can move between the
    two) and the CUBIN: an edit to either is caught."""
    return hashlib.sha256(struct.pack("<Q", len(meta)) + meta + cubin).digest()


def _read_entry(path: Path, key: str) -> CompiledProgram | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:  # a directory where the entry or the cache dir should be, no permission ...
        _cache_problem("cannot read compile-cache entry", path, exc, "compiling without it")
        return None
    if data.startswith(_MAGIC_FAMILY) and not data.startswith(_MAGIC):
        return None  # another format version's entry: a miss, rewritten in this one (not corruption)
    try:
        if not data.startswith(_MAGIC):
            raise ValueError("bad magic")
        off = len(_MAGIC)
        (meta_len,) = struct.unpack_from("<Q", data, off)
        off += 8
        meta_bytes = data[off:off + meta_len]
        off += meta_len
        digest, payload = data[off:off + 32], data[off + 32:]
        if _entry_digest(meta_bytes, payload) != digest:
            raise ValueError("checksum mismatch")
        meta = json.loads(meta_bytes)
        if meta.get("key") != key:
            raise ValueError("the entry's key is not its file name's")
        return CompiledProgram(payload, meta["arch"], meta["lowered_names"], meta.get("log", ""), key, "disk")
    except Exception as exc:
        warnings.warn(f"deviceop: corrupt compile-cache entry {path} ({exc}); recompiling", stacklevel=3)
        return None


def _write_entry(path: Path, prog: CompiledProgram) -> None:
    meta = json.dumps({"key": prog.key, "arch": prog.arch, "lowered_names": prog.lowered_names,
                       "log": prog.log, "nvrtc": nvrtc_version()}).encode()
    blob = _MAGIC + struct.pack("<Q", len(meta)) + meta + _entry_digest(meta, prog.cubin) + prog.cubin
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".cubin.part")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)  # atomic: readers see the old entry or the whole new one
    except OSError as exc:  # a read-only or full cache dir, or a directory in the way, must not break compiling
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        _cache_problem("could not write compile-cache entry", path, exc,
                       "the kernel is compiled but not cached on disk")


# -- compiling -----------------------------------------------------------------

def compile_cubin(source: str, *, arch=None, name_expressions=(), options=(), include_dirs=(),
                  filename: str = "kernel.cu", cache: bool = True) -> CompiledProgram:
    """Compile CUDA C++ ``source`` to a CUBIN for ``arch`` (default: ``runtime.device.default_arch()``, the arch of
    the GPU this process opened, else GPU 0's).

    ``name_expressions`` are template instantiations such as ``"add<128>"``;
    the result maps each one to its mangled symbol.  Raises CompileError with
    NVRTC's log and the failing source lines.
    """
    if arch is None:
        from .runtime.device import default_arch
        arch = default_arch()
    arch = normalize_arch(arch)
    names = tuple(name_expressions)
    user_dirs = [str(Path(d).resolve()) for d in include_dirs]
    tk_dirs = toolkit_include_dirs()
    opts = [o for o in options]
    for default in DEFAULT_OPTIONS:
        flag = default.split("=")[0]
        if not any(o.split("=")[0] == flag for o in opts):
            opts.append(default)
    if any(o.startswith(("-arch", "--gpu-architecture")) for o in opts):
        raise CompileError("pass the architecture as arch=..., not as an -arch option")
    full_opts = [f"-arch={arch}", *opts] + [f"-I{d}" for d in user_dirs + tk_dirs]
    key = _cache_key(source, filename, opts, names, arch, user_dirs, tk_dirs)
    disk = cache and disk_cache_enabled()  # refused whether or not this compile reaches the disk

    if cache:
        hit = _memory.get(key)
        if hit is not None:
            return replace(hit, origin="memory")
        if disk:
            prog = _read_entry(cache_dir() / f"{key}.cubin", key)
            if prog is not None:
                with _memory_lock:
                    _memory[key] = prog
                return prog

    prog = _nvrtc_compile(source, filename, full_opts, names, arch, key)
    if cache:
        with _memory_lock:
            _memory[key] = prog
        if disk:
            _write_entry(cache_dir() / f"{key}.cubin", prog)
    return prog


def _nvrtc_compile(source, filename, opts, names, arch, key) -> CompiledProgram:
    nvrtc_version()  # a clear error if the library is missing
    handle = _nvrtc_check(nvrtc.nvrtcCreateProgram(source.encode(), filename.encode(), 0, [], []),
                          "nvrtcCreateProgram")
    try:
        for name in names:
            _nvrtc_check(nvrtc.nvrtcAddNameExpression(handle, name.encode()), "nvrtcAddNameExpression")
        encoded = [o.encode() for o in opts]
        code = nvrtc.nvrtcCompileProgram(handle, len(encoded), encoded)[0]
        log_size = _nvrtc_check(nvrtc.nvrtcGetProgramLogSize(handle), "nvrtcGetProgramLogSize")
        # Output buffers are bytearrays: NVRTC writes into them, and writing into
        # a bytes object corrupts it -- for size 1 (an empty log) that is
        # CPython's shared b" " singleton, which then breaks every later ' '.
        log_buf = bytearray(log_size)
        _nvrtc_check(nvrtc.nvrtcGetProgramLog(handle, log_buf), "nvrtcGetProgramLog")
        log = bytes(log_buf).rstrip(b"\0 ").decode(errors="replace")
        if code != nvrtc.nvrtcResult.NVRTC_SUCCESS and "--nv_arch" in log and arch[-1] in "af":
            # normalize_arch knows the numbers NVRTC targets, not which have an 'a'/'f' variant
            raise ArchError(f"NVRTC {nvrtc_version()} cannot compile for {arch}: sm_{arch[3:-1]} has no "
                            f"'{arch[-1]}' variant (the arch-specific 'a' ones begin at sm_90a, the family 'f' "
                            f"ones at sm_100f); compile for {arch[:-1]}, or a variant `nvcc --list-gpu-arch` "
                            "lists")
        if code != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(_describe_failure(source, filename, arch, log, names), log)
        size = _nvrtc_check(nvrtc.nvrtcGetCUBINSize(handle), "nvrtcGetCUBINSize")
        cubin_buf = bytearray(size)
        _nvrtc_check(nvrtc.nvrtcGetCUBIN(handle, cubin_buf), "nvrtcGetCUBIN")
        cubin = bytes(cubin_buf)
        lowered = {}
        for name in names:
            sym = _nvrtc_check(nvrtc.nvrtcGetLoweredName(handle, name.encode()), "nvrtcGetLoweredName")
            lowered[name] = sym.decode() if isinstance(sym, bytes) else sym
        return CompiledProgram(cubin, arch, lowered, log, key, "compiled")
    finally:
        nvrtc.nvrtcDestroyProgram(handle)


_LOG_LINE = re.compile(r"^(?P<file>.+?)\((?P<line>\d+)\): (?P<kind>error|catastrophic error|warning)")


def _describe_failure(source: str, filename: str, arch: str, log: str, names) -> str:
    """NVRTC's log, with each failing line of ``source`` shown in context."""
    lines = source.splitlines()
    parts = [f"NVRTC could not compile {filename} for {arch}"
             + (f" (name expressions: {', '.join(names)})" if names else "") + ":", log.strip()]
    shown = set()
    for entry in log.splitlines():
        m = _LOG_LINE.match(entry)
        if not m or "error" not in m.group("kind") or Path(m.group("file")).name != Path(filename).name:
            continue
        n = int(m.group("line"))
        if n in shown or not 1 <= n <= len(lines):
            continue
        shown.add(n)
        parts.append(f"--- {filename}, line {n}:")
        for i in range(max(1, n - 2), min(len(lines), n + 2) + 1):
            parts.append(f"{'>>' if i == n else '  '} {i:4d} | {lines[i - 1]}")
    return "\n".join(parts)
