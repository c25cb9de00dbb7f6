"""Bullet: prefill and decode as two concurrent workers on one accelerator, with SLO-aware,
dynamically re-divided compute units (ASPLOS'26 Bullet)."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):
    # Lazy: `import bullet` stays cheap (no torch) for the CLI and the control-plane modules.
    if name == "LLM":
        from bullet.llm import LLM

        return LLM
    if name == "SamplingParams":
        from engines.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
