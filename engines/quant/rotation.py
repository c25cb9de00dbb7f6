"""An exact, data-free rewrite of a Llama state dict that makes its activations easy to quantize
(QuaRot / SpinQuant's computational invariance): rotations spread the few large "outlier" channels
of every activation over all channels, so one int8 scale per token fits them all.

In real arithmetic the rotated model computes the same logits (checked in the tests to ~1e-4):

* **Residual stream**, rotated by a random orthogonal Q (hidden x hidden), structured as a Kronecker
  product A (x) H of a small random orthogonal A and a randomized Hadamard H, so rotating a matrix
  costs hidden x (a + b) per row instead of hidden^2 (8x less for SmolLM2's 576 = 9 x 64; the load
  of a quantized model is dominated by it otherwise). RMSNorm commutes with
  an orthogonal map once its weight is folded into the matrices that read the normed activation
  (||xQ|| = ||x||), so: embedding rows E -> E Q; matrices reading the residual (qkv, gate/up, head)
  W -> W diag(g) Q; matrices writing it (o, down) W -> Q^T W; every norm weight becomes 1.
* **Attention values / o_proj input**: each head's V rows rotated by R (head_dim x head_dim,
  randomized Hadamard) and o_proj's matching columns by R. Attention mixes value vectors linearly,
  so the rotation passes through it.
* **down_proj input** (after the SwiGLU, not linear): rotated online in blocks of `block` columns
  by a randomized Hadamard H; down_proj's columns carry H so the product is unchanged. The block
  is small (64: a 64-wide matmul per token, ~7% of down_proj's work).

Q and K are unchanged by all of this, so what reads them stays as it is: q/k biases and Qwen3's
per-head q/k norms pass through; a v bias is rotated with its head (v_head R). A tensor this rewrite
does not know is an error, not dropped.

The embedding and the LM head, tied in the source, are separate afterwards (the head carries the
final norm's weight). The rotations are built in float64 and applied in float32 (their rounding,
~1e-7 relative, is far below int8's)."""

from __future__ import annotations

import math

import torch

from engines.model_config import ModelConfig

SEED = 0  # fixed: two loads of a model give the same rotated weights (and the same outputs)


def random_hadamard(n: int, gen: torch.Generator) -> torch.Tensor:
    """An n x n orthogonal matrix: a normalized Hadamard matrix (n a power of two) with random column
    signs, or a random orthogonal matrix otherwise."""
    if n & (n - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        signs = torch.where(torch.rand(n, generator=gen, dtype=torch.float64) < 0.5, -1.0, 1.0)
        return h * signs / math.sqrt(n)
    return random_orthogonal(n, gen)


def random_orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).contiguous()  # Haar-distributed, not biased by QR's sign convention


class KroneckerRotation:
    """Q = A (x) B, A [a, a] random orthogonal, B [b, b] randomized Hadamard, n = a * b."""

    def __init__(self, n: int, gen: torch.Generator, largest_block: int = 256):
        b = 1
        while n % (2 * b) == 0 and 2 * b <= largest_block:
            b *= 2
        self.a = random_orthogonal(n // b, gen).float()
        self.b = random_hadamard(b, gen).float()

    def matrix(self) -> torch.Tensor:
        return torch.kron(self.a, self.b)

    def columns(self, w: torch.Tensor) -> torch.Tensor:
        """w @ Q for w [m, n]: each row, seen as an [a, b] matrix X, becomes A^T X B."""
        m = w.shape[0]
        x = w.reshape(m, self.a.shape[0], self.b.shape[0]) @ self.b
        return torch.matmul(self.a.T, x).reshape(m, -1)

    def rows(self, w: torch.Tensor) -> torch.Tensor:
        """Q^T @ w for w [n, m]."""
        return self.columns(w.T.contiguous()).T.contiguous()


def down_block(intermediate: int, largest: int = 64) -> int:
    """The largest power-of-two block <= `largest` dividing the MLP width (0: no online rotation)."""
    b = largest
    while b >= 8:
        if intermediate % b == 0:
            return b
        b //= 2
    return 0


def rotate_state(config: ModelConfig, state: dict[str, torch.Tensor], seed: int = SEED) -> tuple[dict[str, torch.Tensor], int]:
    """Returns (rotated state dict in model naming with an untied `lm_head.weight` and, per layer,
    `layers.{i}.down_proj.input_rotation` when block > 0; the down_proj block size)."""
    gen = torch.Generator().manual_seed(seed)
    h, d, qs, kvs = config.hidden_size, config.head_dim, config.q_size, config.kv_size
    block = down_block(config.intermediate_size)
    rq = KroneckerRotation(h, gen)
    rv = random_hadamard(d, gen).float()
    rd = random_hadamard(block, gen).float() if block else None

    read: set[str] = set()

    def f32(name: str) -> torch.Tensor:
        read.add(name)
        return state[name].float()

    embed = f32("embed_tokens.weight")
    head = embed if config.tie_word_embeddings else f32("lm_head.weight")
    ones = torch.ones(h)
    out = {
        "embed_tokens.weight": rq.columns(embed),
        "lm_head.weight": rq.columns(head * f32("norm.weight")),
        "norm.weight": ones,
    }
    for n in range(config.num_hidden_layers):
        p = f"layers.{n}."
        qkv = rq.columns(f32(p + "qkv_proj.weight") * f32(p + "input_norm.weight"))
        v = qkv[qs + kvs:].reshape(-1, d, h)
        qkv = torch.cat([qkv[: qs + kvs], (rv.T @ v).reshape(-1, h)])  # v_head -> v_head R
        o = f32(p + "o_proj.weight").reshape(h, -1, d) @ rv  # o_proj reads v_head R: columns carry R
        down = f32(p + "down_proj.weight")
        if rd is not None:
            down = (down.reshape(h, -1, block) @ rd).reshape(h, -1)
            out[p + "down_proj.input_rotation"] = rd
        if p + "qkv_proj.bias" in state:
            b = f32(p + "qkv_proj.bias")
            out[p + "qkv_proj.bias"] = torch.cat([b[: qs + kvs], (b[qs + kvs:].view(-1, d) @ rv).reshape(-1)])
        for norm in ("q_norm.weight", "k_norm.weight"):  # on q and k heads, which no rotation changed
            if p + norm in state:
                out[p + norm] = f32(p + norm)
        out.update({
            p + "input_norm.weight": ones,
            p + "post_attn_norm.weight": ones,
            p + "qkv_proj.weight": qkv,
            p + "o_proj.weight": rq.rows(o.reshape(h, qs)),
            p + "gate_up_proj.weight": rq.columns(f32(p + "gate_up_proj.weight") * f32(p + "post_attn_norm.weight")),
            p + "down_proj.weight": rq.rows(down),
        })
    unknown = sorted(set(state) - read)
    if unknown:
        raise ValueError(f"the int8 rotation does not handle {unknown[:5]}: this model has no int8 form yet")
    return {k: v.contiguous() for k, v in out.items()}, block
