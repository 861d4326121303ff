"""Types of the compiled JSON span scanner (same API as ``fastcore._scan_py``)."""

from collections.abc import Iterable, Sequence

Span = tuple[int, int]
_Body = bytes | bytearray | memoryview

KERNEL: str

def find_span(body: _Body, path: Sequence[str | int], *, validate: bool = True) -> Span | None: ...
def find_spans(
    body: _Body, paths: Iterable[Sequence[str | int]], *, validate: bool = True
) -> list[Span | None]: ...
def find_member_spans(
    body: _Body, paths: Iterable[Sequence[str | int]], *, validate: bool = True
) -> list[Span | None]: ...
def splice(body: _Body, edits: Iterable[Sequence[object]]) -> bytes: ...
def _set_kernel(name: str) -> None: ...
