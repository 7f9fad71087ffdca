"""MosaicML's ``mosaicml-streaming`` on the same data, for ``bench/streaming.py``'s side by side.

The parent bench calls :func:`ensure_installed`, :func:`write_mds` and :func:`run_job`; the
jobs themselves run this module as a torchrun script (``-m bench.streaming_mosaic train``),
written the way a MosaicML user would: MDS shards written by ``MDSWriter`` to
``s3://bucket/prefix`` on the same local S3 server (``S3_ENDPOINT_URL`` and the AWS key
variables, as its docs say), ``StreamingDataset(remote=..., local=cache dir, shuffle=True,
batch_size=per-rank batch)`` with its defaults otherwise (predownload, shuffle algorithm,
canonical nodes), a torch ``DataLoader`` with the same loader count and prefetch as shoal's
job, DDP (gloo) with the digits model, optimizer and global batch.

Each worker is its own "node" (torchrun ``--nnodes=W --nproc-per-node=1``, one agent per
node, each with its own ``local`` cache dir), as shoal's workers each have their own cache:
bytes downloaded are what a W-machine job would fetch. MosaicML's nodes coordinate their
processes through ``/dev/shm`` and lock files in the temp dir, which on one host would collide
(every node's leader registers the same first free prefix), so each node runs in its own
mount namespace with a fresh ``/dev/shm`` (``unshare -m``, root only) and its own ``TMPDIR``:
what separate machines would have. Without root the bench says so and skips it.

Install: its wheel depends on torch 2.14 (CUDA build), transformers and four cloud SDKs, none
of which may enter the project's venv (pinned CPU torch). :func:`ensure_installed` installs
``mosaicml-streaming`` with ``--no-deps`` plus only the small modules its import chain needs
(compression codecs, xxhash, tqdm, catalogue) into ``.bench-deps/mosaicml-streaming``
(git-ignored), put only on the jobs' ``PYTHONPATH``; ``transformers`` and ``torchvision``,
imported at module level by parts the bench never touches (the Hugging Face collate of
``StreamingDataLoader``, the text and vision dataset classes), get two-line stubs there.
boto3, numpy, torch and Pillow come from the project's venv.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEPS = ROOT / ".bench-deps" / "mosaicml-streaming"
VERSION = "0.13.0"
#: mosaicml-streaming without its dependencies, and the modules its ``import streaming`` needs
#: that the project's venv lacks (all small; the codecs are binary wheels)
REQUIREMENTS = [f"mosaicml-streaming=={VERSION}", "Brotli>=1.0.9", "python-snappy>=0.6.1,<1", "cramjam",
                "zstd>=1.5.2.5,<2", "xxhash>=3,<4", "tqdm>=4.64,<5", "catalogue>=2,<3"]
#: names imported at module level by parts of the library the bench does not use
STUBS = {
    "transformers/__init__.py": "",
    "transformers/feature_extraction_utils.py": "class BatchFeature(dict):\n    pass\n",
    "transformers/tokenization_utils_base.py": "class BatchEncoding(dict):\n    pass\n",
    "transformers/models/__init__.py": "",
    "transformers/models/auto/__init__.py": "",
    "transformers/models/auto/tokenization_auto.py": "class AutoTokenizer:\n    pass\n",
    "torchvision/__init__.py": "",
    "torchvision/datasets.py": "from torch.utils.data import Dataset as VisionDataset\n",
    "torchvision/transforms/__init__.py": "",
    "torchvision/transforms/functional.py": "def to_tensor(*args, **kwargs):\n    raise NotImplementedError('stub')\n",
}
_STUB_NOTE = "# a stub written by bench/streaming_mosaic.py: never used by the bench\n"


def _env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = os.pathsep.join([str(DEPS), str(ROOT)])
    return env | (extra or {})


def _probe() -> str | None:
    r = subprocess.run([sys.executable, "-c", "from streaming import MDSWriter, StreamingDataset"],
                       env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    if r.returncode == 0:
        return None
    lines = r.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit {r.returncode}"


def ensure_installed() -> str | None:
    """Install mosaicml-streaming into ``.bench-deps`` unless there; None when it imports, else
    one line saying why not (the bench prints it and goes on)."""
    marker = DEPS / f".installed-{VERSION}"
    if not marker.exists():
        tmp = DEPS.with_name(DEPS.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                                "--no-deps", "--target", str(tmp), *REQUIREMENTS],
                               capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"pip install failed: {e}"
        if r.returncode != 0:
            errors = [x for x in r.stderr.splitlines() if x.startswith("ERROR")] or r.stderr.strip().splitlines()
            return f"pip install --no-deps {REQUIREMENTS[0]} failed: {errors[-1] if errors else r.returncode}"
        for rel, text in STUBS.items():
            path = tmp / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_STUB_NOTE + text)
        shutil.rmtree(DEPS, ignore_errors=True)
        tmp.rename(DEPS)
        marker.touch()
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return "its nodes need a /dev/shm each (unshare -m): run the bench as root"
    why = _probe()
    return f"import streaming failed: {why}" if why else None


def s3_env(endpoint: str, access: str, secret: str) -> dict:
    """The variables mosaicml-streaming reads for an S3-compatible server."""
    return {"S3_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": access, "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": "us-east-1"}


def write_mds(remote: str, s3: dict, shard_bytes: int) -> int:
    """Write the bench's samples as MDS shards to ``remote`` (``s3://bucket/prefix``, the bucket
    created here); the shards' total bytes."""
    r = subprocess.run([sys.executable, "-m", "bench.streaming_mosaic", "write", remote, str(shard_bytes)],
                       env=_env(s3), cwd=ROOT, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"MDSWriter failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return int(r.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(remote: str, s3: dict, tmp: Path, workers: int, steps: int, epochs: int, global_batch: int = 64,
            loader_workers: int = 1, prefetch: int = 2, timeout: float = 600) -> dict:
    """One torchrun job of ``workers`` single-process nodes on this host; returns
    ``{"times": rank 0's step end times, "bytes": shard bytes in all nodes' caches}``."""
    tmp.mkdir(parents=True)
    port = _free_port()
    procs = []
    for node in range(workers):
        # its own /dev/shm (a private mount namespace) and temp dir: what a machine of its own has
        shm = "mount -t tmpfs -o size=512m shoal-bench-shm /dev/shm && exec \"$@\""
        (tmp / f"tmp-{node}").mkdir()
        cmd = ["unshare", "-m", "sh", "-c", shm, "sh", sys.executable, "-m", "torch.distributed.run",
               f"--nnodes={workers}", "--nproc-per-node=1", f"--node-rank={node}", "--master-addr=127.0.0.1", f"--master-port={port}", "-m",
               "bench.streaming_mosaic", "train", remote, str(tmp / f"local-{node}"),
               str(tmp / "times.json"), str(steps), str(epochs), str(global_batch // workers), str(loader_workers),
               str(prefetch)]
        log = open(tmp / f"node-{node}.log", "w")
        env = _env(s3 | {"OMP_NUM_THREADS": "1", "TMPDIR": str(tmp / f"tmp-{node}")})
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
        log.close()
    deadline = time.monotonic() + timeout
    try:
        for node, p in enumerate(procs):
            rc = p.wait(max(1.0, deadline - time.monotonic()))
            if rc != 0:
                tail = (tmp / f"node-{node}.log").read_text().strip().splitlines()[-3:]
                raise RuntimeError(f"mosaicml job node {node} exited {rc}: {' | '.join(tail)}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
    shard_bytes = sum(f.stat().st_size for d in tmp.glob("local-*") for f in d.rglob("shard.*.mds"))
    return {"times": json.loads((tmp / "times.json").read_text()), "bytes": shard_bytes}


# --- the children ------------------------------------------------------------------------------


def _write(remote: str, shard_bytes: int) -> None:
    import boto3
    from streaming import MDSWriter

    from bench.streaming import _samples

    bucket = remote.removeprefix("s3://").split("/", 1)[0]
    boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"]).create_bucket(Bucket=bucket)
    columns = {"x": "ndarray:float32", "y": "int", "payload": "bytes"}
    with MDSWriter(out=remote, columns=columns, size_limit=shard_bytes) as out:
        for s in _samples():
            out.write(s)
    client = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"])
    prefix = remote.removeprefix("s3://").split("/", 1)[1].rstrip("/") + "/"
    listed = client.list_objects_v2(Bucket=bucket, Prefix=prefix)["Contents"]
    print(sum(o["Size"] for o in listed if o["Key"].endswith(".mds")))


def _train(remote: str, local: str, out: str, steps: int, epochs: int, batch: int, loader_workers: int,
           prefetch: int) -> None:
    import torch
    import torch.distributed as dist
    from streaming import StreamingDataset
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader

    from bench.streaming import decode
    from shoal.examples.digits import make_model

    class Glyphs(StreamingDataset):
        def __getitem__(self, i):
            return decode(super().__getitem__(i))

    dist.init_process_group("gloo")
    dataset = Glyphs(remote=remote, local=local, shuffle=True, batch_size=batch)
    torch.manual_seed(1)
    model = DDP(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    loader = DataLoader(dataset, batch_size=batch, num_workers=loader_workers, prefetch_factor=prefetch)
    times: list[float] = []
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()
            optimizer.step()
            times.append(time.time())
            if len(times) >= steps:
                break
        if len(times) >= steps:
            break
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


if __name__ == "__main__":
    if sys.argv[1] == "write":
        _write(sys.argv[2], int(sys.argv[3]))
    elif sys.argv[1] == "train":
        a = sys.argv[2:]
        _train(a[0], a[1], a[2], *map(int, a[3:]))
