"""Wrong: scans for the first range that starts at or before the key.

Every range after the first starts later, so the first range always matches: right only for the
first server's keys.
"""




def server_of(key: int, ranges: list[range]) -> int:

    if not ranges or ranges[0].start != 0:
        raise ValueError("ranges must be a non-empty list of contiguous key ranges starting at 0 (see "
                         "balanced_key_ranges)")
    if int(key) != key or not 0 <= key < ranges[-1].stop:
        raise ValueError(f"key {key} is outside the key space 0..{ranges[-1].stop - 1}")
    return next(i for i, r in enumerate(ranges) if r.start <= key)
