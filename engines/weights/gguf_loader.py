"""GGUF files (llama.cpp format), dequantized to a float dtype on load.

llama.cpp's converter permutes the rows of Q and K so that its interleaved RoPE applies; our model
uses the Hugging Face half-rotation layout, so those rows are put back on load.

Every tensor of the file is used or the load fails naming it. `rope_freqs.weight` (Llama 3.1-3.3's
rope scaling, which llama.cpp stores as one divisor per frequency instead of its parameters) becomes
the config's llama3 `rope_scaling` where Meta's parameters reproduce it; other scalings are refused."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from engines import architectures
from engines.model.rope import inverse_frequencies
from engines.model_config import ModelConfig
from engines.weights.errors import ModelLoadError
from engines.weights.layout import check_shapes, fuse_layer


def plain_array_reader():
    """gguf's reader class, over a plain ndarray view of its file mapping instead of the `np.memmap` itself.

    The reader parses every metadata field through small views of its mapping — for a Llama tokenizer's
    49k strings and 49k merges, ~1.2 million of them — and a view of a `np.memmap` runs memmap's own
    `__array_finalize__` each time, which took most of the parse: 3.3 s against 0.9 s over the plain view
    (SmolLM2's GGUF, 2-core Intel Xeon VM). A server's first load parses the file twice at once (the
    weights, and transformers exporting the tokenizer, `plain_array_reader_installed`), and took 17-21 s,
    10-12 s of them in the weights' parse; 8-10 s with this class. The bytes and their lifetime are the
    same: the plain view keeps the mapping alive through its base. The class is made on first use, not at
    import, because only a GGUF load imports the gguf library."""
    global _PLAIN_ARRAY_READER
    if _PLAIN_ARRAY_READER is None:
        import gguf

        class PlainArrayReader(gguf.GGUFReader):
            @property
            def data(self):
                return self._plain_data

            @data.setter
            def data(self, value):  # the reader's __init__ assigns its np.memmap here
                self._plain_data = value.view(np.ndarray)

        _PLAIN_ARRAY_READER = PlainArrayReader
    return _PLAIN_ARRAY_READER


_PLAIN_ARRAY_READER = None
_installed_lock = threading.Lock()
_installed = {"depth": 0, "replaced": None}  # uses open now, and the class the first of them replaced


@contextmanager
def plain_array_reader_installed():
    """While it lasts, `gguf.GGUFReader` is `plain_array_reader()`: for a library that looks the class up
    when it reads a file (transformers' GGUF tokenizer export and checkpoint load). Nested and concurrent
    uses are counted; the last to leave puts back what the first replaced."""
    import gguf

    plain = plain_array_reader()
    with _installed_lock:
        if _installed["depth"] == 0:
            _installed["replaced"], gguf.GGUFReader = gguf.GGUFReader, plain
        _installed["depth"] += 1
    try:
        yield
    finally:
        with _installed_lock:
            _installed["depth"] -= 1
            if _installed["depth"] == 0:
                gguf.GGUFReader = _installed["replaced"]


def open_gguf(path: Path):
    try:
        return plain_array_reader()(str(path))
    except Exception as exc:  # the reader raises ValueError/struct.error/IndexError on damage
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc})") from exc


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def config_from_gguf(reader, name: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (Bullet serves 'llama')")
    a = arch
    heads = _field(reader, f"{a}.attention.head_count")
    hidden = _field(reader, f"{a}.embedding_length")
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = _field(reader, f"{a}.vocab_size") or (len(tokens.data) if tokens else None)
    names = {t.name for t in reader.tensors}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    cfg = {
        "architectures": [architectures.LLAMA],
        "hidden_size": hidden,
        "intermediate_size": _field(reader, f"{a}.feed_forward_length"),
        "num_hidden_layers": _field(reader, f"{a}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _field(reader, f"{a}.attention.head_count_kv", heads),
        "head_dim": _field(reader, f"{a}.rope.dimension_count", hidden // heads),
        "vocab_size": vocab,
        "max_position_embeddings": _field(reader, f"{a}.context_length", 4096),
        "rms_norm_eps": _field(reader, f"{a}.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _field(reader, f"{a}.rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos,
    }
    if None in (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], heads, vocab):
        raise ModelLoadError("GGUF metadata lacks the llama shape fields (block_count, embedding_length, …)")
    scaling = _field(reader, f"{a}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {scaling!r} is not implemented (only Llama-3's rope_freqs)")
    if "rope_freqs.weight" in names:
        cfg["rope_scaling"] = _llama3_scaling(cfg, next(t for t in reader.tensors if t.name == "rope_freqs.weight"))
    return ModelConfig.from_hf_dict(cfg, name=name)


# The llama3 parameters of Llama 3.1-3.3 (3.2 with factor 32): their divisors are 1 for short
# wavelengths, `factor` for long ones, a blend between; the factor is the largest divisor.
_LLAMA3 = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama3_scaling(cfg: dict, tensor) -> dict:
    """The llama3 `rope_scaling` whose divisors are `tensor`'s, or an error naming it."""
    import gguf

    divisors = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32).reshape(-1))
    scaling = {**_LLAMA3, "factor": float(divisors.max())}
    plain, scaled = (inverse_frequencies(ModelConfig.from_hf_dict(c)) for c in (cfg, {**cfg, "rope_scaling": scaling}))
    if divisors.shape != plain.shape or not torch.allclose(plain / scaled, divisors, rtol=1e-4):
        raise ModelLoadError(f"rope_freqs.weight holds RoPE divisors that llama3 scaling {scaling} does not give: "
                             "another rope scaling, not implemented")
    return scaling


def gguf_projections_quantized(path: Path, reader=None) -> bool:
    """True when the attention/MLP matrices are stored quantized (anything but F32/F16/BF16).
    `reader`: the file already open (opening one parses every metadata field, the tokenizer's tens of
    thousands of strings among them: seconds, which a load should pay once)."""
    import gguf

    floats = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}
    reader = reader if reader is not None else open_gguf(path)
    kinds = {t.tensor_type for t in reader.tensors if t.name.endswith(("attn_q.weight", "ffn_down.weight"))}
    return bool(kinds) and not kinds <= floats


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp stores each head's rows as interleaved (even, odd) pairs; HF keeps the two halves apart.
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: Path, dtype: torch.dtype, reader=None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """`reader`: `open_gguf(path)` when the caller has it open already."""
    import gguf

    reader = reader if reader is not None else open_gguf(path)
    config = config_from_gguf(reader, name=path.stem)

    def tensor(name: str, heads: int | None = None) -> torch.Tensor:
        t = by_name.pop(name, None)
        if t is None:
            raise ModelLoadError(f"{path.name}: tensor {name!r} missing")
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as exc:
            raise ModelLoadError(f"{path.name}: cannot dequantize {name} ({t.tensor_type.name}): {exc}") from exc
        if heads is not None:
            arr = _unpermute(arr, heads)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if not arr.flags.writeable:  # F32 tensors come back as views of the read-only file mapping
            arr = arr.copy()
        return torch.from_numpy(arr).to(dtype)

    by_name = {t.name: t for t in reader.tensors}
    by_name.pop("rope_freqs.weight", None)  # used: it is config.rope_scaling (config_from_gguf)
    state = {"embed_tokens.weight": tensor("token_embd.weight"), "norm.weight": tensor("output_norm.weight")}
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = tensor("output.weight")
    for n in range(config.num_hidden_layers):
        b = f"blk.{n}"
        state.update(fuse_layer(
            f"layers.{n}",
            q=tensor(f"{b}.attn_q.weight", config.num_attention_heads),
            k=tensor(f"{b}.attn_k.weight", config.num_key_value_heads),
            v=tensor(f"{b}.attn_v.weight"), o=tensor(f"{b}.attn_output.weight"),
            gate=tensor(f"{b}.ffn_gate.weight"), up=tensor(f"{b}.ffn_up.weight"),
            down=tensor(f"{b}.ffn_down.weight"),
            input_norm=tensor(f"{b}.attn_norm.weight"), post_norm=tensor(f"{b}.ffn_norm.weight"),
        ))
    if by_name:  # every tensor of the file has its place in the model, or the file is another model
        unused = sorted(by_name)
        raise ModelLoadError(f"{path.name}: tensors the llama model does not use: {unused[:5]}"
                             f"{f' and {len(unused) - 5} more' if len(unused) > 5 else ''}")
    try:
        check_shapes(config, state)
    except ValueError as exc:
        raise ModelLoadError(f"{path.name}: {exc}") from exc
    return config, state
