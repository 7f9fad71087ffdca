"""The packed shard format: every field type round-trips, nothing else is accepted, damage is caught."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.storage import streaming_format as fmt
from shoal.storage import streaming_tar as wds

EVERY_TYPE = {
    "none": None,
    "bytes": b"\x00\xffabc",
    "empty": b"",
    "str": "héllo\nworld",
    "int": -(2**63),
    "big": 2**63 - 1,
    "float": -1.5e-300,
    "bool": True,
    "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
    "u8": np.frombuffer(b"\x01\x02\x03", dtype=np.uint8),
    "i64be": np.array([1, -2], dtype=">i8"),
    "scalar0d": np.array(3.25),
    "empty_arr": np.zeros((0, 5), dtype=np.int16),
    "bool_arr": np.array([True, False]),
    "tensor": torch.arange(6, dtype=torch.float64).reshape(2, 3),
    "np_int": np.int32(7),
    "np_float": np.float16(0.5),
}


def _same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    return type(a) is type(b) and a == b


def test_every_field_type_round_trips() -> None:
    out = fmt.decode_record(fmt.encode_sample(EVERY_TYPE))
    assert list(out) == list(EVERY_TYPE)
    expected = dict(EVERY_TYPE, tensor=EVERY_TYPE["tensor"].numpy(), np_int=7, np_float=0.5)
    for name, value in expected.items():
        assert _same(value, out[name]), name
    assert out["f32"].flags.writeable


def test_every_field_type_round_trips_again_by_its_learned_layout() -> None:
    """The second record of a layout is read at the learned offsets, not walked: same values."""
    rec = fmt.encode_sample(EVERY_TYPE)
    first = fmt.decode_record(rec)
    fmt.decode_record(rec)  # two walked records of one size in a row: the layout is learned
    assert fmt._decode_known(rec) is not None
    again = fmt.decode_record(rec)
    assert list(again) == list(first)
    for name in first:
        assert _same(first[name], again[name]), name
    assert again["f32"].flags.writeable and not np.shares_memory(again["f32"], first["f32"])


@pytest.mark.parametrize("fields", [1, 2, 3, 4, 5])
def test_a_learned_layout_of_any_field_count_reads_every_field_in_order(fields: int) -> None:
    """A learned layout builds a record's dict one way for up to four fields and another
    beyond: every field, in its order, with its value, both ways."""
    sample = {f"f{k}": (np.full(3, k, dtype=np.int16) if k % 2 else bytes([k]) * (k + 1)) for k in range(fields)}
    rec = fmt.encode_sample(sample)
    for _ in range(2):
        fmt.decode_record(rec)  # walked twice: learned
    assert fmt._decode_known(rec) is not None
    out = fmt.decode_record(rec)
    assert list(out) == list(sample)
    assert all(_same(value, out[name]) for name, value in sample.items())


def test_a_record_of_the_same_size_and_another_layout_is_walked_not_misread() -> None:
    """Same byte size: a dtype, a shape, a field's type, a name or two lengths that differ
    must never be read with the learned offsets."""
    base = {"x": np.arange(4, dtype=np.float32).reshape(2, 2), "y": 3, "tag": b"abcd", "note": b"xy"}
    twins = [
        dict(base, x=np.arange(4, dtype=np.int32).reshape(2, 2)),  # dtype
        dict(base, x=np.arange(4, dtype=np.float32).reshape(1, 4)),  # shape
        dict(base, y=3.0),  # int -> float
        dict(base, tag="abcd"),  # bytes -> str
        {"x": base["x"], "z": 3, "tag": b"abcd", "note": b"xy"},  # a name
        dict(base, tag=b"abcde", note=b"x"),  # lengths shift, total the same
    ]
    size = len(fmt.encode_sample(base))
    for _ in range(2):  # two in a row: the base layout is learned
        fmt.decode_record(fmt.encode_sample(base))
    for twin in twins:
        rec = fmt.encode_sample(twin)
        assert len(rec) == size, twin
        for _ in range(3):  # walked, then perhaps learned: the same values each time
            out = fmt.decode_record(rec)
            assert list(out) == list(twin)
            assert all(_same(value, out[name]) for name, value in twin.items()), twin
        fmt.decode_record(fmt.encode_sample(base))


def test_shard_layout_offsets_and_header() -> None:
    samples = [{"i": i, "s": "x" * i} for i in range(5)]
    records = [fmt.encode_sample(s) for s in samples]
    shard = fmt.build_shard(records)
    assert fmt.parse_header(shard[:16]) == 5
    table = fmt.offsets_table(shard[16:], 5)
    assert len(shard) == table[-1] == fmt.shard_overhead(5) + sum(map(len, records))
    for pos, s in enumerate(samples):
        start, length = fmt.offsets_span(pos)
        a, b = fmt.offset_pair(shard[start : start + length])
        assert (a, b) == (table[pos], table[pos + 1])
        assert fmt.decode_record(shard[a:b]) == s


@pytest.mark.parametrize(
    "value, match",
    [
        ({1, 2}, "set is not a packable type"),
        (2**63, "does not fit in 64 bits"),
        (np.array([object()], dtype=object), "no object or structured"),
        (np.zeros(2, dtype=[("a", "<i4")]), "no object or structured"),
        ([1, 2], "list is not a packable type"),
    ],
)
def test_unsupported_values_are_refused_naming_the_field(value, match) -> None:
    with pytest.raises(fmt.FormatError, match=match) as info:
        fmt.encode_sample({"ok": 1, "field_x": value})
    assert "field_x" in str(info.value)
    with pytest.raises(fmt.FormatError, match="dict of fields"):
        fmt.encode_sample([1, 2])  # type: ignore[arg-type]


def test_damage_is_detected() -> None:
    rec = bytearray(fmt.encode_sample(EVERY_TYPE))
    rec[-3] ^= 0x10
    with pytest.raises(fmt.FormatError, match="crc32"):
        fmt.decode_record(bytes(rec))
    with pytest.raises(fmt.FormatError, match="truncated"):
        fmt.decode_record(b"\x00\x01")
    with pytest.raises(fmt.FormatError, match="bad magic"):
        fmt.parse_header(b"NOTASHRD" + bytes(8))


def test_webdataset_tar_round_trips_typed_fields() -> None:
    samples = [
        {"__key__": f"{i:04d}", "cls": i, "txt": f"t{i}", "npy": np.ones((2, i + 1), np.float32), "seg.png": b"\x89PNG" * i}
        for i in range(4)
    ]
    data, offsets = wds.write_tar(samples)
    import io

    assert wds.scan(io.BytesIO(data), len(data)) == offsets
    for i, s in enumerate(samples):
        got = wds.decode_range(data[offsets[i] : offsets[i + 1]])
        assert list(got) == list(s)
        assert all(_same(s[k], got[k]) for k in s), got
    with pytest.raises(fmt.FormatError, match="not a WebDataset key"):
        wds.write_tar([{"__key__": "a.b", "cls": 1}])
    assert wds.split_name("dir/x.y/abc.seg.png") == ("dir/x.y/abc", "seg.png")
    assert wds.split_name("noext") is None
