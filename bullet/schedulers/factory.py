"""`--policy` to policy objects for each worker."""

from __future__ import annotations

from bullet.config import ServerArgs
from bullet.schedulers.base import DecodePolicy, PrefillPolicy
from bullet.schedulers.static import StaticDecodePolicy, StaticPrefillPolicy


def static_split(args: ServerArgs, total_units: int) -> tuple[int, int]:
    """(prefill units, decode units) of a fixed split; `naive` gives both everything."""
    if args.policy_name == "naive":
        return total_units, total_units
    prefill = args.policy_arg if args.policy_arg is not None else max(1, total_units // 2)
    if not 1 <= prefill <= total_units:
        raise ValueError(f"--policy {args.policy}: prefill units must lie in 1..{total_units}")
    return prefill, max(1, total_units - prefill)


def make_prefill_policy(args: ServerArgs, total_units: int) -> PrefillPolicy:
    if args.policy_name in ("static", "naive"):
        units, _ = static_split(args, total_units)
        return StaticPrefillPolicy(units, args.prefill_layers_per_step, args.max_prefill_tokens)
    raise ValueError(f"policy {args.policy!r} has no prefill worker")


def make_decode_policy(args: ServerArgs, total_units: int) -> DecodePolicy:
    if args.policy_name in ("static", "naive"):
        _, units = static_split(args, total_units)
        return StaticDecodePolicy(units)
    raise ValueError(f"policy {args.policy!r} has no decode worker")


def initial_units(args: ServerArgs, total_units: int) -> tuple[int, int]:
    """Shares the workers start with (prefill, decode)."""
    if args.policy_name in ("static", "naive"):
        return static_split(args, total_units)
    return total_units, total_units
