"""shoal's packed shard format: samples of typed fields, indexable without unpickling.

Layout of one shard (all integers little-endian)::

    0     8 bytes   magic  b"SHOALPK\\x01"
    8     u64       n, the number of samples
    16    u64 x n+1 offsets: where record i starts; offsets[n] is the end of the last record
    ...   records

    record   u32 crc32 of the body, then the body
    body     u16 field count, then per field:
             u16 name length, name (UTF-8), u8 type, payload

    type  payload
    0     none     (nothing)
    1     bytes    u64 length, the bytes
    2     str      u64 length, UTF-8
    3     int      i64
    4     float    f64
    5     bool     u8
    6     ndarray  u8 dtype length, numpy ``dtype.str`` (ASCII, e.g. ``<f4``), u8 ndim,
                   u64 x ndim shape, the C-order data (``prod(shape) * itemsize`` bytes)

A sample is a ``dict`` from field name (``str``) to one of those types; numpy scalars are
stored as int/float/bool, torch tensors (CPU) as ndarrays. Nothing is pickled: object and
structured dtypes, ints outside 64 bits and other value types raise :class:`FormatError`.
Reading record ``i`` needs ``offsets[i:i+2]`` (16 bytes at ``16 + 8 i``) and the record
itself, so a sample can be fetched with ranged reads; its crc32 is checked on every decode.
"""

from __future__ import annotations

import math
import operator
import struct
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

MAGIC = b"SHOALPK\x01"
HEADER = 16  # magic + n
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")

_NONE, _BYTES, _STR, _INT, _FLOAT, _BOOL, _ARRAY = range(7)
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1


class FormatError(ValueError):
    """A sample that cannot be packed, or bytes that are not a valid packed shard/record.
    The message names the field or the offending part; callers add the shard name."""


def _as_array(value: Any) -> np.ndarray | None:
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch") and hasattr(value, "numpy"):
        return value.detach().cpu().numpy()
    return None


def encode_sample(sample: Mapping[str, Any]) -> bytes:
    """One record (crc32 + body) for ``sample``. FormatError for an unsupported value."""
    if not isinstance(sample, Mapping):
        raise FormatError(f"a sample must be a dict of fields, got {type(sample).__name__}")
    if len(sample) > 0xFFFF:
        raise FormatError(f"a sample has at most 65535 fields, got {len(sample)}")
    parts = [_U16.pack(len(sample))]
    for name, value in sample.items():
        if not isinstance(name, str):
            raise FormatError(f"field names must be str, got {name!r}")
        raw = name.encode()
        if len(raw) > 0xFFFF:
            raise FormatError(f"field name too long ({len(raw)} bytes)")
        parts += [_U16.pack(len(raw)), raw, _encode_value(name, value)]
    body = b"".join(parts)
    return _U32.pack(zlib.crc32(body)) + body


def _encode_value(name: str, value: Any) -> bytes:
    if value is None:
        return bytes([_NONE])
    if isinstance(value, (bool, np.bool_)):
        return bytes([_BOOL, 1 if value else 0])
    if isinstance(value, (int, np.integer)):
        v = int(value)
        if not _I64_MIN <= v <= _I64_MAX:
            raise FormatError(f"field {name!r}: int {v} does not fit in 64 bits")
        return bytes([_INT]) + _I64.pack(v)
    if isinstance(value, (float, np.floating)):
        return bytes([_FLOAT]) + _F64.pack(float(value))
    if isinstance(value, str):
        raw = value.encode()
        return bytes([_STR]) + _U64.pack(len(raw)) + raw
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        return bytes([_BYTES]) + _U64.pack(len(raw)) + raw
    arr = _as_array(value)
    if arr is not None:
        if arr.dtype.hasobject or arr.dtype.fields is not None or arr.dtype.subdtype is not None:
            raise FormatError(f"field {name!r}: dtype {arr.dtype} is not supported (no object or structured dtypes)")
        if arr.ndim > 255:
            raise FormatError(f"field {name!r}: at most 255 dimensions")
        dt = arr.dtype.str.encode("ascii")
        shape = b"".join(_U64.pack(d) for d in arr.shape)
        return bytes([_ARRAY, len(dt)]) + dt + bytes([arr.ndim]) + shape + np.ascontiguousarray(arr).tobytes()
    raise FormatError(
        f"field {name!r}: {type(value).__name__} is not a packable type "
        "(bytes, str, int, float, bool, None, numpy array, torch tensor)"
    )


