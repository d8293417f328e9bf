"""Local JSON Lines read in place: a line index, and the documents of any range parsed where
they are needed.

``moetrain prepare`` reads an uncompressed local ``.jsonl``/``.json`` source (one JSON object per
line) through this module instead of converting it to an Arrow cache first: rank 0 only finds
the lines (a newline scan at disk speed), and each tokenizing worker parses the lines of its own
chunks. The documents are those ``datasets`` reads from the same files: one per non-blank line,
in file order (lines of only whitespace are skipped, a UTF-8 byte order mark at the start of a
file is ignored), the text from the object's ``text_field``; a missing or null field is an
empty document. A document's size for chunk planning is its line's length in bytes.

The line index of a source, ``(documents, 3)`` int64 rows of (file, first byte, end byte), is
kept in the prepare's build directory, named by the source fingerprint, so every rank of a
distributed prepare reads rank 0's instead of scanning the files again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from moetrain.data.errors import DataError
from moetrain.fileio import atomic_file

_BOM = b"\xef\xbb\xbf"
_SCAN_BLOCK = 64 << 20  # bytes searched for newlines at a time
_WHITESPACE = b" \t\r\n\f\v"


def is_json_lines(files: Sequence[Path]) -> bool:
    """Whether every file is empty or starts with a JSON object: not an array (``[...]``) and
    not compressed (whatever the name says); those are left to ``datasets``."""
    for path in files:
        with open(path, "rb") as f:
            head = f.read(4096).removeprefix(_BOM).lstrip(_WHITESPACE)
        if head and not head.startswith(b"{"):
            return False
    return True


def _scan_file(path: Path, file_index: int) -> np.ndarray:
    """(file, first byte, end byte) of every non-blank line of ``path``."""
    size = path.stat().st_size
    if size == 0:
        return np.zeros((0, 3), np.int64)
    data = np.memmap(path, np.uint8, "r")
    newlines = [
        np.flatnonzero(data[a : a + _SCAN_BLOCK] == ord("\n")) + a
        for a in range(0, size, _SCAN_BLOCK)
    ]
    ends = np.concatenate([*newlines, [size]])
    starts = np.concatenate([[0], ends[:-1] + 1])
    if bytes(data[:3]) == _BOM:
        starts[0] = 3
    keep = ends > starts
    # a line that does not start with "{" may be blank (or whitespace): look at those alone
    first = np.zeros(len(starts), np.uint8)
    first[keep] = data[starts[keep]]
    for i in np.flatnonzero(keep & (first != ord("{"))):
        keep[i] = bool(bytes(data[starts[i] : ends[i]]).strip(_WHITESPACE))
    out = np.empty((int(keep.sum()), 3), np.int64)
    out[:, 0], out[:, 1], out[:, 2] = file_index, starts[keep], ends[keep]
    del data
    return out


class JsonLines:
    """The documents of JSON Lines files, by index (see the module docstring)."""

    def __init__(self, files: Sequence[Path], text_field: str, lines: np.ndarray) -> None:
        self.files = [Path(f) for f in files]
        self.text_field = text_field
        self.lines = lines  # (documents, 3): file, first byte, end byte

    @classmethod
    def open(
        cls, files: Sequence[Path], text_field: str, fingerprint: str, cache: Path | None
    ) -> JsonLines:
        """Index the lines of ``files``, or read the index another process of this prepare
        wrote to ``cache`` for the same ``fingerprint``."""
        path = cache / f"lines-{fingerprint[:16]}.npy" if cache is not None else None
        if path is not None and path.is_file():
            lines = np.load(path, mmap_mode="r")
        else:
            parts = [_scan_file(Path(f), i) for i, f in enumerate(files)]
            lines = np.concatenate(parts) if parts else np.zeros((0, 3), np.int64)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                with atomic_file(path, "wb") as f:
                    np.save(f, lines)
        return cls(files, text_field, lines)

    def __len__(self) -> int:
        return len(self.lines)

    def head(self, n: int) -> JsonLines:
        """The first ``n`` documents."""
        return JsonLines(self.files, self.text_field, self.lines[:n])

    def sizes(self, where: str) -> np.ndarray:
        """Each document's line length in bytes."""
        return np.asarray(self.lines[:, 2] - self.lines[:, 1], dtype=np.int64)

    def _text(self, raw: bytes, doc: int) -> str | None:
        file, start = self.files[int(self.lines[doc, 0])], int(self.lines[doc, 1])
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise DataError(
                f"{file} at byte {start}: document {doc} is not valid JSON: {e}"
            ) from None
        if not isinstance(obj, dict):
            raise DataError(
                f"{file} at byte {start}: document {doc} is a JSON {type(obj).__name__}, "
                "not an object"
            )
        text = obj.get(self.text_field)
        if text is None:
            return None
        if not isinstance(text, str):
            raise DataError(
                f"{file} at byte {start}: text field {self.text_field!r} of document {doc} "
                f"holds {type(text).__name__}, not text"
            )
        try:
            text.encode()
        except UnicodeEncodeError:  # JSON allows "\ud800" alone; no tokenizer takes it
            raise DataError(
                f"{file} at byte {start}: document {doc} holds an unpaired surrogate escape"
            ) from None
        return text

    def _raw(self, lo: int, hi: int) -> Iterator[tuple[int, bytes]]:
        """(document, line bytes) of documents ``[lo, hi)``, each file's part read at once."""
        doc = lo
        while doc < hi:
            file = int(self.lines[doc, 0])
            last = doc + int(np.searchsorted(self.lines[doc:hi, 0], file, "right"))
            base, end = int(self.lines[doc, 1]), int(self.lines[last - 1, 2])
            with open(self.files[file], "rb") as f:
                f.seek(base)
                data = f.read(end - base)
            for d in range(doc, last):
                yield d, data[int(self.lines[d, 1]) - base : int(self.lines[d, 2]) - base]
            doc = last

    def texts(self, lo: int, hi: int, batch: int) -> Iterator[list[str | None]]:
        """The texts of documents ``[lo, hi)``, in lists of ``batch``."""
        out: list[str | None] = []
        for doc, raw in self._raw(lo, hi):
            out.append(self._text(raw, doc))
            if len(out) == batch:
                yield out
                out = []
        if out:
            yield out

    def take(self, indices: Sequence[int]) -> list[str | None]:
        """The texts of the documents ``indices``."""
        out = []
        handles: dict[int, int] = {}
        try:
            for doc in indices:
                file, start, end = (int(x) for x in self.lines[doc])
                if file not in handles:
                    handles[file] = os.open(self.files[file], os.O_RDONLY)
                out.append(self._text(os.pread(handles[file], end - start, start), doc))
        finally:
            for fd in handles.values():
                os.close(fd)
        return out

    def missing_text_field(self) -> list[str] | None:
        """None if some document has the text field (looked for in order, usually found in
        the first); otherwise the fields of the documents, in the order first seen."""
        seen: dict[str, None] = {}
        for doc, raw in self._raw(0, len(self)):
            self._text(raw, doc)  # a document that is not an object is an error here too
            obj = json.loads(raw)
            if self.text_field in obj:
                return None
            seen.update(dict.fromkeys(obj))
        return list(seen)
