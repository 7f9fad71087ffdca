"""WebDataset tar shards: write them, find their samples' byte ranges, decode a sample.

A WebDataset shard is a plain tar whose members are grouped into samples by *key*: a member
``dir/000123.seg.png`` belongs to sample ``dir/000123`` as field ``seg.png`` (the key is the
path up to the first dot of the file name, as in WebDataset). A sample's members must be
consecutive; members without a dot in their file name, and non-files, are skipped (as
WebDataset does). :func:`scan` returns the samples' byte offsets (``samples + 1``: where each
sample's first member header starts, then the end of the last one) for the dataset index, so
a single sample can be fetched with one ranged read and decoded by :func:`decode_range`.

Fields are decoded by their last extension, never by unpickling: ``txt``/``text`` -> str,
``cls``/``cls2``/``index``/``inx``/``id`` -> int, ``json``/``jsn`` -> parsed JSON, ``npy``
-> numpy array (``allow_pickle=False``); anything else stays bytes. The sample is a dict with
``__key__`` and one entry per field. :func:`write_tar` writes samples (dicts as for the packed
format) this way round: a ``str`` as UTF-8, an int as decimal text, a float as ``repr``, an
array as ``.npy``, ``dict``/``list`` as JSON; name the fields by those extensions to read the
same types back. Tars are written deterministically (mtime 0, uid/gid 0, mode 0644).
"""

from __future__ import annotations

import io
import json
import re
import tarfile
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from shoal.storage.streaming_format import FormatError, _as_array

_KEY_RE = re.compile(r"^((?:.*/|)[^./][^.]*)\.([^/]+)$")
_TEXT = {"txt", "text"}
_INT = {"cls", "cls2", "index", "inx", "id"}
_JSON = {"json", "jsn"}
KEY = "__key__"


def split_name(path: str) -> tuple[str, str] | None:
    """(key, field) of a member name, None for a name WebDataset skips."""
    m = _KEY_RE.match(path)
    return (m.group(1), m.group(2)) if m else None


def decode_field(field: str, data: bytes) -> Any:
    """A field's value from its bytes, by its last extension (see the module docstring)."""
    ext = field.rsplit(".", 1)[-1].lower()
    try:
        if ext in _TEXT:
            return data.decode()
        if ext in _INT:
            return int(data.decode().strip())
        if ext in _JSON:
            return json.loads(data)
        if ext == "npy":
            return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, UnicodeDecodeError) as exc:
        raise FormatError(f"field {field!r}: cannot decode as {ext}: {exc}") from exc
    return data


def encode_field(field: str, value: Any) -> bytes:
    """The bytes stored for ``value`` (see :func:`write_tar`). FormatError for other types."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bool, np.bool_)):
        return b"1" if value else b"0"
    if isinstance(value, (int, np.integer)):
        return str(int(value)).encode()
    if isinstance(value, (float, np.floating)):
        return repr(float(value)).encode()
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True).encode()
    arr = _as_array(value)
    if arr is not None:
        if arr.dtype.hasobject:
            raise FormatError(f"field {field!r}: object arrays cannot be stored")
        buf = io.BytesIO()
        np.save(buf, arr, allow_pickle=False)
        return buf.getvalue()
    raise FormatError(f"field {field!r}: {type(value).__name__} cannot be stored in a WebDataset tar")


def write_tar(samples: Iterable[Mapping[str, Any]]) -> tuple[bytes, list[int]]:
    """A tar of ``samples`` (each with a ``__key__``) and its sample offsets (``n + 1``)."""
    out = io.BytesIO()
    offsets: list[int] = []
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for sample in samples:
            key = sample.get(KEY)
            if not isinstance(key, str) or split_name(f"{key}.x") != (key, "x"):
                raise FormatError(f"sample key {key!r} is not a WebDataset key (no dot in its file name)")
            offsets.append(out.tell())
            for field, value in sample.items():
                if field == KEY:
                    continue
                if not field or "/" in field:
                    raise FormatError(f"field name {field!r} cannot be a file extension")
                data = encode_field(field, value)
                info = tarfile.TarInfo(f"{key}.{field}")
                info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
                info.uname = info.gname = ""
                tar.addfile(info, io.BytesIO(data))
        offsets.append(out.tell())
    return out.getvalue(), offsets


def scan(fileobj: Any, size: int) -> list[int]:
    """Sample offsets of a tar read from ``fileobj`` (``size`` bytes). FormatError for a
    tar that is not valid or whose samples are not grouped."""
    offsets: list[int] = []
    seen: set[str] = set()
    current: str | None = None
    end = 0
    try:
        with tarfile.open(fileobj=fileobj, mode="r:") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                parts = split_name(info.name)
                if parts is None:
                    continue
                key = parts[0]
                if key != current:
                    if key in seen:
                        raise FormatError(f"sample {key!r} is split: its members are not consecutive")
                    seen.add(key)
                    offsets.append(info.offset)
                    current = key
                end = info.offset_data + ((info.size + 511) // 512) * 512
    except tarfile.TarError as exc:
        raise FormatError(f"not a valid tar: {exc}") from exc
    offsets.append(min(end, size))
    if len(offsets) == 1:
        offsets = [0]
    return offsets


def decode_range(data: bytes) -> dict[str, Any]:
    """The sample whose members are the tar bytes ``data`` (one sample's range)."""
    sample: dict[str, Any] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            for info in tar:
                parts = split_name(info.name) if info.isfile() else None
                if parts is None:
                    continue
                if KEY in sample and sample[KEY] != parts[0]:
                    raise FormatError(f"range holds two samples ({sample[KEY]!r}, {parts[0]!r})")
                sample[KEY] = parts[0]
                f = tar.extractfile(info)
                assert f is not None
                sample[parts[1]] = decode_field(parts[1], f.read())
    except tarfile.TarError as exc:
        raise FormatError(f"not a valid tar range: {exc}") from exc
    if KEY not in sample:
        raise FormatError("range holds no sample")
    return sample