def decode_record(buf: bytes | memoryview, *, check_crc: bool = True) -> dict[str, Any]:
    """The sample in one record (crc32 + body). FormatError when the crc or layout is wrong;
    ``check_crc`` False: the caller verified the bytes otherwise (a whole shard's sha256).
    Arrays are writable copies."""
    try:
        if len(buf) < 6:
            raise FormatError(f"record of {len(buf)} bytes is truncated")
        if check_crc and zlib.crc32(memoryview(buf)[4:]) != _U32.unpack_from(buf, 0)[0]:
            raise FormatError("record crc32 mismatch")
        if isinstance(buf, bytes):
            out = _decode_known(buf)
            if out is not None:
                return out
            global _WALKED
            # learn a layout when two walked records in a row have one size (or none is known
            # yet): records of varying sizes would match no layout, and learning costs ~35 %
            learn = not _LAYOUTS or len(buf) == _WALKED
            _WALKED = len(buf)
            return _decode_body(memoryview(buf)[4:], learn=learn)
        return _decode_body(memoryview(buf)[4:])
    except (struct.error, IndexError, UnicodeDecodeError, TypeError) as exc:
        raise FormatError(f"malformed record: {exc}") from exc


class _Layout:
    """Where everything is in records of one fixed layout (a shard's records mostly share
    one: the same fields, dtypes, shapes and byte lengths). ``checks``: (offset in the
    record, bytes) of every field's header - name, type, dtype, shape, length - and of the
    field count; a record of ``size`` bytes whose headers all match parses exactly as the one
    it was learned from, so its values are read at the learned offsets without walking it.
    ``heads`` is what ``headers`` (one C call slicing them all) gives for such a record, and
    ``values`` reads the values (:func:`_values_of`)."""

    __slots__ = ("size", "checks", "fields", "headers", "heads", "values")

    def __init__(self, size: int, checks: tuple[tuple[int, bytes], ...],
                 fields: tuple[tuple[str, Callable[[bytes | memoryview], Any]], ...]) -> None:
        self.size = size
        self.checks = checks
        #: (name, the reader of its value from the whole record: :func:`_reader` at 4 + offset)
        self.fields = fields
        # itemgetter of two or more slices gives a tuple; of one, the bytes alone: two always
        spans = [slice(at, at + len(head)) for at, head in checks] + [slice(0, 0)]
        self.headers = operator.itemgetter(*spans)
        self.heads = (*(head for _, head in checks), b"")
        self.values = _values_of(fields)


#: the layouts learned last, newest first (a few: records of another layout are walked)
_LAYOUTS: tuple[_Layout, ...] = ()
_LAYOUTS_KEPT = 4
_WALKED = 0  # the size of the last record walked


def _decode_known(buf: bytes) -> dict[str, Any] | None:
    """The record's values by a learned layout, or None when none matches."""
    size = len(buf) - 4
    for lay in _LAYOUTS:
        if lay.size == size and lay.headers(buf) == lay.heads:
            return lay.values(buf)
    return None


def _values_of(fields: tuple[tuple[str, Callable[[bytes | memoryview], Any]], ...]) -> Callable[[bytes], dict[str, Any]]:
    """The function building a record's dict from its ``fields`` (name, reader): for up to
    four fields a dict display (no comprehension's frame: a quarter of a record's decode),
    else a comprehension. Later fields of a repeated name win, as when walking."""
    if len(fields) == 1:
        (n0, r0), = fields
        return lambda b: {n0: r0(b)}
    if len(fields) == 2:
        (n0, r0), (n1, r1) = fields
        return lambda b: {n0: r0(b), n1: r1(b)}
    if len(fields) == 3:
        (n0, r0), (n1, r1), (n2, r2) = fields
        return lambda b: {n0: r0(b), n1: r1(b), n2: r2(b)}
    if len(fields) == 4:
        (n0, r0), (n1, r1), (n2, r2), (n3, r3) = fields
        return lambda b: {n0: r0(b), n1: r1(b), n2: r2(b), n3: r3(b)}
    return lambda b: {name: read(b) for name, read in fields}


def _reader(kind: int, at: int, n: int, dtype: Any, shape: tuple[int, ...]) -> Callable[[bytes | memoryview], Any]:
    """The function reading one field's value from its data at ``at`` (``n``: elements of an
    array, bytes of a bytes or str field); the caller checked that the data lies inside the
    record. A learned layout keeps one per field, so a record of it costs no dispatch."""
    end = at + n
    if kind == _ARRAY:  # a writable copy (a bytearray's: the cheapest way to one)
        end = at + n * dtype.itemsize
        if shape == (n,):
            return lambda b: np.frombuffer(bytearray(b[at:end]), dtype=dtype)
        return lambda b: np.frombuffer(bytearray(b[at:end]), dtype=dtype).reshape(shape)
    if kind == _BYTES:
        return lambda b: bytes(b[at:end])
    if kind == _STR:
        return lambda b: bytes(b[at:end]).decode()
    if kind == _INT:
        return lambda b: _I64.unpack_from(b, at)[0]
    if kind == _FLOAT:
        return lambda b: _F64.unpack_from(b, at)[0]
    if kind == _BOOL:
        return lambda b: bool(b[at])
    return lambda b: None


def _learn(lay: _Layout) -> None:
    global _LAYOUTS
    _LAYOUTS = (lay, *_LAYOUTS[: _LAYOUTS_KEPT - 1])


