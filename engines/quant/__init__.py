"""How the weights are served: as floats (`none`), as int8 W8A8 (`w8a8_int8`, SGLang's name for
the same scheme) — int8 weights per output channel, int8 activations per token, on a rotated model —
or with the projections in FP8 (`fp8`, `engines.quant.fp8`: an FP8 checkpoint as stored, or a float
source quantized at load).

`auto` serves int8 only where nothing of value is lost: the weights came quantized (a GGUF whose
projections are 4/5/8-bit: the file already traded precision for size, and re-quantizing those to
int8 per channel adds less error than the file's own 4-bit grid) and the CPU runs fbgemm. A float
source (safetensors, F16/F32 GGUF, dummy) stays float. Measured on the Q4_1 SmolLM2 against its
fp32 dequantization (`tests/engines/test_quantized.py`): top-1 agreement >= 0.9 on teacher-forced
text, mean KL < 0.03 nats; bf16 weights and activations on the same text: KL ~0.001."""

from __future__ import annotations

import torch

from engines.model_config import ModelConfig
from engines.quant.int8 import fbgemm_available, quantize_rows, quantize_weight
from engines.quant.rotation import rotate_state

QUANTIZATIONS = ("auto", "none", "w8a8_int8", "fp8")
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
FOLDED_NORMS = (".input_norm.weight", ".post_attn_norm.weight")  # and the final "norm.weight"


def resolve_quantization(name: str | None, device: torch.device, source_quantized: bool,
                         source_fp8: bool = False) -> str:
    """`none`, `w8a8_int8` or `fp8` (the projections in FP8, `engines.quant.fp8`: an FP8 checkpoint's
    as stored, a float source's quantized at load with one scale per row). `auto` keeps an FP8
    checkpoint in FP8 on a CUDA device and dequantizes it on a CPU; a float source stays float.
    Raises ValueError when a form is asked for where it cannot run."""
    name = name or "auto"
    if name not in QUANTIZATIONS:
        raise ValueError(f"unknown quantization {name!r}; choose {', '.join(QUANTIZATIONS)}")
    int8_ok = device.type == "cpu" and fbgemm_available()
    if name == "auto":
        if source_fp8:
            return "fp8" if device.type == "cuda" else "none"
        return "w8a8_int8" if source_quantized and int8_ok else "none"
    if name == "w8a8_int8" and not int8_ok:
        raise ValueError("w8a8_int8 needs a CPU device and torch's fbgemm quantized engine")
    if name == "fp8" and source_quantized:
        raise ValueError("fp8 quantizes a float source (safetensors, an F32/F16/BF16 GGUF, dummy weights) or serves "
                         "an FP8 checkpoint as stored; this GGUF's projections are already quantized (4/5/8-bit), "
                         "and re-quantizing them to FP8 would add error to error: serve it with --quantization auto "
                         "(int8 on a CPU), w8a8_int8 or none")
    return name


def quantize_state(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A float state dict (model naming, fused layout) -> the int8 model's state dict: rotated, then
    every projection as (qweight int8, scale), the embedding as int8 rows; no norm weights (folded)."""
    if config.is_moe:
        raise ValueError(f"w8a8_int8 has no form for {config.architecture}'s mixture-of-experts layers: "
                         "serve it with --quantization none")
    rotated, _ = rotate_state(config, state)
    out: dict[str, torch.Tensor] = {}
    q, s = quantize_rows(rotated.pop("embed_tokens.weight"))
    out["embed_tokens.qweight"], out["embed_tokens.scale"] = q, s
    q, s = quantize_weight(rotated.pop("lm_head.weight"))
    out["lm_head.qweight"], out["lm_head.scale"] = q, s
    for name in list(rotated):
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight" and prefix.rpartition(".")[2] in PROJECTIONS:
            q, s = quantize_weight(rotated.pop(name))
            out[prefix + ".qweight"], out[prefix + ".scale"] = q, s
    for name in [n for n in rotated if n == "norm.weight" or n.endswith(FOLDED_NORMS)]:
        # folded into the next projection by the rotation; the int8 projections apply the norm itself
        if not torch.all(rotated.pop(name) == 1):
            raise AssertionError(f"{name} was not folded")
    out.update(rotated)  # down_proj input rotations, float biases, per-head q/k norms (kept in float)
    return out


def is_int8_state(state: dict[str, torch.Tensor]) -> bool:
    return "lm_head.qweight" in state


def down_block_of(state: dict[str, torch.Tensor]) -> int:
    rot = state.get("layers.0.down_proj.input_rotation")
    return 0 if rot is None else int(rot.shape[0])
