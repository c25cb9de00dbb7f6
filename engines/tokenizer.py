"""Tokenizer and chat template, from GGUF metadata or a Hugging Face tokenizer directory.

A GGUF tokenizer is converted once with transformers (slow: seconds) and cached as an ordinary HF
tokenizer directory; later loads and clients such as `sglang.bench_serving`, which need a
tokenizer directory, use that export."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

from engines.cache_root import cache_dir
from engines.weights.errors import ModelLoadError

log = logging.getLogger("engines.tokenizer")


class Tokenizer:
    def __init__(self, hf, source_dir: Path):
        self.hf = hf
        self.source_dir = source_dir  # an HF tokenizer directory equivalent to this tokenizer
        self.vocab_size = len(hf)
        eos = {hf.eos_token_id} if hf.eos_token_id is not None else set()
        self.eos_token_ids: set[int] = eos
        self._token_bytes: list[bytes] | None = None
        self._table_lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_text(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's exact bytes. A byte-level BPE or byte-fallback token may hold part of a UTF-8
        character, which `id_to_text` shows as U+FFFD; clients that put a text back together from
        log-probabilities need the bytes themselves. The table comes from xgrammar's reading of the
        vocabulary (byte-level, byte-fallback or raw), built on first use (`token_bytes_table`)."""
        table = self.token_bytes_table()
        return table[token_id] if 0 <= token_id < len(table) else self.id_to_text(token_id).encode()

    def token_bytes_table(self) -> list[bytes]:
        """Every token's bytes, by id (built once: ~0.1 s after xgrammar's import; callers on an event
        loop build it in a thread first)."""
        with self._table_lock:
            if self._token_bytes is None:
                try:
                    from engines.grammar import tokenizer_info  # deferred: xgrammar, paid on first use only

                    info = tokenizer_info(self.hf, self.vocab_size, ())
                    self._token_bytes = [bytes(b) for b in info.decoded_vocab]
                except Exception as exc:  # a vocabulary xgrammar cannot read: each token's decoded text
                    log.warning("token bytes from the decoded text (xgrammar could not read the vocabulary: %s)",
                                exc)
                    self._token_bytes = []
            return self._token_bytes

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        if not self.has_chat_template:
            raise ValueError("this model has no chat template; use /generate or /v1/completions")
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           **({"tools": tools} if tools else {}))

    def set_chat_template(self, text: str) -> None:
        """Replace the model's chat template (`--chat-template`)."""
        self.hf.chat_template = text
        self._renders_tools = None

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template shows the model the tools it is given. Many templates ignore a
        `tools` argument without a word (SmolLM2's does): rendering a probe tool and looking for its
        name tells them apart, once per template."""
        if getattr(self, "_renders_tools", None) is None:
            probe = {"type": "function", "function": {"name": "bullet_probe_tool_x7", "description": "probe",
                                                      "parameters": {"type": "object", "properties": {}}}}
            try:
                text = self.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe])
            except Exception:
                text = ""
            self._renders_tools = "bullet_probe_tool_x7" in text
        return self._renders_tools

    def export(self, directory: str | Path) -> Path:
        directory = Path(directory)
        self.hf.save_pretrained(str(directory))
        return directory


def _load_hf(directory: Path, **kw):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory), **kw)


def gguf_tokenizer_dir(gguf_path: Path) -> Path:
    """The cached HF export of a GGUF file's tokenizer, created on first use."""
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir() / "tokenizers" / f"{gguf_path.stem}-{key}"
    if (target / "tokenizer.json").exists():
        return target
    from engines.weights.gguf_loader import plain_array_reader_installed  # deferred: it imports torch

    try:
        with plain_array_reader_installed():  # transformers parses the file with gguf's reader class: this one
            hf = _load_hf(gguf_path.parent, gguf_file=gguf_path.name)
    except Exception as exc:
        raise ModelLoadError(f"{gguf_path}: cannot read the tokenizer from GGUF metadata ({exc})") from exc
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    hf.save_pretrained(str(tmp))
    try:
        os.replace(tmp, target)  # atomic: concurrent first loads don't see a half-written export
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


def load_tokenizer(source: Path | None, load_format: str, tokenizer_path: str | None = None) -> Tokenizer:
    """`tokenizer_path` overrides; else the GGUF's own tokenizer, or the HF model directory's."""
    if tokenizer_path:
        directory = Path(tokenizer_path)
    elif source is not None and load_format == "gguf":
        directory = gguf_tokenizer_dir(source)
    elif source is not None and source.is_dir():
        directory = source
    else:
        raise ModelLoadError("no tokenizer: pass --tokenizer-path (dummy weights carry none)")
    try:
        return Tokenizer(_load_hf(directory), directory)
    except Exception as exc:
        raise ModelLoadError(f"cannot load a tokenizer from {directory} ({exc})") from exc


class DecodeTokenizer:
    """Decoding only, straight from `tokenizer.json` with the `tokenizers` library: all a worker needs
    to spot stop strings, without importing transformers (~50 MB of memory in every worker)."""

    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer as FastTokenizer

        path = Path(directory) / "tokenizer.json"
        try:
            self._tk = FastTokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelLoadError(f"cannot load {path} ({exc})") from exc
        self.vocab_size = self._tk.get_vocab_size(with_added_tokens=True)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tk.decode(ids, skip_special_tokens=skip_special_tokens)
