"""The engine benchmark's external reference — `transformers` running the served GGUF — steps its KV
cache through the argument the installed `transformers` names (`cache` since 5.x; `past_key_values`
warns there and goes in 5.40), so the artifact's engine step neither prints deprecation warnings
nor breaks when the old name is removed."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("transformers")

from artifact.benchmarks.bench_engine import Reference  # noqa: E402


def test_the_reference_decodes_on_its_cache_without_deprecated_arguments(capfd):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        reference = Reference()
        assert reference.decode(2) > 0
        assert reference.prefill(8) > 0
    printed = capfd.readouterr()
    assert "deprecated" not in printed.err + printed.out, printed.err
