"""A loop core for a role, with the policy `--policy` asks for: what a worker process and the
simulator both build, so the two cannot drift apart."""

from __future__ import annotations

from typing import Callable

from bullet.cache.prefix_cache import PrefixCache
from bullet.config import ServerArgs
from bullet.loops.base import LoopCore, LoopEnv
from bullet.loops.decode import DecodeCore
from bullet.loops.prefill import PrefillCore
from bullet.loops.unified import UnifiedCore
from bullet.policies.factory import make_decode_policy, make_prefill_policy
from bullet.policies.hybrid import HybridScheduler
from bullet.policies.predict import Predictor
from bullet.types.roles import Role


def build_core(env: LoopEnv, args: ServerArgs, num_layers: int, predictor: Predictor | None = None,
               batch_token_limit: Callable[[int], int] | None = None) -> LoopCore:
    feasible = env.partition.feasible_units()
    cached = not args.disable_radix_cache
    if env.role is Role.PREFILL:  # the prefill worker owns the prefix cache
        policy = make_prefill_policy(args, feasible, num_layers, predictor, batch_token_limit,
                                     decode_units=env.partition.peer_feasible_units())
        return PrefillCore(env, policy, num_layers, PrefixCache(env.allocator) if cached else None,
                           args.max_running_requests)
    if env.role is Role.DECODE:
        # the SLO-aware policies may change a step's share between layers (fixed splits never do)
        yields = args.uses_estimator and args.decode_yield_at == "layer"
        return DecodeCore(env, make_decode_policy(args, feasible, predictor), remote_cache=cached,
                          yield_between_layers=yields)
    scheduler = HybridScheduler(env.allocator, args.policy_arg, args.max_running_requests,
                                mixed=args.policy_name == "chunked",
                                cache=PrefixCache(env.allocator) if cached else None)  # in-process, as prefill's
    return UnifiedCore(env, scheduler)
