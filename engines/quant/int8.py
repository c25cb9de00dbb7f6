"""Int8 weights served as int8: per-output-channel int8 weights, activations quantized to 8 bits per
token, the product computed by fbgemm's u8 x s8 GEMM (`quantized::linear_dynamic`, the x86 int8
path torch's CPU build ships). On an AVX2 machine this is the fastest matmul torch offers at every
batch size we measured (decode GEMV: 2-3.5x fp32, prefill GEMM: ~1.7x fp32) because it reads a
quarter of fp32's bytes and multiplies 32 int8 pairs per instruction.

Three details make it accurate and batch-invariant:

* **Per-token activation scale.** fbgemm quantizes a whole input with one (scale, zero point) from
  its min and max. Each row is divided by its own max |x| first (and the output multiplied back),
  and two constant columns +1 / -1 (with zero weights) pin the range to exactly [-1, 1]: every row
  then gets the same quantization whatever else is in the batch, so a sequence's logits are
  bit-identical alone or batched (the int32 accumulation is exact).
* **No int16 saturation.** On AVX2 fbgemm multiplies adjacent pairs of (u8 activation, s8 weight)
  with `vpmaddubsw`, which saturates at 32767. With u8 activations up to 255, a pair is safe when
  |w[2i]| + |w[2i+1]| <= 128, so the per-channel scale is chosen for that (about 7.6 bits of weight
  resolution instead of the 7 that torch's default `reduce_range` leaves the activations).
* **An optional block rotation of the input** (`input_rotation`, see `engines.quant.rotation`),
  for the one projection whose input cannot be rotated offline (down_proj, after the SwiGLU).

A projection that reads an RMSNorm's output (qkv, gate/up, the head; their norm weights are folded
into them by the rotation) takes the norm over (`norm_eps`): RMSNorm scales a row by a constant,
which the per-token scaling divides out again, so the norm costs only its row factor
rsqrt(mean(x^2) + eps), applied to the output — not a pass over the activation.

The int8 weights and scales are plain tensors (shareable between processes like any weight); the
fbgemm packed copy is built per process by `pack()` — torch has no packed format that can live in
shared memory — so each worker holds its own packed copy of the int8 GEMM weights."""

from __future__ import annotations

import warnings

import torch
from torch import nn

PAIR_LIMIT = 128  # 255 * 128 = 32640 <= 32767: no vpmaddubsw pair can saturate
INT8_MAX = 127


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def quantize_weight(w: torch.Tensor, rows_per_block: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel with every adjacent (even, odd) pair of a row summing to at
    most PAIR_LIMIT in magnitude. Returns (int8 [N, K], float32 scale [N]) with w ~= q * scale[:, None].
    Works through blocks of rows that stay in cache (a whole LM head is ~100 MB of floats)."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8)
    scale = torch.empty(n)
    for r in range(0, n, rows_per_block):
        q[r : r + rows_per_block], scale[r : r + rows_per_block] = _quantize_rows_paired(w[r : r + rows_per_block].float())
    return q, scale


def _pair_sums(x: torch.Tensor) -> torch.Tensor:
    """max over i of |x[:, 2i]| + |x[:, 2i+1]|, per row."""
    x = x.abs()
    if x.shape[1] % 2:
        x = nn.functional.pad(x, (0, 1))
    return (x[:, 0::2] + x[:, 1::2]).amax(1)


def _quantize_rows_paired(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # each value must fit int8 too: a row whose largest pair is one value beside a near-zero one would
    # otherwise round that value to 128, which int8 stores as -128 (its sign flipped)
    scale = torch.maximum(_pair_sums(w) / PAIR_LIMIT, w.abs().amax(1) / INT8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    for _ in range(8):  # rounding can push a pair one step over the limit: widen those rows slightly
        q = torch.round(w / scale[:, None])
        over = (_pair_sums(q) > PAIR_LIMIT) | (q.abs().amax(1) > INT8_MAX)
        if not over.any():
            return q.to(torch.int8), scale
        scale = torch.where(over, scale * (1 + 1 / PAIR_LIMIT), scale)
    raise RuntimeError("int8 weight quantization did not converge")


class Int8Linear(nn.Module):
    """y = x @ (qweight * scale[:, None])^T (+ bias), x float32 [M, K] -> y float32 [M, N]. `block` > 0:
    x is first rotated in blocks of `block` columns by `input_rotation` [block, block]. `norm_eps`: x
    is first RMS-normalized (unit weight) with this epsilon. `bias`: a float32 `bias` [N] is added
    after the GEMM and its scaling, unquantized (Qwen2's q/k/v biases are large next to the products)."""

    def __init__(self, in_features: int, out_features: int, block: int = 0, norm_eps: float | None = None,
                 bias: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.block, self.norm_eps = in_features, out_features, block, norm_eps
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(out_features, dtype=torch.float32))
        self.register_buffer("bias", torch.empty(out_features, dtype=torch.float32) if bias else None)
        if block:
            self.register_buffer("input_rotation", torch.empty(block, block, dtype=torch.float32))
        self._packed = None
        self._bounds = None

    def pack(self) -> None:
        """Build fbgemm's packed weight (a private copy) from the int8 buffers."""
        n = self.out_features
        q = torch.cat([self.qweight, torch.zeros(n, 2, dtype=torch.int8)], dim=1)  # the range columns
        with warnings.catch_warnings():  # torch 2.13 flags quantized tensors as deprecated: the op is what we want
            warnings.simplefilter("ignore", UserWarning)
            qt = torch._make_per_channel_quantized_tensor(q, self.scale.double(), torch.zeros(n, dtype=torch.long), 0)
            self._packed = torch.ops.quantized.linear_prepack(qt, None)
        self._bounds = torch.tensor([[1.0, -1.0]])
        self._eps = torch.tensor([self.norm_eps or 0.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is None:
            self.pack()
        shape = x.shape
        x = x.reshape(-1, self.in_features).float()
        if self.block:
            x = torch.matmul(x.view(-1, self.in_features // self.block, self.block), self.input_rotation)
            x = x.view(-1, self.in_features)
        amax = x.abs().amax(-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
        xn = torch.cat([x / amax, self._bounds.expand(x.shape[0], 2)], dim=1)
        if self.norm_eps is not None:  # RMSNorm's row factor: amax * rsqrt(sum(x^2) / K + eps)
            norm = torch.linalg.vector_norm(x, 2, dim=-1, keepdim=True)
            amax = amax.mul_(torch.addcmul(self._eps, norm, norm, value=1 / self.in_features).rsqrt_())
        y = torch.ops.quantized.linear_dynamic(xn, self._packed, False).mul_(amax)
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.view(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        norm = f", rms_norm(eps={self.norm_eps})" if self.norm_eps is not None else ""
        bias = ", bias" if self.bias is not None else ""
        return f"in={self.in_features}, out={self.out_features}, block={self.block}{norm}{bias}, int8 (fbgemm)"


class Int8Embedding(nn.Module):
    """Token embedding stored as int8 rows with one scale per row: a lookup reads a few rows, so the
    table need not exist in float."""

    def __init__(self, num_embeddings: int, dim: int):
        super().__init__()
        self.register_buffer("qweight", torch.empty(num_embeddings, dim, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(num_embeddings, dtype=torch.float32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight[ids].float() * self.scale[ids].unsqueeze(-1)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain symmetric int8 per row (for lookups, where no GEMM pairs need a limit)."""
    w = w.float()
    scale = w.abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale
