"""Weight sources: GGUF (dequantized on load), Hugging Face safetensors directories, dummy weights.

Every loader returns a `LoadedWeights`: the ModelConfig and a state dict in `engines.model.llama`
naming and fused layout, so the model never knows where its weights came from."""

from engines.weights.errors import ModelLoadError
from engines.weights.resolve import DEFAULT_MODEL, LoadedWeights, load_weights, resolve_model_path

__all__ = ["DEFAULT_MODEL", "LoadedWeights", "ModelLoadError", "load_weights", "resolve_model_path"]
