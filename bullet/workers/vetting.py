"""What a worker checks in a well-formed message before it acts on it. The socket layer already
drops what is not a valid message; this drops a valid-looking one that could not have come from
the server's own frontend or peer worker — token ids outside the vocabulary, a prompt longer than
the context, pages the request does not hold — so that no message, however built, reaches the
model or the page allocator with values that fail there (found by the fuzz driver: a forged
handoff naming pages of another owner killed the decode worker)."""

from __future__ import annotations

from dataclasses import dataclass

from bullet.shm.page_allocator import CACHE_OWNER
from bullet.shm.shared_page_allocator import SharedPageAllocator
from bullet.types.messages import AbortRequest, GenerateRequest, Handoff, Recompute, Release


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
            return self._table(msg.uid, msg.page_table, msg.shared_pages) or (
                "its page table is too short for its tokens"
                if len(msg.page_table) * self.page_size < len(msg.prompt_ids) + len(msg.output_ids) - 1 else None)
        if isinstance(msg, Release):
            if msg.token_ids and (min(msg.token_ids) < 0 or max(msg.token_ids) >= self.vocab_size):
                return f"token ids outside [0, {self.vocab_size})"
            if len(msg.token_ids) > len(msg.page_table) * self.page_size:
                return "more tokens than its pages hold"
            return self._table(msg.uid, msg.page_table, msg.shared_pages)
        if isinstance(msg, (GenerateRequest, Recompute)) and self.allocator.pages_of(msg.uid):
            return f"request {msg.uid} already holds pages: its id is in use"
        return None

    def _table(self, uid: int, table: list[int], shared: int) -> str | None:
        """A page table whose first `shared` pages are the prefix cache's and the rest `uid`'s own."""
        if len(set(table)) != len(table) or shared > len(table):
            return "its page table repeats pages or claims more cached pages than it has"
        if shared and not set(table[:shared]) <= set(self.allocator.pages_of(CACHE_OWNER)):
            return "its page table names cached pages the prefix cache does not hold"
        if not set(table[shared:]) <= set(self.allocator.pages_of(uid)):
            return f"its page table names pages request {uid} does not hold"
        return None
