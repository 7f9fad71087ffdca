"""``shoal dataset``: write and inspect streaming datasets (:mod:`shoal.storage.streaming`).

``shoal dataset pack SOURCE OUTPUT [--format packed|webdataset] [--shard-size 64MiB] [--shard-samples N]``
    SOURCE: a directory (one sample per file: ``name``, ``data``) or ``module:function``
    returning an iterable of dicts; OUTPUT: a directory, ``file:///abs/dir`` or
    ``s3://bucket/prefix``. Shards first, ``index.json`` last; on any error what was written
    is removed and the exit status is non-zero with one line naming the cause.
``shoal dataset index URI``
    Index the WebDataset ``*.tar`` shards under URI (sample counts and byte offsets).
``shoal dataset verify URI``
    Hash every shard against the index; exit 1 with one line naming the bad ones.
``shoal dataset info URI [--json]``
    Shards, samples, bytes and formats of a dataset.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from pathlib import Path

from shoal.core.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``1000000``, ``64MB`` (10^6) or ``64MiB`` (2^20); argparse type."""
    m = _SIZE.match(text)
    if not m or (m.group(3) and not m.group(2) and m.group(3).lower() != "b"):
        raise argparse.ArgumentTypeError(f"expected a size in bytes like 67108864, 64MB or 64MiB, got {text!r}")
    n, unit, binary = int(m.group(1)), m.group(2).lower(), m.group(3).lower().startswith("i")
    power = "kmgt".index(unit) + 1 if unit else 0
    value = n * (1024 if binary else 1000) ** power
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def add_parser(sub: argparse._SubParsersAction) -> None:
    ds = sub.add_parser("dataset", help="write (pack, index) and inspect streaming datasets")
    dsub = ds.add_subparsers(dest="action", required=True)
    pk = dsub.add_parser("pack", help="turn files of a directory or a Python iterable into shards + index")
    pk.add_argument("source", help="a directory (one sample per file) or module:function returning dicts")
    pk.add_argument("output", help="a directory, file:///abs/dir or s3://bucket/prefix (must hold no index yet)")
    pk.add_argument("--format", choices=["packed", "webdataset"], default="packed",
                    help="shard format: shoal's packed format (default) or WebDataset tars")
    pk.add_argument("--shard-size", type=parse_size, default=None,
                    help="largest shard in bytes, e.g. 67108864, 64MB, 64MiB (default 64MiB unless --shard-samples)")
    pk.add_argument("--shard-samples", type=_positive_int, default=None,
                    help="at most this many samples per shard (the same boundaries in both formats)")
    pk.add_argument("--index-key", default="index.json", help="name of the index object (default index.json)")
    pk.set_defaults(func=cmd_pack)
    ix = dsub.add_parser("index", help="write index.json for the WebDataset .tar shards under a URI")
    ix.add_argument("uri", help="a directory, file:///abs/dir or s3://bucket/prefix holding *.tar shards")
    ix.add_argument("--index-key", default="index.json", help="name of the index object (default index.json)")
    ix.set_defaults(func=cmd_index)
    vf = dsub.add_parser("verify", help="hash every shard against the index (exit 1 naming the bad ones)")
    vf.add_argument("uri", help="a directory, file:///abs/dir or s3://bucket/prefix")
    vf.add_argument("--index-key", default="index.json", help="name of the index object (default index.json)")
    vf.set_defaults(func=cmd_verify)
    inf = dsub.add_parser("info", help="shards, samples and bytes of a dataset")
    inf.add_argument("uri", help="a directory, file:///abs/dir or s3://bucket/prefix")
    inf.add_argument("--index-key", default="index.json", help="name of the index object (default index.json)")
    inf.add_argument("--json", action="store_true", help="one JSON object (for scripts)")
    inf.set_defaults(func=cmd_info)


def _store(uri: str, *, create: bool):
    from shoal.storage.uri import open_store

    if "://" not in uri and not uri.startswith("/"):
        uri = str(Path(uri).absolute())
    if uri.startswith("memory:"):
        raise ConfigError("memory:// datasets do not outlive this command: use a directory or s3://")
    if not create and uri.startswith(("/", "file:")):
        from urllib.parse import unquote, urlsplit

        folder = Path(unquote(urlsplit(uri).path) if uri.startswith("file:") else uri)
        if not folder.is_dir():  # opening the store would create it
            raise ConfigError(f"no dataset directory {folder}")
    return open_store(uri, create_bucket=create)


def cmd_pack(args: argparse.Namespace) -> int:
    from shoal.storage.streaming_pack import DEFAULT_SHARD_SIZE, iter_source, pack

    samples = iter_source(args.source)
    local = None if "://" in args.output and not args.output.startswith("file://") else args.output
    existed = local is not None and Path(local.removeprefix("file://")).exists()
    store = _store(args.output, create=True)

    def progress(n: int, shards: int) -> None:
        if sys.stderr.isatty():
            print(f"\r{n} samples, {shards} shards", end="", file=sys.stderr, flush=True)

    size = args.shard_size if args.shard_size is not None or args.shard_samples else DEFAULT_SHARD_SIZE
    try:
        index = pack(samples, store, format=args.format, shard_size=size, shard_samples=args.shard_samples,
                     index_key=args.index_key, progress=progress)
    except BaseException:
        root = store.local_path("x")
        if local is not None and not existed and root is not None:
            with contextlib.suppress(OSError):
                root.parent.rmdir()  # the output directory this command made, left empty
        raise
    if sys.stderr.isatty():
        print(file=sys.stderr)
    n = sum(s.samples or 0 for s in index.shards)
    size = sum(s.size for s in index.shards)
    print(f"packed {n} samples into {len(index.shards)} {args.format} shards ({size} bytes) at {store.uri}")
    return 0


def cmd_index(args: argparse.Namespace) -> int:
    from shoal.storage.streaming_pack import index_tars

    store = _store(args.uri, create=False)
    index = index_tars(store, index_key=args.index_key)
    n = sum(s.samples or 0 for s in index.shards)
    print(f"indexed {n} samples in {len(index.shards)} webdataset shards at {store.uri}/{args.index_key}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from shoal.storage.streaming_pack import read_index

    store = _store(args.uri, create=False)
    index = read_index(store, args.index_key)
    shards = [{"name": s.name, "samples": s.samples, "bytes": s.size, "format": s.format} for s in index.shards]
    summary = {"uri": store.uri, "shards": len(shards), "samples": sum(s.samples or 0 for s in index.shards),
               "bytes": sum(s.size for s in index.shards),
               "formats": sorted({s.format or "unknown" for s in index.shards})}
    if args.json:
        print(json.dumps({**summary, "shard_list": shards}))
    else:
        print(f"{summary['uri']}: {summary['samples']} samples, {summary['shards']} shards, "
              f"{summary['bytes']} bytes, format {', '.join(summary['formats'])}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from shoal.storage.errors import ShardCorrupt
    from shoal.storage.streaming_pack import verify_dataset

    store = _store(args.uri, create=False)
    checked, problems = verify_dataset(store, args.index_key)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ShardCorrupt(f"{len(problems)} of {checked} shards of {store.uri} do not match the index: "
                           f"{'; '.join(problems[:3])}{more}")
    print(f"{checked} shards of {store.uri} match the index")
    return 0
