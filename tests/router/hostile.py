"""Hostile inputs the router tests share: images built to break decoders."""

from __future__ import annotations

import struct
import zlib


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(width: int = 30_000, height: int = 30_000) -> bytes:
    """A tiny PNG whose header claims ``width`` x ``height`` pixels (PIL refuses over ~179 Mpx)."""
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(bytes(64)))
        + _png_chunk(b"IEND", b"")
    )
