"""The GGUF reader our loads use (`engines.weights.gguf_loader.plain_array_reader`) reads what gguf's own
reader reads — every metadata field and every tensor's bytes — from the default model's file, and the
window in which libraries see it as `gguf.GGUFReader` closes behind itself."""

from __future__ import annotations

import threading

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from engines.weights.gguf_loader import plain_array_reader, plain_array_reader_installed  # noqa: E402
from engines.weights.resolve import default_gguf_path  # noqa: E402


def test_the_plain_array_reader_reads_every_field_and_tensor_as_gguf_does():
    path = str(default_gguf_path())
    ours, theirs = plain_array_reader()(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        assert ours.fields[name].types == field.types, name
        assert ours.fields[name].contents() == field.contents(), name
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, ref in zip(ours.tensors, theirs.tensors):
        assert (mine.tensor_type, mine.shape.tolist(), mine.data_offset) == \
            (ref.tensor_type, ref.shape.tolist(), ref.data_offset), ref.name
        assert type(mine.data) is np.ndarray and not mine.data.flags.writeable  # a view of the read-only mapping
        assert np.array_equal(mine.data.view(np.uint8), np.asarray(ref.data).view(np.uint8)), ref.name
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment


def test_the_installed_reader_is_put_back_after_nested_and_concurrent_uses():
    original, plain = gguf.GGUFReader, plain_array_reader()
    assert plain is not original and plain.__bases__ == (original,)
    with plain_array_reader_installed():
        assert gguf.GGUFReader is plain
        with plain_array_reader_installed():
            assert gguf.GGUFReader is plain
        assert gguf.GGUFReader is plain  # the inner one left, the outer still reads
    assert gguf.GGUFReader is original

    # two threads whose windows overlap, the first leaving first: the class stays until both left
    entered, second_started, first_left, second_may_leave = (threading.Event() for _ in range(4))
    seen = {}

    def first():
        with plain_array_reader_installed():
            entered.set()
            second_started.wait(5)
        first_left.set()

    def second():
        entered.wait(5)
        with plain_array_reader_installed():
            second_started.set()
            first_left.wait(5)
            seen["after the first left"] = gguf.GGUFReader
            second_may_leave.wait(5)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    first_left.wait(5)
    second_may_leave.set()
    for t in threads:
        t.join(5)
    assert seen["after the first left"] is plain
    assert gguf.GGUFReader is original
    with pytest.raises(RuntimeError), plain_array_reader_installed():
        raise RuntimeError("a failed read")
    assert gguf.GGUFReader is original
