"""CPU id lists as the kernel writes them (`Cpus_allowed_list`, taskset): '0-2,5' <-> {0, 1, 2, 5}."""

from __future__ import annotations


def format_id_list(ids) -> str:
    """Compact id list in the kernel's `Cpus_allowed_list` style: {0,1,2,5} -> '0-2,5'."""
    ordered = sorted(set(ids))
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def parse_id_list(text: str) -> set[int]:
    """Inverse of `format_id_list` (also reads `/proc/<pid>/status` Cpus_allowed_list)."""
    ids: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        ids.update(range(int(lo), int(hi or lo) + 1))
    return ids
