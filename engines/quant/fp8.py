"""FP8 (e4m3) weights, as checkpoints quantized with `quantization_config.quant_method: fp8` store
them: each quantized matrix `X.weight` [N, K] in `torch.float8_e4m3fn` beside a float32
`X.weight_scale_inv`, the factor that multiplies it back (w = fp8 * scale_inv): one per block of
`weight_block_size` [bn, bk] (Qwen3-FP8: [128, 128], the scale tensor [ceil(N/bn), ceil(K/bk)]), or one
for the whole matrix (per-tensor).

On a CPU the loader dequantizes them to the compute dtype (`dequantize`). On a CUDA device they stay
FP8 in an `Fp8Linear`: its scales are kept per output row ([N, ceil(K/bk)], each block's scale
repeated over its bn rows), so q/k/v and gate/up fuse into one matrix whatever their alignment to
the blocks. Its product:

* one scale per row (a per-tensor checkpoint): `torch._scaled_mm` with the activation quantized to
  e4m3 per row on the fly, and the weight's scales per column of the product ("row-wise" scaling);
* scales in 128 x 128 blocks (Qwen3-FP8's), on a Hopper GPU that runs torch's block-scaled recipe:
  one FP8 GEMM with the activation quantized per 1 x 128 group (`engines.quant.fp8_blockwise`);
* other block-wise scales, or that recipe unavailable: the weight is dequantized to the activation's
  dtype for the product (memory stays at a byte per weight; the GEMM runs in bf16).

A float checkpoint served with `--quantization fp8` is quantized at load (`quantize_state`): the same
projections to e4m3 with one scale per output row (the row's largest magnitude maps to 448), so every
one takes the row-wise `torch._scaled_mm` path above.

The CUDA branch is written to torch's documented contract and checked on a CPU (torch's CPU
`_scaled_mm` runs the same call); its speed on a GPU is unmeasured."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engines.model_config import ModelConfig
from engines.quant import fp8_blockwise

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
SCALE_SUFFIX = "_scale_inv"  # X.weight -> X.weight_scale_inv
BLOCK_SUFFIX = "_block"  # X.weight -> X.weight_block: bk, the columns one scale covers (in the state only)
# the projections held in FP8 (nn.Linear modules of a layer, model naming): attention and the dense MLP;
# a sparse layer's experts and router, the embedding and the head stay in the float dtype
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def is_projection_weight(name: str) -> bool:
    """`layers.{i}.{projection}.weight` (model naming) for one of `PROJECTIONS`."""
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "layers" and parts[2] in PROJECTIONS and parts[3] == "weight"


def block_scales(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int] | None) -> torch.Tensor:
    """A checkpoint's scale tensor -> the same scales per row, [N, ceil(K/bk)] float32 (bk = K for a
    per-tensor scale). ValueError if its shape is neither per-tensor nor the blocks of `block`."""
    n, k = shape
    if scale.numel() == 1:
        return scale.float().reshape(1, 1).expand(n, 1).contiguous()
    if block is None:
        raise ValueError(f"scale of shape {tuple(scale.shape)} for a [{n}, {k}] matrix, but the config gives "
                         "no weight_block_size (a per-tensor scale has one element)")
    bn, bk = block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale of shape {tuple(scale.shape)} for a [{n}, {k}] matrix in blocks of {list(block)}: "
                         f"expected {want}")
    return scale.float().repeat_interleave(bn, dim=0)[:n].contiguous()


def columns_per_scale(scale_rows: torch.Tensor, k: int, block: tuple[int, int] | None) -> int:
    """bk of a row-scale tensor from `block_scales`."""
    return k if scale_rows.shape[1] == 1 else block[1]


def dequantize_rows(weight: torch.Tensor, scale_rows: torch.Tensor, bk: int, dtype: torch.dtype) -> torch.Tensor:
    """fp8 [N, K] times its row scales [N, ceil(K/bk)] -> [N, K] in `dtype` (the product in float32)."""
    k = weight.shape[1]
    scales = scale_rows if scale_rows.shape[1] == 1 else scale_rows.repeat_interleave(bk, dim=1)[:, :k]
    return (weight.float() * scales).to(dtype)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype) -> torch.Tensor:
    """A checkpoint's fp8 matrix and its scale tensor -> the matrix in `dtype`."""
    rows = block_scales(scale, tuple(weight.shape), block)
    return dequantize_rows(weight, rows, columns_per_scale(rows, weight.shape[1], block), dtype)


