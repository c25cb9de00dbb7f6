"""`green-ctx` backend: a pool of green-context streams, one per SM count; switching = picking one.

A green context's SM set is fixed when it is created, so a share cannot be changed in place. At
start-up the device's SMs are split **once** with `cuDevSmResourceSplitByCount` into equal groups of
the driver's granularity (only one split call guarantees the groups are disjoint); a pool entry for
`k` groups is a green context built from the first `k` groups and the split's remainder (prefill) or
the last `k` groups (decode), plus one entry holding everything (all groups and the remainder): a
prefill share and the decode share of the other groups add up to the whole device (on an H200, 16
groups of 8 SMs and 4 left: prefill 4 + 8k beside decode 8(16 - k)), where shares of whole groups on
both sides would leave the remainder idle whenever both workers run. `apply` then only selects
the entry — microseconds — and the worker launches on `launch_stream()`. A CUDA graph runs in the
partition of the stream it was captured on, so graphs must be captured per pool entry.

Granularity comes from the driver (`minSmPartitionSize`, `smCoscheduledAlignment`: compute
capability 8.x min 4 / step 2, 9.0+ min 8 / step 8), and the pool is built from the group sizes the
split actually returned, never from assumed ones.

Two processes each make their own split; their sets are disjoint only if the driver splits the same
device identically in both (deterministic, but not a documented guarantee) — `bullet doctor` checks
the SM ids each pool stream really runs on. Under MPS those ids say nothing: on an H200 (driver 13.0,
2026-11-26) every pool of N SMs reported ids 0..N-1 in each process, so whether two processes' pools
are disjoint is for the doctor's cross-process timing check (`bullet.doctor.isolation`) to tell.

A server builds the `coarse` pool (`GroupLayout.coarse_counts`: splits at 1/16, 1/8, 1/4, 1/2, 3/4
from either side, eight shares per role on an H200 — decode 8, 16, 32, 64, 96, 112, 120 and all 132
SMs, prefill the complements 124, 116, 100, 68, 36, 20, 12 and all) rather than every multiple of the
group (seventeen): the smallest lets decode keep 8 SMs when TPOT has slack; each share
the decode policy picks needs its own CUDA graphs, captured before they are needed
(`launch_stream.WorkerStream.each_share`)."""

from __future__ import annotations

from dataclasses import dataclass

from bullet.partition.base import Granularity, PartitionBackend, PartitionUnavailable
from bullet.partition.gpu_helper import load_helper


COARSE_FRACTIONS = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4)
POOLS = ("all", "coarse")


@dataclass(frozen=True)
class PoolShare:
    """One pool entry's composition: groups [first, first + count) (+ the remainder)."""

    sms: int
    first: int
    count: int
    with_remainder: bool
    positions: tuple[int, ...]  # logical SM slots it covers (group order, remainder last)


class GroupLayout:
    """Bookkeeping of one split: which logical SM slots each pool share covers, per role (slots in
    group order, the remainder last: prefill's shares are the first groups and the remainder, decode's
    the last groups)."""

    def __init__(self, group_sms: list[int], remainder_sms: int):
        if not group_sms or min(group_sms) < 1 or remainder_sms < 0:
            raise ValueError(f"a split needs at least one non-empty group, got {group_sms}")
        self.group_sms = list(group_sms)
        self.remainder_sms = remainder_sms
        self.offsets = [0]
        for g in group_sms:
            self.offsets.append(self.offsets[-1] + g)
        self.total = self.offsets[-1] + remainder_sms

    def share(self, role: str, count: int) -> PoolShare:
        """Share of `count` groups: the first ones and the remainder for prefill, the last ones for decode."""
        n = len(self.group_sms)
        if not 1 <= count <= n:
            raise ValueError(f"count must be in 1..{n}")
        if role == "prefill":
            hi = self.offsets[count]
            rest = tuple(range(self.offsets[n], self.total))
            return PoolShare(hi + self.remainder_sms, 0, count, self.remainder_sms > 0, tuple(range(hi)) + rest)
        lo, hi = self.offsets[n - count], self.offsets[n]
        return PoolShare(hi - lo, n - count, count, False, tuple(range(lo, hi)))

    def full(self) -> PoolShare:
        return PoolShare(self.total, 0, len(self.group_sms), self.remainder_sms > 0, tuple(range(self.total)))

    def coarse_counts(self, role: str) -> list[int]:
        """SM counts of a small pool that still splits the device at 1/16, 1/8, 1/4, 1/2 and 3/4 from
        either side: each fraction of the groups and its complement, so a share and the complement
        of another are both in it. Fewer shares mean fewer CUDA graphs to capture (one per share
        and batch bucket) and fewer switches to pay for."""
        n = len(self.group_sms)
        groups = {max(1, min(n, round(n * f))) for f in COARSE_FRACTIONS}
        groups |= {n - g for g in groups if 0 < n - g}
        return sorted(self.share(role, g).sms for g in groups)

    def plan(self, role: str, counts: list[int] | None = None) -> list[PoolShare]:
        """Pool entries, ascending by SM count. `counts` limits the pool to the smallest share
        covering each requested count (fewer green contexts, less memory); the full share is
        always included so a worker can run on the whole device."""
        candidates = [self.share(role, k) for k in range(1, len(self.group_sms) + 1)]
        if candidates[-1].sms != self.total:  # decode's shares are whole groups: the device needs its own entry
            candidates.append(self.full())
        if counts is not None:
            chosen = {next((c for c in candidates if c.sms >= want), candidates[-1]).sms for want in counts}
            candidates = [c for c in candidates if c.sms in chosen or c.sms == self.total]
        return sorted(candidates, key=lambda c: c.sms)


