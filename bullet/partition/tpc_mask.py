"""TPC masks for libsmctrl: which Texture Processing Clusters a stream may use.

libsmctrl's convention is inverted from intuition: **a set bit disables a TPC**. A mask therefore
starts from all ones and clears the bits of the TPCs the worker keeps. Bits above the device's TPC
count are left set (disabled): they name no hardware, and a 64-bit mask on a device with more than
64 TPCs would leave TPCs >= 64 in an undefined state, which is why such devices need the 128-bit
call. Prefill keeps the lowest TPC ids, decode the highest (see `base.role_slice`)."""

from __future__ import annotations

MASK_BITS = 128
ALL_DISABLED = (1 << MASK_BITS) - 1
LOW64 = (1 << 64) - 1


def disable_mask(enabled_tpcs: range) -> int:
    """128-bit mask with every bit set except those of `enabled_tpcs` (a contiguous range)."""
    if enabled_tpcs.step != 1 or enabled_tpcs.start < 0 or enabled_tpcs.stop > MASK_BITS:
        raise ValueError(f"enabled TPCs must be a contiguous range within 0..{MASK_BITS - 1}")
    enabled = ((1 << len(enabled_tpcs)) - 1) << enabled_tpcs.start if len(enabled_tpcs) else 0
    return ALL_DISABLED & ~enabled


def enabled_tpcs(mask: int, num_tpcs: int) -> list[int]:
    """TPC ids a mask leaves enabled on a device with `num_tpcs` TPCs (inverse of `disable_mask`)."""
    return [t for t in range(num_tpcs) if not (mask >> t) & 1]


def split_u128(mask: int) -> tuple[int, int]:
    """(low 64 bits, high 64 bits): the two integer registers an unsigned __int128 travels in."""
    if not 0 <= mask <= ALL_DISABLED:
        raise ValueError("mask must fit in 128 bits")
    return mask & LOW64, mask >> 64


def format_mask(mask: int, num_tpcs: int) -> str:
    """Hex of the bits that matter, for logs: 64-bit form when the device fits in it."""
    return f"0x{mask & LOW64:016x}" if num_tpcs <= 64 else f"0x{mask:032x}"
