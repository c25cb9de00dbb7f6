"""Capabilities some steps wait for. Each check says why a step cannot run yet (or None when it
can), so the report records "not available: <why>" and the step runs by itself once the feature
lands — no edit to the artifact needed, as long as the feature keeps the names below.

* Fig. 23 (ablation) needs `--policy` to accept Bullet's two halves: resource partitioning alone
  ("w/ Partition") and request scheduling alone ("w/ Scheduler", reordering and delayed decode) —
  `bullet/policies/ablation.py` provides both.
* Shared-prefix / multi-turn results need the prefix cache (SGLang's `--disable-radix-cache` flag
  is how the server says it has one) and a driver module that runs those workloads."""

from __future__ import annotations

import importlib.util

from pydantic import ValidationError

from bullet.config import ServerArgs

# the paper's label -> the `--policy` value that will select it
ABLATION_POLICIES = {"w/ Partition": "partition-only", "w/ Scheduler": "scheduler-only"}
PREFIX_DRIVER = "artifact.prefix_comparison"


def policy_unavailable(policy: str) -> str | None:
    """Why `--policy <policy>` is refused by the server's configuration (None when accepted)."""
    try:
        ServerArgs(policy=policy)
    except ValidationError as exc:
        return exc.errors()[0].get("msg", str(exc))
    return None


def ablation_unavailable() -> str | None:
    missing = {label: policy for label, policy in ABLATION_POLICIES.items() if policy_unavailable(policy)}
    if missing:
        return ("--policy does not accept " + " / ".join(f"'{p}' ({label})" for label, p in missing.items())
                + " yet; this step runs them once it does (names in artifact/evaluation/hooks.py)")
    return None


def prefix_unavailable() -> str | None:
    reasons = []
    if "disable_radix_cache" not in ServerArgs.model_fields:
        reasons.append("the server has no prefix cache yet (no --disable-radix-cache flag)")
    if importlib.util.find_spec(PREFIX_DRIVER) is None:
        reasons.append(f"no driver `python -m {PREFIX_DRIVER}` yet")
    return "; ".join(reasons) or None
