"""Kernels another compiler built: a CUBIN, a fatbin or PTX, read without a driver.

What an image says, and what deviceop checks with it before a GPU loads it:

* a CUBIN (an ELF file, ``nvcc -cubin``, Triton's ``asm["cubin"]``): SASS for one
  architecture, which its ELF flags name; its kernels' parameter layouts
  (compile.py reads them);
* a fatbin (``nvcc -fatbin``, what ``nvcc -gencode ...`` embeds): a list of
  entries, each SASS for an ``sm_XY`` or PTX for a ``compute_XY`` (with its PTX
  ISA version), possibly compressed — a compressed entry's arch is known, its
  contents are not;
* PTX text (``nvcc -ptx``, ``nvrtcGetPTX``): its ``.version`` (the PTX ISA), its
  ``.target`` and each ``.entry``'s parameters.

Which code runs on a device is what the driver would pick: SASS of the same
major architecture and no newer minor one (sm_90 SASS on an sm_90 GPU; sm_80
SASS does not run there), else PTX for that arch or an older one, which the
driver JIT-compiles — only if the driver knows the PTX's ISA version (PTX from
a newer toolkit is refused: CUDA_ERROR_UNSUPPORTED_PTX_VERSION).  Prefer SASS
for the exact arch: it loads at once, on any driver of its CUDA major version.

The fatbin layout read here is the one ``cuobjdump`` shows, not a documented
API: what does not parse as it is reported as unknown ("cannot tell") and the
driver decides at load, never refused on a guess.
"""
from __future__ import annotations

import functools
import hashlib
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from ..compile import _elf_sections, cubin_param_layout
from ..errors import ArchError, LaunchError

_FATBIN_MAGIC = 0xBA55ED50
_FATBIN_COMPRESSED = 0x2000 | 0x8000   # entry flags of LZ4 and zstd compression
_FATBIN_ARCH_SPECIFIC = 0x100000       # an sm_90a-style entry: runs on exactly its arch
_SIZES = {"b8": 1, "u8": 1, "s8": 1, "b16": 2, "u16": 2, "s16": 2, "f16": 2, "bf16": 2,
          "b32": 4, "u32": 4, "s32": 4, "f32": 4, "b64": 8, "u64": 8, "s64": 8, "f64": 8}
_ENTRY = re.compile(r"\.entry\s+([\w$]+)\s*\(([^)]*)\)", re.S)


@dataclass(frozen=True)
class Code:
    """One piece of code in an image: SASS or PTX for one architecture."""

    kind: str                 # "sass" | "ptx"
    arch: int                 # 90 for sm_90 / compute_90
    specific: bool = False    # sm_90a: runs only on that arch
    ptx_version: str | None = None   # the PTX ISA, "9.0"
    data: bytes | None = field(default=None, repr=False)  # the ELF or PTX text; None if compressed

    def describe(self) -> str:
        arch = f"{'sm' if self.kind == 'sass' else 'compute'}_{self.arch}{'a' if self.specific else ''}"
        what = f"SASS for {arch}" if self.kind == "sass" else f"PTX for {arch} (ISA {self.ptx_version})"
        return what + (" (compressed)" if self.data is None else "")

    def kernels(self) -> set[str]:
        if self.kind == "sass":
            return {n[6:] for n in _elf_sections(self.data) if n.startswith(".text.")}
        return {m.group(1) for m in _ENTRY.finditer(self.data.decode(errors="replace"))}

    def param_layout(self, symbol: str):
        """``(offset, size)`` of each parameter of ``symbol`` (None: no such kernel);
        ValueError where this code cannot be read."""
        if self.data is None:
            raise ValueError("compressed")
        if self.kind == "sass":
            return cubin_param_layout(self.data, symbol)
        return ptx_param_layout(self.data.decode(errors="replace"), symbol)

    def runs_on(self, device_arch: int) -> bool:
        """Would the driver run this code on a GPU of ``device_arch`` (PTX version aside)?"""
        if self.specific:
            return self.arch == device_arch
        if self.kind == "sass":
            return self.arch // 10 == device_arch // 10 and self.arch % 10 <= device_arch % 10
        return self.arch <= device_arch


