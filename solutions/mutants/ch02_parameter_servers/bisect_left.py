"""Wrong: bisect_left on the starts, minus one.

Right for keys inside a range, wrong for a key that starts one: it returns the range before, and
with an empty range before it, a range that holds nothing.
"""
import bisect


def server_of(key: int, ranges: list[range]) -> int:

    if not ranges or ranges[0].start != 0:
        raise ValueError("ranges must be a non-empty list of contiguous key ranges starting at 0 (see "
                         "balanced_key_ranges)")
    if int(key) != key or not 0 <= key < ranges[-1].stop:
        raise ValueError(f"key {key} is outside the key space 0..{ranges[-1].stop - 1}")
    starts = [r.start for r in ranges]
    return bisect.bisect_left(starts, key) - 1  # the last range starting at or before key
