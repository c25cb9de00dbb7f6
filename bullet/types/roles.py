"""The roles a worker process plays, and what each role implies: which state-buffer block it
publishes in, which end of the unit range its partition takes, who its peer is."""

from __future__ import annotations

import enum


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    UNIFIED = "unified"  # the chunked baseline's single worker: both phases in hybrid batches

    def __str__(self) -> str:
        return self.value

    @property
    def block(self) -> "Role":
        """The state-buffer block it publishes in (the unified worker reports in prefill's)."""
        return Role.DECODE if self is Role.DECODE else Role.PREFILL

    @property
    def peer(self) -> "Role":
        """The block it reads its peer's state from."""
        return Role.PREFILL if self is Role.DECODE else Role.DECODE

    @property
    def partition_side(self) -> str:
        """Which end of the unit range its share comes from: decode the high end, else the low."""
        return "decode" if self is Role.DECODE else "prefill"


BLOCK_ROLES = (Role.PREFILL, Role.DECODE)  # one state-buffer block each, in layout order
