"""A trace line reaches the operating system whole, or the writer says how much of it did: an unbuffered file
may take part of the bytes (a signal, a full disk) or none (a non-blocking pipe that is full)."""

from __future__ import annotations

import io

import pytest

from kvtui.engine.records.trace import _write_through


class _Raw(io.RawIOBase):
    """An unbuffered file whose writes take the given numbers of bytes (None: would block), then everything."""

    def __init__(self, takes):
        self.takes = list(takes)
        self.got = b""

    def writable(self) -> bool:
        return True

    def write(self, data) -> int | None:
        take = self.takes.pop(0) if self.takes else len(data)
        if take is None:
            return None
        take = min(take, len(data))
        self.got += bytes(data[:take])
        return take


@pytest.mark.parametrize("takes", [[], [3], [3, 2, 1], [10]])
def test_partial_writes_are_carried_on_until_the_line_is_whole(takes):
    file = _Raw(takes)
    _write_through(file, b'{"type": "step"}\n')
    assert file.got == b'{"type": "step"}\n'


@pytest.mark.parametrize(("takes", "said"), [([0], 0), ([None], 0), ([4, 0], 4), ([4, 3, None], 7)])
def test_a_write_that_takes_nothing_stops_with_how_much_went(takes, said):
    file = _Raw(takes)
    with pytest.raises(OSError, match=f"wrote {said} of 17 bytes"):
        _write_through(file, b'{"type": "step"}\n')
    assert file.got == b'{"type": "step"}\n'[:said]


def test_a_buffered_file_is_written_and_flushed():
    sink = io.BytesIO()
    buffered = io.BufferedWriter(sink)  # type: ignore[arg-type]
    _write_through(buffered, b"line\n")
    assert sink.getvalue() == b"line\n"
