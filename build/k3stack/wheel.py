# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The patched wheel: upstream's binaries plus the stack's Python.

Unchanged entries are copied compressed, byte for byte, from the upstream
wheel; changed and added files are stored uncompressed: the bytes deflate
writes depend on the zlib library Python links (zlib-ng, Fedora's system zlib
since release 40, writes other bytes than zlib), stored bytes do not, and the
changed files are about 1.7 MB of a 0.3 GB wheel. Every entry gets
the same fixed timestamp (1980-01-01 00:00, never the build's date) and
normalised permissions, and entries keep upstream's order with new files sorted
after them, so the same inputs give the same bytes.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from k3stack import StackError

_DOS_TIME = 0  # 00:00:00
_DOS_DATE = (1980 - 1980) << 9 | 1 << 5 | 1  # 1980-01-01
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_END = struct.Struct("<4sHHHHIIH")
_ZIP32_LIMIT = 0xFFFFFFFF


@dataclass(frozen=True)
class WheelChanges:
    """What the stack changes in the installed package tree."""

    files: dict[str, bytes]  # site-packages relative path -> new content
    removed: frozenset[str]
    added: frozenset[str]  # the paths of ``files`` that are new to the sdist


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


def wheel_name(upstream: str, local_version: str) -> str:
    name, version, rest = upstream.split("-", 2)
    return f"{name}-{version}+{local_version}-{rest}"


class ZipWriter:
    """A zip file of fixed timestamps (1980-01-01), entries in the order added."""

    def __init__(self, path: Path, deflate: bool = False):
        """``deflate``: compress what ``add_bytes`` adds, at the price of
        bytes that depend on the zlib library; stored otherwise."""
        self.out = path.open("wb")
        self.central: list[bytes] = []
        self.deflate = deflate

    def add(
        self,
        name: str,
        method: int,
        crc: int,
        compressed: bytes,
        size: int,
        executable: bool,
    ) -> None:
        encoded = name.encode()
        flags = 0x800 if not encoded.isascii() else 0
        offset = self.out.tell()
        if offset > _ZIP32_LIMIT or size > _ZIP32_LIMIT:
            raise StackError(f"{name}: the wheel outgrew the zip32 format")
        self.out.write(
            _LOCAL.pack(
                b"PK\x03\x04",
                20,
                flags,
                method,
                _DOS_TIME,
                _DOS_DATE,
                crc,
                len(compressed),
                size,
                len(encoded),
                0,
            )
        )
        self.out.write(encoded)
        self.out.write(compressed)
        mode = 0o100755 if executable else 0o100644
        self.central.append(
            _CENTRAL.pack(
                b"PK\x01\x02",
                0x0314,
                20,
                flags,
                method,
                _DOS_TIME,
                _DOS_DATE,
                crc,
                len(compressed),
                size,
                len(encoded),
                0,
                0,
                0,
                0,
                mode << 16,
                offset,
            )
            + encoded
        )

    def add_bytes(self, name: str, data: bytes, executable: bool = False) -> None:
        if not self.deflate:
            crc = zlib.crc32(data)
            self.add(name, zipfile.ZIP_STORED, crc, data, len(data), executable)
            return
        compressor = zlib.compressobj(9, zlib.DEFLATED, -15)
        compressed = compressor.compress(data) + compressor.flush()
        self.add(
            name,
            zipfile.ZIP_DEFLATED,
            zlib.crc32(data),
            compressed,
            len(data),
            executable,
        )

    def add_record(self, name: str, rows: list[list[str]]) -> None:
        """The wheel's RECORD ``name``: ``rows`` and its own row, as CSV."""
        text = io.StringIO()
        csv.writer(text, lineterminator="\n").writerows([*rows, [name, "", ""]])
        self.add_bytes(name, text.getvalue().encode())

    def __enter__(self) -> ZipWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Closes the file; a zip left unfinished by an error stays without
        its central directory."""
        self.out.close()

    def close(self) -> None:
        """Writes the central directory and closes the file."""
        start = self.out.tell()
        for entry in self.central:
            self.out.write(entry)
        size = self.out.tell() - start
        count = len(self.central)
        self.out.write(_END.pack(b"PK\x05\x06", 0, 0, count, count, size, start, 0))
        self.out.close()


def _raw_entry(source, info: zipfile.ZipInfo) -> bytes:
    source.seek(info.header_offset)
    header = _LOCAL.unpack(source.read(_LOCAL.size))
    if header[0] != b"PK\x03\x04" or header[2] & 0x1:
        raise StackError(f"{info.filename}: unsupported zip entry in upstream wheel")
    source.seek(info.header_offset + _LOCAL.size + header[9] + header[10])
    return source.read(info.compress_size)


def build_wheel(
    upstream: Path, changes: WheelChanges, local_version: str, out_dir: Path
) -> Path:
    """Write the patched wheel into ``out_dir`` and return its path.

    A file the stack adds to the sdist that the upstream wheel ships (a
    built one) is refused before anything is written.
    """
    with zipfile.ZipFile(upstream) as zf:
        infos = zf.infolist()
        dist_info = next(
            i.filename.split("/", 1)[0]
            for i in infos
            if i.filename.endswith(".dist-info/RECORD")
        )
        dist_name, version = dist_info.removesuffix(".dist-info").split("-", 1)
        new_version = f"{version}+{local_version}"
        new_dist_info = f"{dist_name}-{new_version}.dist-info"
        records = {
            row[0]: row
            for row in csv.reader(io.StringIO(zf.read(f"{dist_info}/RECORD").decode()))
            if row
        }
        meta_files = {
            i.filename.split("/", 1)[1]: zf.read(i)
            for i in infos
            if i.filename.startswith(dist_info + "/") and not i.filename.endswith("/")
        }
    shadowed = sorted(changes.added & {i.filename for i in infos})
    if shadowed:
        raise StackError(
            f"{shadowed[0]} is a new file of the stack, but the upstream wheel "
            "ships it (built, not in the sdist); refused: a layer must not "
            "replace it"
        )
    metadata = meta_files["METADATA"].decode()
    if f"\nVersion: {version}\n" not in metadata:
        raise StackError(f"{dist_info}/METADATA has no 'Version: {version}' line")
    meta_files["METADATA"] = metadata.replace(
        f"\nVersion: {version}\n", f"\nVersion: {new_version}\n", 1
    ).encode()
    del meta_files["RECORD"]

    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel_name(upstream.name, local_version)
    partial = target.with_name(target.name + ".part")
    record: list[list[str]] = []
    present = set()
    with ZipWriter(partial) as writer, upstream.open("rb") as source:
        for info in infos:
            name = info.filename
            if name.startswith(dist_info + "/") or name.endswith("/"):
                continue
            present.add(name)
            executable = bool((info.external_attr >> 16) & 0o111)
            if name in changes.removed:
                continue
            if name in changes.files:
                data = changes.files[name]
                writer.add_bytes(name, data, executable)
                record.append([name, record_hash(data), str(len(data))])
                continue
            raw = _raw_entry(source, info)
            writer.add(
                name, info.compress_type, info.CRC, raw, info.file_size, executable
            )
            if name not in records:
                raise StackError(f"{name} is missing from the upstream RECORD")
            record.append(records[name])
        for name in sorted(set(changes.files) - present):
            data = changes.files[name]
            writer.add_bytes(name, data)
            record.append([name, record_hash(data), str(len(data))])
        for meta, data in sorted(meta_files.items()):
            path = f"{new_dist_info}/{meta}"
            writer.add_bytes(path, data)
            record.append([path, record_hash(data), str(len(data))])
        writer.add_record(f"{new_dist_info}/RECORD", record)
        writer.close()
    partial.replace(target)
    return target
