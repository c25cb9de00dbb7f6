"""Bullet: prefill and decode as two concurrent workers on one accelerator, with SLO-aware,
dynamically re-divided compute units (ASPLOS'26 Bullet)."""

from estimator.version import package_version

__version__ = package_version()

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # Lazy: `import bullet` stays cheap (no torch) for the CLI and the control-plane modules.
    if name == "LLM":
        from bullet.llm import LLM  # deferred: `import bullet` stays free of torch

        return LLM
    if name == "SamplingParams":
        from engines.sampling_params import SamplingParams  # deferred: as above (pydantic models load on use)

        return SamplingParams
    raise AttributeError(name)