def ptx_param_layout(text: str, symbol: str):
    """The ``(offset, size)`` of each parameter of the ``.entry symbol`` in PTX ``text``:
    a scalar is aligned to its size, a ``.b8 name[N]`` array (a struct) to its ``.align``."""
    for m in _ENTRY.finditer(text):
        if m.group(1) != symbol:
            continue
        layout, at = [], 0
        for decl in filter(None, (d.strip() for d in m.group(2).split(","))):
            # ".param [.align A] .TYPE [.ptr [.space] [.align P]] NAME[[N]]": A aligns the parameter,
            # P (after the type) is the alignment of what a pointer points at
            words = decl.split()
            types = [i for i, w in enumerate(words) if w[1:] in _SIZES]
            count = re.fullmatch(r"[\w$]+(?:\[(\d+)\])?", words[-1]) if words else None
            if words[:1] != [".param"] or not types or count is None:
                raise ValueError(f"cannot read the PTX parameter {decl!r}")
            kind = words[types[0]][1:]
            size = _SIZES[kind] * int(count.group(1) or 1)
            head = words[1:types[0]]
            align = int(head[head.index(".align") + 1]) if ".align" in head else _SIZES[kind]
            at = -(-at // align) * align
            layout.append((at, size))
            at += size
        return layout
    return None


def _cubin_code(elf: bytes, specific: bool = False) -> Code:
    """The Code of a CUBIN: its arch from the ELF flags (bits 8-15 from ELF ABI version 8,
    CUDA 13's; the low byte before)."""
    if len(elf) < 0x34 or elf[:4] != b"\x7fELF":
        raise ValueError("not an ELF file")
    (flags,) = struct.unpack_from("<I", elf, 0x30)
    arch = (flags >> 8) & 0xFF if elf[8] >= 8 else flags & 0xFF
    return Code("sass", arch, specific, None, elf)


def _check_elf(image: bytes) -> None:
    """ValueError (or struct.error ...) unless the ELF file's header tables and section contents
    lie within it: a file cut short ends in the middle of them (the program headers come last)."""
    sections = _elf_sections(image)
    phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
    phsize, phnum, shsize, shnum = struct.unpack_from("<HHHH", image, 0x36)
    if phoff + phsize * phnum > len(image):
        raise ValueError(f"the program headers end at byte {phoff + phsize * phnum}, past the {len(image)}-byte file")
    for i in range(shnum):  # sh_type, then sh_offset and sh_size; SHT_NOBITS (8) has no bytes in the file
        kind, offset, size = struct.unpack_from("<I", image, shoff + i * shsize + 4)[0], \
            *struct.unpack_from("<QQ", image, shoff + i * shsize + 24)
        if kind != 8 and offset + size > len(image):
            raise ValueError(f"a section ends at byte {offset + size}, past the {len(image)}-byte file")
    if not sections:
        raise ValueError("no sections")


def _check_fatbin_size(image: bytes, label: str, origin: str) -> None:
    """Refuse a fatbin shorter than its header says: the driver is handed only a pointer and
    reads the size the header gives, past the end of a file cut short."""
    end = sum(struct.unpack_from("<HQ", image, 6)) if len(image) >= 16 else None  # header size + entries' size
    if end is None or end > len(image):
        size = "an incomplete 16-byte header" if end is None else f"a header saying it is {end} bytes long"
        raise LaunchError(f"{label}: {origin} starts as a fatbin but has {size}, and the file has {len(image)}: "
                          "the file is truncated, and the driver would read past its end; build it again "
                          "(nvcc -fatbin), or pass a CUBIN (nvcc -cubin -arch=sm_XY)")


def _check_ptx_blocks(image: bytes, label: str, origin: str) -> None:
    """Refuse PTX text whose braces do not pair up (comments and quoted strings aside): text cut
    short ends inside a function, which no driver JIT-compiles (CUDA_ERROR_INVALID_PTX)."""
    text = re.sub(rb'//[^\n]*|/\*.*?\*/|"[^"\n]*"', b"", image.rstrip(b"\0"), flags=re.S)
    depth = 0
    for brace in re.findall(rb"[{}]", text):
        depth += 1 if brace == b"{" else -1
        if depth < 0:
            break
    if depth:
        found = "a } closing no block" if depth < 0 else f"{depth} block(s) never closed"
        raise LaunchError(f"{label}: {origin} is PTX text whose braces do not pair up ({found}): "
                          "it is truncated or corrupt, and no driver would compile it; write it again (nvcc -ptx), "
                          "or pass a CUBIN (nvcc -cubin -arch=sm_XY)")


def _ptx_code(text: bytes, arch: int | None = None, version: str | None = None) -> Code:
    src = text.decode(errors="replace")
    v = re.search(r"^\s*\.version\s+(\d+\.\d+)", src, re.M)
    t = re.search(r"^\s*\.target\s+sm_(\d+)([af]?)", src, re.M)
    if (v is None or t is None) and (arch is None or version is None):
        raise ValueError("no .version and .target directives")
    return Code("ptx", arch if arch is not None else int(t.group(1)),
                bool(t and t.group(2) == "a"), version or v.group(1), text.rstrip(b"\0"))


def _fatbin_codes(image: bytes) -> list[Code]:
    """The entries of a fatbin; ValueError where the layout is not the expected one."""
    magic, _version, header, size = struct.unpack_from("<IHHQ", image, 0)
    at, end, codes = header, header + size, []
    if magic != _FATBIN_MAGIC or end > len(image):
        raise ValueError("not a fatbin, or a truncated one")
    while at < end:
        kind, _v, entry_header, payload = struct.unpack_from("<HHIQ", image, at)
        compressed, _u, minor, major, arch = struct.unpack_from("<IIHHI", image, at + 16)
        (flags,) = struct.unpack_from("<Q", image, at + 40)
        body = image[at + entry_header:at + entry_header + payload]
        if kind not in (1, 2) or entry_header < 64 or len(body) != payload:
            raise ValueError(f"an entry of kind {kind} at byte {at}")
        packed = bool(compressed or flags & _FATBIN_COMPRESSED)
        specific = bool(flags & _FATBIN_ARCH_SPECIFIC)
        if kind == 2:
            codes.append(Code("sass", arch, specific) if packed else _cubin_code(body, specific))
        else:
            codes.append(Code("ptx", arch, specific, f"{major}.{minor}", None if packed else body.rstrip(b"\0")))
        at += entry_header + payload
    return codes


@dataclass(frozen=True)
class BinaryProgram:
    """A binary selected for one device: what the loader and the layout checks take
    (the interface of compile.CompiledProgram)."""

    cubin: bytes = field(repr=False)  # the image cuModuleLoadData loads: CUBIN, fatbin, or PTX ending in NUL
    arch: str             # the device's arch it was selected for
    code: Code | None     # the code that runs there (None: this reader cannot tell)
    key: str = ""
    lowered_names: dict = field(default_factory=dict)
    # what built it, for whoever runs something else instead (the reference device, which
    # refuses such a kernel without a NumPy reference)
    built_by: str = ""

    def symbol(self, name: str) -> str:
        return self.lowered_names.get(name, name)

    def param_layout(self, name: str):
        if self.code is None:
            raise ValueError("the image's code is unknown")
        return self.code.param_layout(self.symbol(name))


class Binary:
    """A CUBIN, fatbin or PTX image (bytes, or a path to one) and the code it holds."""

    def __init__(self, image, label: str):
        if isinstance(image, str) and ("\n" in image or "\0" in image):  # text, no path: PTX as a str (Triton's asm["ptx"])
            if not (".version" in image[:4096] and ".target" in image[:4096]):
                raise LaunchError(f"{label}: a str is a kernel binary's path, or PTX text; this one is neither (a "
                                  f"{len(image)}-character text without .version and .target directives, "
                                  f"starting {image[:40]!r}): pass the path of a CUBIN, fatbin or PTX file, or its bytes")
            image = image.encode()
        if isinstance(image, (str, Path)):
            path = Path(image)
            try:
                image = path.read_bytes()
            except OSError as exc:
                raise LaunchError(f"{label}: cannot read the kernel binary {path} ({exc.strerror or exc}); pass the "
                                  "path of a CUBIN, fatbin or PTX file (nvcc -cubin / -fatbin / -ptx), or its bytes") \
                    from None
            self.origin = str(path)
        elif isinstance(image, (bytes, bytearray, memoryview)):
            image, self.origin = bytes(image), "the binary"
        else:
            raise LaunchError(f"{label}: a kernel binary is a path or bytes (a CUBIN, fatbin or PTX), got "
                              f"{type(image).__name__}")
        self.label, self.image = label, image
        self.key = hashlib.sha256(image).hexdigest()
        if image[:4] == b"\x7fELF":
            self.kind, parse = "CUBIN", lambda: [_cubin_code(image)]
        elif image[:4] == struct.pack("<I", _FATBIN_MAGIC):
            self.kind, parse = "fatbin", lambda: _fatbin_codes(image)
            _check_fatbin_size(image, label, self.origin)
        elif b".version" in image[:4096] and b".target" in image[:4096]:
            self.kind, parse = "PTX", lambda: [_ptx_code(image)]
            _check_ptx_blocks(image, label, self.origin)
        else:
            raise LaunchError(f"{label}: {self.origin} is not a CUBIN (ELF), a fatbin or PTX text; pass what nvcc "
                              "-cubin, -fatbin or -ptx writes (a .o or an executable embeds a fatbin: extract it with "
                              "cuobjdump -xelf all)")
        try:
            self.codes = parse()
        except (ValueError, struct.error, IndexError, UnicodeDecodeError):
            self.codes = None  # a layout this reader does not know: the driver decides at load
        if self.kind == "CUBIN":  # ELF is documented: one whose sections cannot be read is broken, not unknown
            try:
                _check_elf(image)
            except (ValueError, struct.error, IndexError, UnicodeDecodeError) as exc:
                raise LaunchError(f"{label}: {self.origin} starts as an ELF file (a CUBIN) but its sections cannot be "
                                  f"read ({type(exc).__name__}: {exc}): the file is truncated or corrupt, and no GPU "
                                  f"would load it; build it again (nvcc -cubin -arch=sm_XY)") from None

    def describe(self) -> str:
        held = ", ".join(c.describe() for c in self.codes) if self.codes else "code this reader cannot list"
        return f"{self.origin} ({self.kind}: {held})"

    def kernels(self) -> set | None:
        """The kernel symbols of the readable code; None if no code can be read."""
        readable = [c for c in self.codes or () if c.data is not None]
        if not readable:
            return None
        try:
            return set().union(*(c.kernels() for c in readable))
        except (ValueError, struct.error, IndexError):
            return None

    def resolve(self, entry: str) -> str:
        """The symbol of kernel ``entry``: itself, or the one mangled C++ symbol of the
        plain name (``scale`` is ``_Z5scalePf`` or ``_Z5scaleILi256EEvPf``, ``ns::scale``
        ``_ZN2ns5scaleE...``)."""
        known = self.kernels()
        if known is None or entry in known:
            return entry
        parts = entry.split("::")
        if all(p.isidentifier() for p in parts):
            mangled = "".join(f"{len(p)}{p}" for p in parts)
            found = sorted(s for s in known if (s.startswith(f"_ZN{mangled}") and s[len(mangled) + 3:][:1] in "EI"
                                               if len(parts) > 1 else s.startswith(f"_Z{mangled}")))
            if len(found) == 1:
                return found[0]
            if found:
                raise LaunchError(f"{self.label}: {self.origin} has {len(found)} kernels named {entry} (overloads or "
                                  f"template instances): {', '.join(found)}; pass entry= the symbol of the one to launch")
        raise LaunchError(f"{self.label}: {self.origin} has no kernel {entry!r}; its kernels are "
                          f"{', '.join(sorted(known)) or 'none'}: pass entry= one of them (an extern \"C\" name, a C++ "
                          "kernel's plain name when only one kernel has it, or a mangled symbol)")

    def layouts(self, symbol: str) -> list[tuple[Code, list]]:
        """``(code, parameter layout)`` of ``symbol`` in every piece of code that can be read."""
        out = []
        for c in self.codes or ():
            try:
                layout = c.param_layout(symbol)
            except (ValueError, struct.error, IndexError):
                continue
            if layout is not None:
                out.append((c, layout))
        return out

    def select(self, arch: str, driver: str | None) -> Code | None:
        """The code a GPU of ``arch`` with a CUDA ``driver`` ("13.0"; None: unknown) runs, as
        the driver picks it; ArchError if there is none; None if this reader cannot tell."""
        if not self.codes:
            return None
        digits = re.fullmatch(r"sm_(\d+)[af]?", arch)
        device = int(digits.group(1))
        sass = [c for c in self.codes if c.kind == "sass" and c.runs_on(device)]
        if sass:
            return max(sass, key=lambda c: c.arch)
        ptx = [c for c in self.codes if c.kind == "ptx" and c.runs_on(device)]
        if not ptx:
            raise ArchError(f"{self.label}: {self.describe()} has no code an {arch} GPU runs (SASS runs on its own major "
                            f"architecture, from its minor one up; PTX on its arch and newer): rebuild it for this GPU, "
                            f"nvcc -cubin -arch={arch} (or -gencode arch=compute_{device},code=sm_{device} in a fatbin)")
        best = max(ptx, key=lambda c: c.arch)
        needs = _driver_needed(best.ptx_version, driver)
        if needs is not None:
            raise ArchError(f"{self.label}: {self.describe()} runs on {arch} only as PTX of ISA {best.ptx_version}, "
                            f"which needs {needs} to JIT-compile; this one is CUDA {driver} "
                            f"(CUDA_ERROR_UNSUPPORTED_PTX_VERSION). Compile it to a CUBIN for {arch} (nvcc -cubin "
                            f"-arch={arch}, or ptxas -arch={arch} on the PTX), which this driver loads, or emit the PTX "
                            f"with a CUDA {driver} toolkit")
        return best

    def program(self, arch: str, driver: str | None, kernel: str = "", names: dict | None = None) -> BinaryProgram:
        """The image for a GPU of ``arch`` (checked as ``select`` does); ``names`` maps the
        names a kernel is looked up by to their symbols."""
        code = self.select(arch, driver)
        image = self.image if self.kind != "PTX" else self.image.rstrip(b"\0") + b"\0"
        return BinaryProgram(image, arch, code if code is not None and code.data is not None else None, self.key,
                             dict(names or {}), built_by=f"kernel {kernel or self.label} is a binary another "
                                                       f"compiler built ({self.origin})")


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def _driver_needed(isa: str | None, driver: str | None) -> str | None:
    """The driver PTX of ``isa`` needs, where a CUDA ``driver`` is too old for it (None: it is not,
    or no one can tell).  An ISA newer than any cuda-bindings knows needs a newer driver still."""
    if driver is None:
        return None
    needed = _cuda_for_ptx(isa)
    if needed is not None:
        return f"a CUDA {needed[0]}.{needed[1]} driver" if needed > _version(driver) else None
    newest = _newest_ptx()
    if newest is not None and isa is not None and _isa(isa) > _isa(newest[0]) and newest[1] >= _version(driver):
        return f"a driver newer than CUDA {newest[1][0]}.{newest[1][1]} (whose newest PTX ISA is {newest[0]})"
    return None


def _isa(text: str) -> tuple:
    """A PTX ISA version as a comparable pair ("9.10" after "9.9"); () if unreadable."""
    try:
        return _version(text)
    except (ValueError, AttributeError):
        return ()


@functools.lru_cache(maxsize=None)
def _newest_ptx() -> tuple[str, tuple[int, int]] | None:
    """The newest PTX ISA cuda-bindings' table knows and the CUDA release that brought it:
    an ISA newer still needs a newer driver than that release's."""
    known = [(isa, v) for isa in (f"{m}.{n}" for m in range(1, 20) for n in range(10))
             if (v := _cuda_for_ptx(isa)) is not None]
    return max(known, key=lambda k: _isa(k[0])) if known else None


def _cuda_for_ptx(isa: str | None) -> tuple[int, int] | None:
    """The first CUDA release whose driver loads PTX of ISA ``isa`` (cuda-bindings keeps the
    table); None if unknown (the driver decides)."""
    if isa is None:
        return None
    try:
        from cuda.bindings.utils import get_minimal_required_cuda_ver_from_ptx_ver
        v = get_minimal_required_cuda_ver_from_ptx_ver(isa)
    except (ImportError, ValueError):
        return None
    return v // 1000, (v % 1000) // 10
