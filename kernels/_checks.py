"""The checks the kernel declarations share: what a kernel's shapes cannot say
(counts, divisibility, alignment) is said with these, one wording everywhere."""
import deviceop as dop


def _need(cond: bool, message: str, kind=dop.ShapeError) -> None:
    if not cond:
        raise kind(message)


def _counts(kernel: str, g: dict, *names) -> None:
    """Generics that are counts (tiles, steps): ints >= 1, checked before any arithmetic uses them."""
    for n in names:
        v = g[n]
        _need(isinstance(v, int) and not isinstance(v, bool) and v >= 1,
              f"{kernel}: generic {n}={v!r} must be an int >= 1")


def _aligned(*tensors, who: str = "these kernels use") -> None:
    for t in tensors:
        _need(t.data_ptr % 16 == 0, f"{who} 16-byte loads: tensors must start 16-byte aligned")
