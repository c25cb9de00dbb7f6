"""`bullet simulate --tp-size`: a model split over several devices, each priced as one rank (its
shard, its KV pool beside its share of the weights, its collectives); one rank is the single
device to the bit; a model that does not fit one device is refused with the way out."""

from __future__ import annotations

import json

import pytest

from bullet.sim import SimConfig, Simulation
from bullet.sim.config import GB, device_estimator, kv_bytes_per_token, weight_bytes
from estimator.interconnect import LINKS

# a few short requests, (arrival s, prompt tokens, output tokens): no trace needed
REQUESTS = [(0.05 * i, 200 + 37 * i, 20 + i) for i in range(12)]


def summary(config: SimConfig) -> dict:
    return json.loads(json.dumps(Simulation(config, REQUESTS).run().summary))  # NaN-safe, exact floats


@pytest.mark.parametrize("policy", ["bullet", "sglang:1024"])
def test_one_rank_is_the_single_device_whatever_the_link(policy):
    plain = summary(SimConfig(policy=policy, seed=3))
    assert summary(SimConfig(policy=policy, seed=3, tp_size=1, tp_link="pcie4", tp_link_busbw_gbps=1.0)) == plain


def test_8_ranks_of_70b_hold_an_eighth_of_the_weights_and_a_kv_pool_beside_them():
    config = SimConfig(model="llama-3.1-70b", hardware="a100", tp_size=8)
    sim = Simulation(config, REQUESTS)
    shard = sim.device_estimator.model
    assert (shard.num_attention_heads, shard.num_key_value_heads) == (8, 1)
    assert kv_bytes_per_token(shard) == 2 * 80 * 128 * 2  # one KV head of 128 per layer, K and V, bf16
    per_device = weight_bytes(shard)
    assert 17.5 * GB < per_device < 17.9 * GB  # 70.6B parameters / 8, bf16
    assert sim.allocator.total_pages == int((80 * GB - per_device) // (kv_bytes_per_token(shard) * 16))
    assert sim.device_estimator.tensor_parallel.link == LINKS["nvlink3"]  # the A100's own link by default
    result = sim.run()
    assert result.summary["completed"] == len(REQUESTS)
    assert result.counters["free_pages"] == result.counters["total_pages"]


def test_a_slower_link_makes_every_system_slower():
    fast, slow = (summary(SimConfig(policy="bullet", model="llama-3.1-70b", hardware="a100", tp_size=8, tp_link=link,
                                    seed=1)) for link in ("nvlink3", "bullet-a100"))
    assert slow["mean_ttft_s"] > fast["mean_ttft_s"] and slow["mean_tpot_s"] > fast["mean_tpot_s"]


def test_tp_refuses_a_profile_and_a_split_the_heads_do_not_allow():
    with pytest.raises(ValueError, match="leave --estimator-profile out"):
        device_estimator(SimConfig(tp_size=2, estimator_profile="any.json"))
    with pytest.raises(ValueError, match="attention heads do not split over 3"):
        device_estimator(SimConfig(model="llama-3.1-70b", tp_size=3))
    with pytest.raises(ValueError, match="tp_size must be >= 1"):
        device_estimator(SimConfig(tp_size=0))


def test_cli_simulates_70b_on_8_a100s(capsys):
    from bullet.cli import main

    code = main(["simulate", "--model", "llama-3.1-70b", "--tp-size", "8", "--hardware", "a100", "--duration", "5",
                 "--quiet", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["simulated"] is True and data["device"]["tp_size"] == 8
    assert data["device"]["model"] == "llama-3.1-70b/tp8" and data["device"]["tp_link"].startswith("NVLink3")
    assert data["summary"]["completed"] == data["summary"]["requests"] > 0


def test_cli_refuses_70b_on_one_a100_and_says_how_many_devices(capsys):
    from bullet.cli import main

    assert main(["simulate", "--model", "llama-3.1-70b", "--hardware", "a100", "--duration", "5", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "llama-3.1-70b does not fit on one A100-SXM4-80GB" in err and "141 GB in bf16" in err
    assert "need 2 such devices (--tp-size splits the model over several)" in err
    # 8 ranks of 70B fit; 2 ranks of Qwen3-235B do not: each would hold 235 GB / 2
    assert main(["simulate", "--model", "qwen3-235b-a22b", "--hardware", "a100", "--tp-size", "2", "--duration", "1",
                 "--quiet"]) == 2
    assert "one of 2 tensor-parallel ranks holds" in capsys.readouterr().err
