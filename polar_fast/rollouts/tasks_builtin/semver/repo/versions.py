"""Comparing dotted release versions like 1.2.3."""


def parse(version):
    parts = version.strip().split(".")
    if not parts or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a dotted version: {version!r}")
    return tuple(parts)


def is_newer(candidate, current):
    return parse(candidate) > parse(current)
