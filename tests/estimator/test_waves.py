"""Wave quantization (Bullet §2.2.1) and the reproduction of Bullet Table 2."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from estimator.waves import TABLE2_PAPER, TABLE2_SEQ_LENS, idle_ratio, prefill_idle_table, tail_units, wave_factor, waves


@pytest.mark.parametrize("seq_len", TABLE2_SEQ_LENS)
def test_table2_qkv_attn_o_columns_within_half_a_point(llama3_8b, seq_len):
    row = {r.seq_len: r for r in prefill_idle_table(llama3_8b, units=108)}[seq_len]
    qkv, attn, o = TABLE2_PAPER[seq_len][:3]
    assert row.qkv == pytest.approx(qkv, abs=0.5)
    assert row.attn == pytest.approx(attn, abs=0.5)
    assert row.o == pytest.approx(o, abs=0.5)


def test_table2_worked_example():
    # O projection, 1024 tokens: 8 x 16 tiles of 128x256 = 128 blocks on 108 SMs -> 2 waves,
    # 20 SMs busy in the last one, (108 - 20) / 216 idle.
    assert waves(128, 108) == 2
    assert tail_units(128, 108) == 20
    assert idle_ratio(128, 108) == pytest.approx(88 / 216)


@given(grid=st.integers(1, 100_000), units=st.integers(1, 256))
def test_wave_factor_is_the_inverse_of_busy_time(grid, units):
    factor = wave_factor(grid, units)
    assert factor >= 1.0
    if grid >= units:  # the formula's idle ratio is defined for at least one full wave
        assert factor == pytest.approx(1.0 / (1.0 - idle_ratio(grid, units)))


@given(k=st.integers(1, 50), units=st.integers(1, 256))
def test_whole_waves_waste_nothing(k, units):
    assert idle_ratio(k * units, units) == 0.0
    assert wave_factor(k * units, units) == 1.0


def test_blocks_per_unit_divides_the_waves():
    assert waves(216, 108, blocks_per_unit=2) == 1
    assert idle_ratio(216, 108, blocks_per_unit=2) == 0.0
