"""The served model's real steps, as the profiler times them: a packed prefill (whole model, or K
layers as the layer-wise prefill scheduler runs them) and one decode step, through the same
`ModelRunner` the workers use (on a share the caller applies: `shares`).

Every sequence gets its own KV pages, as in serving: decode attention then reads distinct memory
for every request instead of one cached copy. Token ids are arbitrary (latency does not depend on
them); the KV contents are whatever earlier steps left, which attention does not care about either."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engines.kv_pool import KVPool
from engines.model.build import build_model
from engines.model_config import ModelConfig
from engines.runner import ModelRunner, SeqChunk

PAGE_SIZE = 16


@dataclass(frozen=True)
class PrefillCase:
    """A packed prefill of `seq_lens`, `num_layers` layers (None = all, with embedding and head)."""

    seq_lens: tuple[int, ...]
    num_layers: int | None = None

    @property
    def tokens(self) -> int:
        return sum(self.seq_lens)

    def label(self) -> str:
        lens = "+".join(map(str, self.seq_lens))
        return f"prefill[{lens}]" + (f" x{self.num_layers}L" if self.num_layers else "")


@dataclass(frozen=True)
class DecodeCase:
    """One decode step of len(context_lens) requests; each context counts the token being decoded."""

    context_lens: tuple[int, ...]

    @property
    def batch(self) -> int:
        return len(self.context_lens)

    @property
    def total_context(self) -> int:
        return sum(self.context_lens)

    def label(self) -> str:
        lens = set(self.context_lens)
        ctx = str(self.context_lens[0]) if len(lens) == 1 else f"{min(lens)}..{max(lens)}"
        return f"decode[{self.batch}x{ctx}]"


def uniform_decode(batch: int, context: int) -> DecodeCase:
    return DecodeCase((context,) * batch)


@dataclass(frozen=True)
class HybridCase:
    """One step of fresh prompt chunks `chunk_lens` beside `decode` (one token per request), as a
    chunked-prefill engine runs them: every linear kernel over all rows, attention for each part."""

    chunk_lens: tuple[int, ...]
    decode: DecodeCase

    @property
    def tokens(self) -> int:
        return sum(self.chunk_lens) + self.decode.batch

    def label(self) -> str:
        return f"hybrid[{'+'.join(map(str, self.chunk_lens))} + {self.decode.label()}]"


def kv_tokens_needed(cases: Sequence[PrefillCase | DecodeCase]) -> int:
    """KV slots the largest case needs (pages rounded up per sequence)."""
    def need(case) -> int:
        if isinstance(case, HybridCase):
            lens = case.chunk_lens + case.decode.context_lens
        else:
            lens = case.seq_lens if isinstance(case, PrefillCase) else case.context_lens
        return sum(-(-n // PAGE_SIZE) * PAGE_SIZE for n in lens)
    return max((need(c) for c in cases), default=PAGE_SIZE)


def require_dense_layers(config: ModelConfig) -> None:
    """The kernel sweeps time a layer stage by stage as the dense decoder runs them; a
    mixture-of-experts layer has other stages (router, grouped experts), which they do not time."""
    if config.is_moe:
        raise ValueError(f"{config.name}: the kernel sweep times the stages of dense layers; "
                         f"{config.architecture}'s mixture-of-experts layers are not swept (the estimator prices "
                         "them from their active experts, without a kernel calibration)")


class ModelBench:
    """The model and a private KV pool, ready to run prefill and decode steps of given shapes."""

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], kv_tokens: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.config = config
        self.model = build_model(config, state, device)
        pages = -(-kv_tokens // PAGE_SIZE)
        kv = KVPool(config, pages, PAGE_SIZE, dtype, device)
        # torch.zeros maps untouched memory to the kernel's shared zero page: decode attention
        # gathering from never-written slots then reads one cached 4 KB page instead of memory
        # (measured here: a 16 x 512 decode step 2.3x faster). In serving every slot read was
        # written by a prefill, so write them all once.
        kv.tensor.fill_(0.01)
        self.runner = ModelRunner(self.model, kv, device)
        self.num_pages = pages

    def _chunks(self, lens: Sequence[int], decode: bool, first_page: int = 0) -> list[SeqChunk]:
        chunks, next_page = [], first_page
        for n in lens:
            pages = -(-n // PAGE_SIZE)
            if next_page + pages > self.num_pages:
                raise ValueError(f"KV pool of {self.num_pages} pages too small for {list(lens)}")
            table = list(range(next_page, next_page + pages))
            next_page += pages
            if decode:
                chunks.append(SeqChunk([11 % self.config.vocab_size], n - 1, table))
            else:
                vocab = self.config.vocab_size
                chunks.append(SeqChunk([(7 * i + 3) % (vocab - 1) + 1 for i in range(n)], 0, table))
        return chunks

    def chunks(self, case: PrefillCase | DecodeCase | HybridCase) -> list[SeqChunk]:
        if isinstance(case, HybridCase):  # the prompts' pages first, the decode rows' after them
            prompts = self._chunks(case.chunk_lens, decode=False)
            used = sum(len(c.page_table) for c in prompts)
            return prompts + self._chunks(case.decode.context_lens, decode=True, first_page=used)
        if isinstance(case, DecodeCase):
            return self._chunks(case.context_lens, decode=True)
        return self._chunks(case.seq_lens, decode=False)

    def step(self, case: PrefillCase | DecodeCase):
        """A zero-argument callable running `case` once (inputs prepared outside the timed call,
        except what a worker also prepares per step: the runner's context tables)."""
        chunks = self.chunks(case)
        if isinstance(case, (DecodeCase, HybridCase)) or case.num_layers is None:
            return lambda: self.runner.forward(chunks)
        return self._layer_step(chunks, case.num_layers)

    def _layer_step(self, chunks: list[SeqChunk], num_layers: int):
        """K layers from the first, as one step of a layer-wise prefill: embedding and context are
        built once outside (the first step of a real prefill pays them, the others do not)."""
        state = self.runner.start(chunks)
        hidden0 = state.hidden

        def run() -> None:
            state.hidden, state.next_layer = hidden0, 0
            self.runner.run_layers(state, num_layers)

        return run