#: field names and array dtypes seen in records, by their encoded bytes: a shard's records
#: share a schema, so each is decoded once per process (bounded: a hostile shard cannot grow them)
_NAMES: dict[bytes, str] = {}
_DTYPES: dict[bytes, np.dtype] = {}
_SHAPES = [struct.Struct(f"<{k}Q") for k in range(256)]
_CACHED_MAX = 1024


def _name(raw: bytes) -> str:
    name = _NAMES.get(raw)
    if name is None:
        name = raw.decode()
        if len(_NAMES) < _CACHED_MAX:
            _NAMES[raw] = name
    return name


def _dtype(raw: bytes, name: str) -> np.dtype:
    dtype = _DTYPES.get(raw)
    if dtype is None:
        dtype = np.dtype(raw.decode("ascii"))
        if dtype.hasobject:
            raise FormatError(f"field {name!r}: object dtype refused")
        if len(_DTYPES) < _CACHED_MAX:
            _DTYPES[raw] = dtype
    return dtype


def _decode_body(mv: memoryview, *, learn: bool = False) -> dict[str, Any]:
    """Walk a record's body field by field; with ``learn``, remember its layout for
    :func:`_decode_known`."""
    (count,) = _U16.unpack_from(mv, 0)
    pos = 2
    size = len(mv)
    out: dict[str, Any] = {}
    checks: list[tuple[int, bytes]] = [(4, mv[0:2].tobytes())]
    fields: list[tuple[str, Callable[[bytes | memoryview], Any]]] = []
    for _ in range(count):
        start = pos
        (nlen,) = _U16.unpack_from(mv, pos)
        pos += 2
        name = _name(mv[pos : pos + nlen].tobytes())
        pos += nlen
        kind = mv[pos]
        pos += 1
        dtype: Any = None
        shape: tuple[int, ...] = ()
        if kind == _ARRAY:
            dlen = mv[pos]
            dtype = _dtype(mv[pos + 1 : pos + 1 + dlen].tobytes(), name)
            pos += 1 + dlen
            ndim = mv[pos]
            pos += 1
            shape = _SHAPES[ndim].unpack_from(mv, pos)
            pos += 8 * ndim
            n = math.prod(shape)
            nbytes = n * dtype.itemsize
        elif kind in (_BYTES, _STR):
            (n,) = _U64.unpack_from(mv, pos)
            pos += 8
            nbytes = n
        elif kind in (_INT, _FLOAT):
            n = nbytes = 8
        elif kind == _BOOL:
            n = nbytes = 1
        elif kind == _NONE:
            n = nbytes = 0
        else:
            raise FormatError(f"field {name!r}: unknown type code {kind}")
        if pos + nbytes > size:
            raise FormatError(f"field {name!r} runs past the record")
        out[name] = _reader(kind, pos, n, dtype, shape)(mv)
        if learn:
            checks.append((4 + start, mv[start:pos].tobytes()))
            fields.append((name, _reader(kind, 4 + pos, n, dtype, shape)))
        pos += nbytes
    if pos != size:
        raise FormatError(f"{size - pos} trailing bytes in record")
    if learn:
        _learn(_Layout(size, tuple(checks), tuple(fields)))
    return out


def build_shard(records: Iterable[bytes]) -> bytes:
    """A whole shard from encoded records (:func:`encode_sample`)."""
    records = list(records)
    base = HEADER + 8 * (len(records) + 1)
    offsets = [base]
    for rec in records:
        offsets.append(offsets[-1] + len(rec))
    head = MAGIC + _U64.pack(len(records)) + b"".join(_U64.pack(o) for o in offsets)
    return head + b"".join(records)


def shard_overhead(samples: int) -> int:
    """Bytes a shard of ``samples`` records spends besides the records."""
    return HEADER + 8 * (samples + 1)


def parse_header(head: bytes | memoryview) -> int:
    """The sample count from a shard's first 16 bytes. FormatError if the magic is wrong."""
    if len(head) < HEADER or bytes(head[:8]) != MAGIC:
        raise FormatError("not a packed shard (bad magic)")
    return _U64.unpack_from(head, 8)[0]


def offsets_span(pos: int) -> tuple[int, int]:
    """(start, length) of the bytes holding ``offsets[pos]`` and ``offsets[pos + 1]``."""
    return HEADER + 8 * pos, 16


def offset_pair(raw: bytes | memoryview) -> tuple[int, int]:
    """(start, end) of a record from the 16 bytes at :func:`offsets_span`."""
    return _U64.unpack_from(raw, 0)[0], _U64.unpack_from(raw, 8)[0]


def offsets_table(raw: bytes | memoryview, samples: int) -> np.ndarray:
    """All ``samples + 1`` record offsets from the bytes after the 16-byte header."""
    return np.frombuffer(raw, dtype="<u8", count=samples + 1).astype(np.int64)
