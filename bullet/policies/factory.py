"""`--policy` to policy objects for each worker."""

from __future__ import annotations

from bullet.config import ServerArgs
from bullet.policies.ablation import PartitionOnlyDecode, PartitionOnlyPrefill, SchedulerOnlyDecode, SchedulerOnlyPrefill
from bullet.policies.bullet_decode import BulletDecodePolicy
from bullet.policies.bullet_prefill import BulletPrefillPolicy
from bullet.policies.static import StaticDecodePolicy, StaticPrefillPolicy
from bullet.policies.views import DecodePolicy, PrefillPolicy
from bullet.types.roles import Role
from bullet.types.slo import SLO


ONE_PROCESS_POLICIES = ("chunked", "sglang")


def roles_for(args: ServerArgs) -> tuple[Role, ...]:
    """Worker processes a policy runs: the chunked baseline is one process doing both phases."""
    return (Role.UNIFIED,) if args.policy_name in ONE_PROCESS_POLICIES else (Role.PREFILL, Role.DECODE)


def static_split(args: ServerArgs, total_units: int) -> tuple[int, int]:
    """(prefill units, decode units) of a fixed split; `naive` gives both everything."""
    if args.policy_name == "naive":
        return total_units, total_units
    prefill = args.policy_arg if args.policy_arg is not None else max(1, total_units // 2)
    if not 1 <= prefill <= total_units:
        raise ValueError(f"--policy {args.policy}: prefill units must lie in 1..{total_units}")
    return prefill, max(1, total_units - prefill)


def initial_units(args: ServerArgs, total_units: int) -> tuple[int, int]:
    """Shares the workers start with (prefill, decode)."""
    if args.policy_name in ("static", "naive"):
        return static_split(args, total_units)
    return total_units, total_units


def slo_of(args: ServerArgs) -> SLO:
    return SLO.parse(args.ttft_slo, args.tpot_slo, args.tbt_slo)


def make_prefill_policy(args: ServerArgs, feasible_units: list[int], num_layers: int, estimator=None,
                        batch_token_limit=None, decode_units: list[int] | None = None) -> PrefillPolicy:
    total = max(feasible_units)
    if args.policy_name in ("static", "naive"):
        units, _ = static_split(args, total)
        return StaticPrefillPolicy(units, args.prefill_layers_per_step, args.max_prefill_tokens)
    if args.uses_estimator:
        cls = {"partition-only": PartitionOnlyPrefill, "scheduler-only": SchedulerOnlyPrefill}.get(
            args.policy_name, BulletPrefillPolicy)
        return cls(estimator, slo_of(args), feasible_units, args.prefill_layers_per_step, num_layers,
                                   args.max_prefill_tokens, batch_token_limit or (lambda units: args.max_prefill_tokens),
                                   preemption=args.prefill_preemption, hand_back=args.hand_back,
                                   layer_group=args.layer_group, split_rule=args.split_rule,
                                   split_goal=args.split_goal, decode_units=decode_units,
                                   percentile=args.slo_percentile, prefill_grow=args.prefill_grow)
    raise ValueError(f"policy {args.policy!r} has no prefill worker")


def make_decode_policy(args: ServerArgs, feasible_units: list[int], estimator=None) -> DecodePolicy:
    total = max(feasible_units)
    if args.policy_name in ("static", "naive"):
        _, units = static_split(args, total)
        return StaticDecodePolicy(units)
    if args.uses_estimator:
        cls = {"partition-only": PartitionOnlyDecode, "scheduler-only": SchedulerOnlyDecode}.get(
            args.policy_name, BulletDecodePolicy)
        return cls(estimator, slo_of(args), feasible_units, idle_units=args.idle_decode_units,
                   yield_at=args.decode_yield_at,
                   prefill_layers_per_step=args.prefill_layers_per_step if args.decode_tail_share else 0,
                   percentile=args.slo_percentile)
    raise ValueError(f"policy {args.policy!r} has no decode worker")