def quantize_rows_dynamic(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 [M, 1]) with x ~ q * scale, one scale per row."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float matrix w [N, K] -> (e4m3 [N, K], float32 scales [N, 1]) with w ~ q * scale: each row's
    largest magnitude maps to e4m3's largest value (scale = amax / 448), rounded to nearest in float32.
    A row of zeros gets scale 1 (its e4m3 values are zeros). ValueError for a non-finite weight: its
    scale would carry the inf or NaN into every value of the row."""
    if w.dim() != 2 or not w.dtype.is_floating_point:
        raise ValueError(f"expected a float matrix, got {w.dtype} of shape {tuple(w.shape)}")
    wf = w.float()
    amax = wf.abs().amax(dim=1, keepdim=True)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("the weight holds inf or NaN: it has no FP8 scale")
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    # amax / scale may round a hair above 448, which e4m3fn (no infinity) would turn into NaN
    return (wf / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_state(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A float state dict (model naming, fused layout: `engines.weights`) -> the same state with each
    layer's attention and dense-MLP projections (`PROJECTIONS`) in FP8, the layout `build_model` turns
    into `Fp8Linear`s:

    * `layers.{i}.{p}.weight`: torch.float8_e4m3fn [N, K]
    * `layers.{i}.{p}.weight_scale_inv`: float32 [N, 1] (w ~ weight * scale, one scale per output row)
    * `layers.{i}.{p}.weight_block`: int64 scalar K (one scale covers the whole row)

    Every other tensor (embedding, head, norms, biases, a sparse layer's router and experts) is the
    input's own, and a projection already in FP8 (an FP8 checkpoint's) is kept as it is. The input is
    not modified; the output holds none of its float projections, so dropping the input frees them.
    Tensors stay on their device. Fused matrices (q/k/v, gate/up) quantize per row, so fusing before or
    after quantizing gives the same state. `config` names the model in errors."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if not is_projection_weight(name) or name + SCALE_SUFFIX in state:
            out[name] = t
            continue
        try:
            q, scale = quantize_weight(t)
        except ValueError as exc:
            raise ValueError(f"{config.name}: {name}: {exc}") from exc
        out[name], out[name + SCALE_SUFFIX] = q, scale
        out[name + BLOCK_SUFFIX] = torch.tensor(t.shape[1], dtype=torch.int64, device=t.device)
    return out


class Fp8Linear(nn.Module):
    """y = x @ (weight * scales)^T (+ bias): weight e4m3 [N, K], `weight_scale_inv` [N, ceil(K/bk)]
    float32, `weight_block` the int bk (a buffer, so the state says it)."""

    def __init__(self, in_features: int, out_features: int, bk: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8))
        self.register_buffer("weight_scale_inv", torch.empty(out_features, -(-in_features // bk), dtype=torch.float32))
        self.register_buffer("weight_block", torch.tensor(bk, dtype=torch.int64))
        self.register_buffer("bias", torch.empty(out_features) if bias else None)
        self.bk = bk
        self.block_scales: torch.Tensor | None = None  # B's scales for the block-scaled GEMM (`prepare`)

    @property
    def rowwise(self) -> bool:
        return self.weight_scale_inv.shape[1] == 1

    def prepare(self) -> None:
        """Once the weight is on its device (`build_model`): where it is in 128 x 128 blocks and the
        device runs the block-scaled FP8 GEMM (`fp8_blockwise.works_on`), keep its scales in that
        GEMM's layout, so each product is one FP8 GEMM instead of a dequantized weight's bf16 GEMM."""
        if self.rowwise or not fp8_blockwise.works_on(self.weight.device):
            return
        self.block_scales = fp8_blockwise.weight_scales(self.weight_scale_inv, self.out_features, self.in_features,
                                                        self.bk)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.rowwise and scaled_mm_fits(x2, self.weight):
            xq, sx = quantize_rows_dynamic(x2)
            y = torch._scaled_mm(xq, self.weight.t(), scale_a=sx, scale_b=self.weight_scale_inv.view(1, -1),
                                 out_dtype=x.dtype)
            y = y if self.bias is None else y + self.bias
        elif self.block_scales is not None and x2.dtype == torch.bfloat16:
            y = fp8_blockwise.product(x2, self.weight, self.block_scales, x.dtype)
            y = y if self.bias is None else y + self.bias
        else:
            y = F.linear(x2, dequantize_rows(self.weight, self.weight_scale_inv, self.bk, x.dtype), self.bias)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        scales = "per row" if self.rowwise else f"per row and {self.bk} columns"
        scales += ", block-scaled GEMM" if self.block_scales is not None else ""
        return f"in={self.in_features}, out={self.out_features}, fp8 e4m3, scales {scales}"


def scaled_mm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._scaled_mm's shape rules: K and N multiples of 16, 16-bit or float32 activations; row-wise
    scales need a bf16 result on CUDA."""
    k, n = weight.shape[1], weight.shape[0]
    if k % 16 or n % 16 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return x.dtype == torch.bfloat16 if x.is_cuda else True


def is_fp8_state(state: dict[str, torch.Tensor]) -> bool:
    return any(name.endswith(SCALE_SUFFIX) for name in state)


def use_fp8_linears(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Replace each projection whose weight the state holds in FP8 by an `Fp8Linear` (on the meta
    device, before the state is assigned)."""
    for name in [n for n in state if n.endswith(".weight" + SCALE_SUFFIX)]:
        prefix = name[: -len(".weight" + SCALE_SUFFIX)]
        parent_name, _, child = prefix.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        if not isinstance(old, nn.Linear):
            raise ValueError(f"{name}: FP8 scales for {type(old).__name__} {prefix}, which is no projection")
        bk = int(state[prefix + ".weight" + BLOCK_SUFFIX])
        with torch.device("meta"):
            setattr(parent, child, Fp8Linear(old.in_features, old.out_features, bk, old.bias is not None))


def fp8_extras(state: dict[str, torch.Tensor]) -> set[str]:
    """The state's FP8 scale and block entries (beside the float model's tensors)."""
    return {n for n in state if n.endswith(SCALE_SUFFIX) or n.endswith(".weight" + BLOCK_SUFFIX)}
