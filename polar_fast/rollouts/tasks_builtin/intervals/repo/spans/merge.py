"""Merging closed integer intervals."""


def merge_intervals(intervals):
    """Merge overlapping closed intervals; returns a sorted list of (start, end) tuples."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start < merged[-1][1]:
            last_start, last_end = merged[-1]
            merged[-1] = (last_start, max(last_end, end))
        else:
            merged.append((start, end))
    return merged
