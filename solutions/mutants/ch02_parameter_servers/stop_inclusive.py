"""Wrong: treats a range's stop as one of its keys.

``start <= key <= stop`` reads naturally but Python ranges stop before ``stop``: the first key of
each next range goes to the server before it.
"""




def server_of(key: int, ranges: list[range]) -> int:

    if not ranges or ranges[0].start != 0:
        raise ValueError("ranges must be a non-empty list of contiguous key ranges starting at 0 (see "
                         "balanced_key_ranges)")
    if int(key) != key or not 0 <= key < ranges[-1].stop:
        raise ValueError(f"key {key} is outside the key space 0..{ranges[-1].stop - 1}")
    return next(i for i, r in enumerate(ranges) if r.start <= key <= r.stop)
