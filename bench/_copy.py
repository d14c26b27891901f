"""The device-to-device copy rate: the memory-bandwidth ceiling the benchmarks compare against."""


def copy_rate(stream) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read + written."""
    import cupy
    n = 1 << 28  # 1 GiB of float32
    a, b = cupy.ones(n, dtype=cupy.float32), cupy.empty(n, dtype=cupy.float32)
    with stream.cupy:
        for _ in range(3):
            b[...] = a
        start, end = stream.record_event(), None
        reps = 20
        for _ in range(reps):
            b[...] = a
        end = stream.record_event()
    end.synchronize()
    return 2 * a.nbytes * reps / (start.elapsed_ms(end) / 1e3)
