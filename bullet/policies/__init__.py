"""Scheduling policies: the chunked-prefill baseline here; Bullet's SLO-aware prefill/decode policies."""
