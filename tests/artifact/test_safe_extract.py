"""`llamacpp_build.safe_extract`: what an sdist may not put outside its folder, on a Python with
tarfile's "data" filter and on one without it (3.11.2 has none)."""

from __future__ import annotations

import io
import tarfile

import pytest

from artifact.benchmarks.llamacpp_build import safe_extract


def archive(path, members):
    with tarfile.open(path, "w:gz") as tar:
        for name, kind, link in members:
            info = tarfile.TarInfo(name)
            if kind == "file":
                data = b"int main() {}\n"
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                info.type, info.linkname = (tarfile.SYMTYPE if kind == "sym" else tarfile.LNKTYPE), link
                tar.addfile(info)
    return path


@pytest.mark.parametrize("with_filter", [True, False])
def test_an_sdist_extracts_and_nothing_reaches_outside(tmp_path, monkeypatch, with_filter):
    if not with_filter:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    elif not hasattr(tarfile, "data_filter"):
        pytest.skip("this Python's tarfile has no data filter")
    good = archive(tmp_path / "good.tar.gz", [("pkg/src/main.c", "file", ""), ("pkg/include", "sym", "src")])
    with tarfile.open(good) as tar:
        safe_extract(tar, tmp_path / "out")
    assert (tmp_path / "out" / "pkg" / "src" / "main.c").read_bytes() == b"int main() {}\n"
    assert (tmp_path / "out" / "pkg" / "include").is_symlink()
    for bad in ([("../escape.c", "file", "")], [("pkg/etc", "sym", "../../../etc")]):
        with tarfile.open(archive(tmp_path / "bad.tar.gz", bad)) as tar, pytest.raises(Exception):
            safe_extract(tar, tmp_path / "out2")
    assert not (tmp_path / "escape.c").exists()
