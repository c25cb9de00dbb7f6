"""What a worker checks in a well-formed message before it acts on it. The socket layer already
drops what is not a valid message; this drops a valid-looking one that could not have come from
the server's own frontend or peer worker — token ids outside the vocabulary, a prompt longer than
the context, pages the request does not hold — so that no message, however built, reaches the
model or the page allocator with values that fail there (found by the fuzz driver: a forged
handoff naming pages of another owner killed the decode worker)."""

from __future__ import annotations

from dataclasses import dataclass

from bullet.core.messages import AbortRequest, GenerateRequest, Handoff, Recompute
from bullet.shm.shared_page_allocator import SharedPageAllocator


@dataclass
class MessageVetter:
    vocab_size: int
    max_context: int
    allocator: SharedPageAllocator
    page_size: int

    def __call__(self, msg) -> str | None:
        """Why `msg` must be dropped, or None when it may be acted on."""
        if isinstance(msg, AbortRequest):
            return None  # naming an unknown uid is harmless: nothing matches it
        if isinstance(msg, (GenerateRequest, Handoff, Recompute)):
            prompt = msg.input_ids if isinstance(msg, GenerateRequest) else msg.prompt_ids
            ids = prompt + getattr(msg, "output_ids", [])
            if not prompt or len(ids) >= self.max_context:
                return f"{len(ids)} tokens: outside 1..{self.max_context - 1}"
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                return f"token ids outside [0, {self.vocab_size})"
            if len(prompt) + msg.params.max_new_tokens > self.max_context:  # as the frontend checks
                return "prompt and max_new_tokens exceed the context length"
        if isinstance(msg, Handoff):
            return self._pages(msg)
        if isinstance(msg, (GenerateRequest, Recompute)) and self.allocator.pages_of(msg.uid):
            return f"request {msg.uid} already holds pages: its id is in use"
        return None

    def _pages(self, msg: Handoff) -> str | None:
        table, held = msg.page_table, set(self.allocator.pages_of(msg.uid))
        if len(set(table)) != len(table) or not set(table) <= held:
            return f"its page table names pages request {msg.uid} does not hold"
        if len(table) * self.page_size < len(msg.prompt_ids) + len(msg.output_ids) - 1:
            return "its page table is too short for its tokens"
        return None
