# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Layer patch files: git-format patches with DEP-3 style headers.

A patch file is::

    From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
    From: <maintainers>
    Date: <Last-Update, midnight UTC>
    Subject: [PATCH] <subject>

    Description: <text, continuation lines indented by one space>
    Origin: ...
    Forwarded: ...
    Last-Update: YYYY-MM-DD
    Overlay: <overlay paths the layer owns, one a line>
    Upstream-Tests: <upstream test files the layer touches or keeps green>
    Suite: <the layer's focused suite under tests/>
    ---
    <git diff of upstream files, --full-index, -U3>

Nothing in it churns when nothing changed: no commit hashes, no tool versions.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from k3stack import StackError

AUTHOR = "vLLM K3 overlay maintainers <k3-overlay@localhost>"
FROM_LINE = "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001"
LIST_FIELDS = ("Overlay", "Upstream-Tests", "Suite")
REQUIRED_FIELDS = ("Description", "Origin", "Forwarded", "Last-Update")
_HUNK_RE = re.compile(rb"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_DATE_RE = re.compile(r"\d{4}-\d{2}-\d{2}")


@dataclass
class Hunk:
    old_start: int
    old_len: int
    new_start: int
    new_len: int
    header: str
    # (op, content) with op in b" -+"; content keeps its line ending.
    lines: list[tuple[bytes, bytes]]

    def reversed(self) -> Hunk:
        swap = {b"-": b"+", b"+": b"-", b" ": b" "}
        return Hunk(
            self.new_start,
            self.new_len,
            self.old_start,
            self.old_len,
            self.header,
            [(swap[op], text) for op, text in self.lines],
        )


@dataclass
class FilePatch:
    path: str
    deleted: bool
    hunks: list[Hunk]

    def reversed(self) -> FilePatch:
        return FilePatch(self.path, False, [h.reversed() for h in self.hunks])


@dataclass
class LayerPatch:
    """A parsed layer patch file."""

    subject: str
    fields: dict[str, str]
    diff: bytes = b""
    files: list[FilePatch] = field(default_factory=list)

    def values(self, name: str) -> list[str]:
        """The whitespace-separated values of a list field."""
        return self.fields.get(name, "").split()

    @property
    def overlay(self) -> list[str]:
        return self.values("Overlay")

    @property
    def upstream_tests(self) -> list[str]:
        return self.values("Upstream-Tests")

    @property
    def suite(self) -> list[str]:
        return self.values("Suite")

    def commit_message(self) -> str:
        return f"{self.subject}\n\n{format_fields(self.fields)}"

    def render(self) -> bytes:
        """The patch file's bytes."""
        date = dt.date.fromisoformat(self.fields["Last-Update"])
        stamp = dt.datetime(date.year, date.month, date.day, tzinfo=dt.timezone.utc)
        head = (
            f"{FROM_LINE}\nFrom: {AUTHOR}\n"
            f"Date: {stamp.strftime('%a, %d %b %Y %H:%M:%S +0000')}\n"
            f"Subject: [PATCH] {self.subject}\n\n"
            f"{format_fields(self.fields)}---\n"
        )
        return head.encode() + self.diff


def format_fields(fields: dict[str, str]) -> str:
    out = []
    for name, value in fields.items():
        if name in LIST_FIELDS:
            items = value.split()
            lines = [f"{name}:"] + [f" {item}" for item in items]
            out.append("\n".join(lines))
            continue
        text_lines = value.split("\n")
        first, rest = text_lines[0], text_lines[1:]
        cont = [f" {line}" if line.strip() else " ." for line in rest]
        out.append("\n".join([f"{name}: {first}".rstrip()] + cont))
    return "\n".join(out) + "\n"


def parse_fields(text: str, where: str) -> dict[str, str]:
    """Parse ``Name: value`` fields with one-space continuation lines."""
    fields: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.startswith(" ") and name is not None:
            # Without trailing blanks, as git commit stores the line: a patch
            # and the layer commit apply makes from it parse alike.
            cont = line[1:].rstrip(" \t")
            fields[name] += "\n" + ("" if cont == "." else cont)
            continue
        key, sep, value = line.partition(":")
        if not sep or not key or " " in key:
            raise StackError(f"{where}: malformed header line {line!r}")
        name = key
        if name in fields:
            raise StackError(f"{where}: field {name} appears twice")
        fields[name] = value.strip()
    for name in LIST_FIELDS:
        if name in fields:
            fields[name] = "\n".join(fields[name].split())
    missing = [n for n in REQUIRED_FIELDS if not fields.get(n)]
    if missing:
        raise StackError(f"{where}: missing header fields {', '.join(missing)}")
    try:
        if not _DATE_RE.fullmatch(fields["Last-Update"]):
            raise ValueError
        dt.date.fromisoformat(fields["Last-Update"])
    except ValueError:
        raise StackError(
            f"{where}: Last-Update {fields['Last-Update']!r} is not YYYY-MM-DD"
        ) from None
    return fields


def parse_commit_message(message: str, where: str) -> LayerPatch:
    subject, _, body = message.partition("\n")
    return LayerPatch(subject.strip(), parse_fields(body, where))


def decode_utf8(data: bytes, where: str) -> str:
    """``data`` as text; ``StackError`` naming ``where`` if it is not UTF-8."""
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise StackError(
            f"{where}: line {line} is not UTF-8; refused: write it in UTF-8"
        ) from None


def load(path: Path) -> LayerPatch:
    """Parse a layer patch file."""
    data = path.read_bytes()
    where = path.name
    head, sep, diff = data.partition(b"\n---\n")
    if not sep:
        raise StackError(f"{where}: no '---' line between header and diff")
    lines = decode_utf8(head, where).split("\n")
    if lines[0] != FROM_LINE:
        raise StackError(f"{where}: first line is not the git-format 'From' line")
    try:
        blank = lines.index("")
    except ValueError:
        raise StackError(f"{where}: no blank line after the mail header") from None
    subject = next(
        (ln[len("Subject: ") :] for ln in lines[1:blank] if ln.startswith("Subject:")),
        None,
    )
    if subject is None:
        raise StackError(f"{where}: no Subject line")
    subject = re.sub(r"^\[PATCH[^\]]*\]\s*", "", subject)
    fields = parse_fields("\n".join(lines[blank + 1 :]), where)
    return LayerPatch(subject, fields, diff, parse_diff(diff, where))


def split_lines(data: bytes) -> list[bytes]:
    """The lines of ``data`` as git counts them, each with its ending: only
    b"\\n" ends a line (a b"\\r" inside one is part of it)."""
    lines = [line + b"\n" for line in data.split(b"\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def parse_diff(diff: bytes, where: str) -> list[FilePatch]:
    """Parse a git diff of modified or deleted files."""
    files: list[FilePatch] = []
    current: FilePatch | None = None
    hunk: Hunk | None = None
    for number, line in enumerate(split_lines(diff), start=1):
        if hunk is not None and _complete(hunk) and line[:1] in (b" ", b"-", b"+"):
            raise StackError(
                f"{where}: {current.path if current else '?'} hunk "
                f"{hunk.header}: more lines than its header counts (diff "
                f"line {number})"
            )
        if line.startswith((b"diff --git ", b"@@")) and hunk is not None:
            _check_counts(hunk, current, where)
        if line.startswith(b"diff --git "):
            path = _diff_path(
                line[len(b"diff --git ") :].rstrip(b"\r\n"), where, number
            )
            current = FilePatch(path, False, [])
            files.append(current)
            hunk = None
        elif current is None:
            raise StackError(f"{where}: diff line {number} is outside a file diff")
        elif hunk is None and line.startswith(b"new file mode"):
            raise StackError(
                f"{where}: {current.path}: new files belong in overlay/, not in "
                "the diff"
            )
        elif hunk is None and line.startswith(b"old mode"):
            raise StackError(
                f"{where}: {current.path}: a mode change; the stack carries no "
                "mode changes of upstream files"
            )
        elif hunk is None and line.startswith(b"deleted file mode"):
            current.deleted = True
        elif match := _HUNK_RE.match(line):
            a, b, c, d = match.groups()
            hunk = Hunk(
                int(a),
                1 if b is None else int(b),
                int(c),
                1 if d is None else int(d),
                # Git copies the hunk's function line as bytes: named in
                # messages only.
                line.decode("utf-8", "backslashreplace").rstrip("\n"),
                [],
            )
            current.hunks.append(hunk)
        elif hunk is not None and line[:1] in (b" ", b"-", b"+"):
            hunk.lines.append((line[:1], line[1:]))
        elif hunk is not None and line.startswith(b"\\"):
            if not hunk.lines:
                raise StackError(
                    f"{where}: diff line {number}: a '\\' line with no hunk line "
                    "before it"
                )
            op, text = hunk.lines[-1]
            hunk.lines[-1] = (op, text.rstrip(b"\n"))
        elif hunk is None and line.startswith((b"index ", b"--- ", b"+++ ")):
            continue
        elif line.startswith((b"Binary files ", b"GIT binary patch")):
            raise StackError(
                f"{where}: line {number} changes a binary file; binary changes "
                "to upstream files are not supported"
            )
        else:
            raise StackError(f"{where}: unexpected diff line {number}: {line[:60]!r}")
    if hunk is not None:
        _check_counts(hunk, current, where)
    return files


# The escapes of git's C-style quoting of unusual file names (quote_c_style).
_ESCAPES = {
    ord("a"): 7,
    ord("b"): 8,
    ord("t"): 9,
    ord("n"): 10,
    ord("v"): 11,
    ord("f"): 12,
    ord("r"): 13,
    ord('"'): ord('"'),
    ord("\\"): ord("\\"),
}


def _unquote(text: bytes) -> tuple[bytes, bytes] | None:
    """A leading C-quoted name of ``text`` unquoted, and what follows it; None
    if it is malformed."""
    out = bytearray()
    i = 1
    while i < len(text):
        char = text[i]
        if char == ord('"'):
            return bytes(out), text[i + 1 :]
        if char != ord("\\"):
            out.append(char)
            i += 1
        elif re.fullmatch(rb"[0-3][0-7]{2}", text[i + 1 : i + 4]):
            out.append(int(text[i + 1 : i + 4], 8))
            i += 4
        elif i + 1 < len(text) and text[i + 1] in _ESCAPES:
            out.append(_ESCAPES[text[i + 1]])
            i += 2
        else:
            return None
    return None


def plain_path(rel: str) -> bool:
    """A relative POSIX path spelled one way only, never leaving its root:
    the test selection matches these strings against test ids (``./x``,
    ``x/`` or ``a/../x`` would not match and hide a test that no longer
    runs), and apply writes ``tree / rel``."""
    path = PurePosixPath(rel)
    return path.as_posix() == rel and not path.is_absolute() and ".." not in path.parts


def _diff_path(names: bytes, where: str, number: int) -> str:
    """The file a ``diff --git a/X b/X`` line names: both names C-quoted, the
    way git quotes unusual names, or both plain (blanks and all)."""
    shown = names.decode("utf-8", "backslashreplace")
    old: bytes | None = None
    new: bytes | None = None
    if names.startswith(b'"'):
        first = _unquote(names)
        if first is not None and first[1].startswith(b' "'):
            second = _unquote(first[1][1:])
            if second is not None and not second[1]:
                old, new = first[0], second[0]
    else:
        # With no renames both names are one file: the middle blank splits.
        half = (len(names) - 1) // 2
        if names[half : half + 1] == b" ":
            old, new = names[:half], names[half + 1 :]
    if old is None or new is None:
        raise StackError(
            f"{where}: diff line {number} has malformed file names: {shown}"
        )
    if not (old.startswith(b"a/") and new.startswith(b"b/") and old[2:] == new[2:]):
        raise StackError(
            f"{where}: diff line {number} names two files ({shown}); renames and "
            "copies are not supported"
        )
    try:
        path = new[2:].decode()
    except UnicodeDecodeError:
        raise StackError(
            f"{where}: diff line {number} names a file whose name is not UTF-8 "
            f"({shown}); refused"
        ) from None
    if not plain_path(path):
        raise StackError(
            f"{where}: diff line {number} names {path!r}, not a plain relative "
            "path; refused"
        )
    return path


def _counts(hunk: Hunk) -> tuple[int, int]:
    old = sum(op in (b" ", b"-") for op, _ in hunk.lines)
    new = sum(op in (b" ", b"+") for op, _ in hunk.lines)
    return old, new


def _complete(hunk: Hunk) -> bool:
    return _counts(hunk) == (hunk.old_len, hunk.new_len)


def _check_counts(hunk: Hunk, file: FilePatch | None, where: str) -> None:
    """A hunk's body must hold exactly the lines its header counts (as git
    apply requires)."""
    old, new = _counts(hunk)
    if (old, new) != (hunk.old_len, hunk.new_len):
        path = file.path if file is not None else "?"
        raise StackError(
            f"{where}: {path} hunk {hunk.header}: the header counts "
            f"{hunk.old_len} old and {hunk.new_len} new lines, the body has "
            f"{old} and {new}"
        )


class HunkMismatch(StackError):
    """A hunk whose context does not match the file at its exact position."""

    def __init__(self, path: str, index: int, hunk: Hunk | None, reason: str):
        where = path if hunk is None else f"{path} hunk {index} ({hunk.header})"
        super().__init__(f"{where}: {reason}")
        self.path = path
        self.index = index


def apply_exact(source: bytes, patch: FilePatch) -> bytes:
    """Apply ``patch`` to ``source`` with no fuzz and no offset.

    Every hunk must match at exactly the line its header names, one without
    trailing context must end at the end of the file, the new positions must
    follow from the old ones, and a deletion must remove every line; anything
    else raises HunkMismatch.
    """
    src = split_lines(source)
    out: list[bytes] = []
    pos = 0
    delta = 0
    for index, hunk in enumerate(patch.hunks, start=1):
        start = hunk.old_start - 1 if hunk.old_len else hunk.old_start
        expected_new = hunk.old_start + delta
        if hunk.old_len == 0 and hunk.new_len:
            expected_new += 1
        if hunk.new_len == 0 and hunk.old_len:
            expected_new -= 1
        if hunk.new_start != expected_new:
            raise HunkMismatch(
                patch.path, index, hunk, "new position drifts from the old one"
            )
        if start < pos or start > len(src):
            raise HunkMismatch(patch.path, index, hunk, "out of range")
        out.extend(src[pos:start])
        cursor = start
        for op, text in hunk.lines:
            if op == b"+":
                out.append(text)
                continue
            if cursor >= len(src) or src[cursor] != text:
                raise HunkMismatch(
                    patch.path,
                    index,
                    hunk,
                    f"line {cursor + 1} does not match exactly",
                )
            if op == b" ":
                out.append(text)
            cursor += 1
        # Without trailing context the hunk was made at the end of the file
        # and holds only there (as git apply requires).
        if (not hunk.lines or hunk.lines[-1][0] != b" ") and cursor != len(src):
            raise HunkMismatch(
                patch.path,
                index,
                hunk,
                f"must end at end of file; the file has {len(src) - cursor} more lines",
            )
        pos = cursor
        delta += hunk.new_len - hunk.old_len
    out.extend(src[pos:])
    if patch.deleted and out:
        raise HunkMismatch(
            patch.path, 0, None, f"the deletion leaves {len(out)} of its lines"
        )
    return b"".join(out)