@dataclass
class _PoolEntry:
    share: PoolShare
    green_ctx: int
    stream: int


class GreenContextBackend(PartitionBackend):
    name = "green-ctx"
    unit_kind = "SM"

    def __init__(self, role: str, device: int = 0, group_sms: int | None = None,
                 counts: list[int] | None = None, split_flags: int = 0, driver=None, pool: str = "all"):
        """`group_sms`: SMs per split group (default: the driver's co-scheduling alignment, which
        the driver raises to its minimum partition if needed). `counts`: SM counts the pool must
        cover (default: every multiple of the group; `pool="coarse"`: `GroupLayout.coarse_counts`, what
        a server uses). `split_flags`: CUdevSmResourceSplit_flags.
        `driver`: the object making driver calls (default: the C helper, `gpu_helper`)."""
        if pool not in POOLS:
            raise ValueError(f"green-ctx pool must be one of {POOLS}, got {pool!r}")
        self._pool: dict[int, _PoolEntry] = {}
        self._split = None
        try:
            if driver is None:
                driver = load_helper()
            driver.green_ctx_supported()  # "no CUDA driver" / "driver lacks cuGreenCtxCreate" / ...
        except PartitionUnavailable as e:
            raise PartitionUnavailable(f"green-ctx unavailable: {e}") from e
        self._driver = driver
        self._resource = driver.sm_resource(device)
        group = group_sms or max(self._resource.coscheduled_alignment, 1)
        self._split = driver.split(device, group, split_flags)
        try:
            self._layout = GroupLayout(self._split.group_sms, self._split.remainder_sms)
            self._pool_kind, self._counts = pool, counts
            if counts is None and pool == "coarse":
                counts = self._layout.coarse_counts(role)
            for share in self._layout.plan(role, counts):
                ctx, stream = driver.create_stream(self._split, share.first, share.count, share.with_remainder)
                self._pool[share.sms] = _PoolEntry(share, ctx, stream)
        except BaseException:
            self.close()
            raise
        smallest = min(self._pool)
        super().__init__(role, self._layout.total, Granularity(smallest, self._layout.group_sms[0]))
        self._device, self._flags = device, split_flags
        self._active = self._pool[self._layout.total]

    def feasible_units(self) -> list[int]:
        return sorted(self._pool)

    def peer_feasible_units(self) -> list[int]:
        """The other role's pool on the same split (its process builds it the same way): with a
        remainder, prefill's sizes carry it and decode's do not."""
        peer = "decode" if self.role == "prefill" else "prefill"
        counts = self._layout.coarse_counts(peer) if self._pool_kind == "coarse" and self._counts is None else self._counts
        return sorted({share.sms for share in self._layout.plan(peer, counts)})

    def unit_set(self) -> frozenset[int]:
        return frozenset(self._active.share.positions)

    def launch_stream(self) -> int | None:
        return self._active.stream

    def pool_streams(self) -> dict[int, int]:
        """SM count -> stream handle, for capturing one CUDA graph per pool entry."""
        return {sms: entry.stream for sms, entry in sorted(self._pool.items())}

    def _apply(self, units: int) -> None:
        entry = self._pool.get(units)
        if entry is None:  # round_units only yields pool sizes; this guards direct misuse
            raise PartitionUnavailable(f"green-ctx: no pool stream with {units} SMs")
        self._active = entry

    def close(self) -> None:
        errors = []
        for entry in self._pool.values():
            try:
                self._driver.destroy_stream(entry.green_ctx, entry.stream)
            except PartitionUnavailable as e:
                errors.append(str(e))
        self._pool.clear()
        if self._split is not None:
            self._driver.free_split(self._split)
            self._split = None
        if errors:
            raise PartitionUnavailable("green-ctx: destroying the pool failed: " + "; ".join(errors))

    def _details(self) -> dict:
        return {
            "device": self._device,
            "sm_resource": {"sm_count": self._resource.sm_count,
                            "min_partition_size": self._resource.min_partition_size,
                            "coscheduled_alignment": self._resource.coscheduled_alignment},
            "groups": list(self._layout.group_sms),
            "remainder_sms": self._layout.remainder_sms,
            "pool": sorted(self._pool),
            "split_flags": self._flags,
            "stream": hex(self._active.stream) if self._pool else None,
        }
