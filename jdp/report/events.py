"""TensorBoard event files without TensorFlow: TFRecords of ``tensorflow.Event`` protobufs.

The three messages a scalar needs are encoded here directly: a tenth of the
cost of building them through a protobuf library. The tests read the files
back with TensorBoard's own reader.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

import google_crc32c


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # protobuf's int64: a negative number as its two's complement
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def event(
    wall_time: float,
    step: int,
    *,
    scalars: Mapping[str, float] | None = None,
    file_version: str | None = None,
) -> bytes:
    """A serialized ``tensorflow.Event``: wall_time = 1 (double), step = 2 (int64),
    file_version = 3 (string), summary = 5 (``Summary``: value = 1, repeated ``Value``:
    tag = 1, simple_value = 2 (float))."""
    out = b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
    if file_version is not None:
        out += _length_delimited(3, file_version.encode())
    if scalars:
        values = b"".join(
            _length_delimited(
                1, _length_delimited(1, tag.encode()) + b"\x15" + struct.pack("<f", value)
            )
            for tag, value in scalars.items()
        )
        out += _length_delimited(5, values)
    return out


def masked_crc32c(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
