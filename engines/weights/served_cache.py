"""A disk cache of the served state derived from a GGUF file: the dequantized floats, the rotated
int8 model built from them, or their projections quantized to FP8.

Deriving it costs seconds every start (measured on 2 EPYC cores for the default SmolLM2 Q4_1: parsing
the GGUF's metadata 3.4 s, dequantizing 2 s, rotating and quantizing to int8 3.2 s); reading it back
from a safetensors file costs a fraction of a second. An entry is keyed by the source file (path,
size, modification time), the precision served (decided from the flags and whether the file's
projections are quantized — remembered per file, since finding out parses its metadata), the device
type, torch's version and the text of the code that derives it (the GGUF loader and the quantizer),
so an edit to any of them, a new torch or a replaced file never serves a stale state. Safetensors
holds plain tensors and a JSON header: nothing is unpickled. A file that cannot be read is logged,
removed and derived again.

Only small models are cached (`MAX_ENTRY_BYTES`: for a large GGUF the derivation is a small part of a
start, and a float copy of it would fill the disk), and the most recently used entries are kept up to
`MAX_TOTAL_BYTES` in all. `BULLET_WEIGHTS_CACHE=0` turns the cache off; entries live under
`$BULLET_CACHE_DIR/weights` (default `~/.cache/bullet/weights`)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch

from engines.cache_root import cache_dir
from engines.model_config import ModelConfig

log = logging.getLogger(__name__)

MAX_ENTRY_BYTES = 1 << 30
MAX_TOTAL_BYTES = 2 << 30
FORMAT = 1  # bump when the entry layout changes
_DERIVING_CODE = ("weights/gguf_loader.py", "weights/layout.py", "quant/__init__.py", "quant/int8.py",
                  "quant/fp8.py", "quant/rotation.py", "weights/served_cache.py")


def enabled() -> bool:
    return os.environ.get("BULLET_WEIGHTS_CACHE", "1").strip().lower() not in ("0", "off", "false", "no")


def _code_fingerprint() -> str:
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256(torch.__version__.encode())
    for rel in _DERIVING_CODE:
        h.update(rel.encode())
        h.update((root / rel).read_bytes())
    return h.hexdigest()


def _file_identity(source: Path) -> dict:
    st = source.stat()
    return {"source": str(source.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def entry_path(source: Path, served: dict[str, str]) -> Path:
    """Where the state served from `source` as `served` (the precision decided and where it runs:
    every input of the derivation besides the file and the code) is cached."""
    key = json.dumps({"format": FORMAT, **_file_identity(source), "served": served, "code": _code_fingerprint()},
                     sort_keys=True)
    return cache_dir() / "weights" / f"{source.stem}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.safetensors"


def _source_facts_path(source: Path) -> Path:
    key = json.dumps({"format": FORMAT, **_file_identity(source)}, sort_keys=True)
    return cache_dir() / "weights" / f"{source.stem}-{hashlib.sha256(key.encode()).hexdigest()[:20]}.source.json"


def source_quantized(source: Path) -> bool | None:
    """Whether this GGUF's projections are stored quantized, as remembered for this very file (None:
    not known yet). Deciding it parses the file's metadata: seconds for a model with a large vocabulary."""
    try:
        value = json.loads(_source_facts_path(source).read_text())["projections_quantized"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, bool) else None


def remember_source_quantized(source: Path, quantized: bool) -> None:
    path = _source_facts_path(source)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"projections_quantized": quantized}))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not remember %s's precision at %s: %s", source, path, exc)
        tmp.unlink(missing_ok=True)


def load_entry(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor], str, torch.dtype] | None:
    """(config, state, quantization, compute dtype) from a cache entry, or None when there is none
    or it cannot be read (then it is removed)."""
    if not path.exists():
        return None
    from safetensors import safe_open  # deferred: only a cached load needs it

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            state = {name: f.get_tensor(name) for name in f.keys()}
        config = ModelConfig.model_validate_json(meta["config"])
        dtype = getattr(torch, meta["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"bad dtype {meta['dtype']!r}")
        quantization = meta["quantization"]
    except Exception as exc:  # a truncated or foreign file: derive the state again
        log.warning("weights cache entry %s is unreadable (%s); deriving the weights again", path, exc)
        path.unlink(missing_ok=True)
        return None
    os.utime(path)  # most recently used: kept by the eviction below
    return config, state, quantization, dtype


def store_entry(path: Path, config: ModelConfig, state: dict[str, torch.Tensor], quantization: str,
                dtype: torch.dtype) -> None:
    """Writes an entry atomically (a reader never sees half a file); too large a state, or a failure
    to write (a read-only or full disk), only costs the next start the derivation."""
    size = sum(t.numel() * t.element_size() for t in state.values())
    if size > MAX_ENTRY_BYTES:
        return
    from safetensors.torch import save_file  # deferred: as above

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    meta = {"config": config.model_dump_json(), "quantization": quantization,
            "dtype": str(dtype).removeprefix("torch.")}
    try:
        save_file(_unshared(state), str(tmp), metadata=meta)
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not cache the served weights at %s: %s", path, exc)
        tmp.unlink(missing_ok=True)
        return
    _evict(path.parent)


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors stores each tensor once and refuses aliases (one rotation may serve several layers)
    seen: set[int] = set()
    out = {}
    for name, t in state.items():
        t = t.contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def _evict(folder: Path) -> None:
    total = 0
    for entry in sorted(folder.glob("*.safetensors"), key=lambda p: p.stat().st_mtime, reverse=True):
        total += entry.stat().st_size
        if total > MAX_TOTAL_BYTES:
            entry.unlink(missing_ok=True)
