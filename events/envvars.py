"""Every ``SHOAL_*`` environment variable, with its meaning and default: the one place their
names are spelled. Writers (the CLI, the node agent, the chaos soak, the demo) and readers
(the modules named under each) import them from here; tests and benches may too.

Each is an :class:`EnvVar`: a ``str`` (its name, so it is a key of ``os.environ`` and of a
child's environment as it is) that also knows its meaning and its default, and reads itself
with :meth:`EnvVar.get` (unset or empty: the default).

=================================  ==========================================================
name                               read by
=================================  ==========================================================
``SHOAL_HOME``                     ``ops/embedded.py`` (the embedded server's files)
``SHOAL_NODE``                     ``ops/launch.py`` (a queue agent's node name)
``SHOAL_AGENT_DIR``                ``ops/launch.py`` (a queue agent's run directory)
``SHOAL_LAUNCH_META_INTERVAL``     ``ops/launch.py``
``SHOAL_API_TOKEN``                ``ops/api/auth.py``
``SHOAL_IFACE``                    ``worker/process_group.py``; written by ``ops/cli.py``
``SHOAL_WORKER_ID_FILE``           ``worker/membership.py``; written by ``worker/agent.py``
``SHOAL_AGENT_PID``                ``worker/lifeline.py``; written by ``worker/agent.py``
``SHOAL_ORPHAN_REDIS_S``           ``worker/lifeline.py``
``SHOAL_BACKEND`` ...              ``worker/placement.py`` (written and read there)
``SHOAL_RENDEZVOUS_LEGACY``        ``worker/store.py`` (benches only)
``SHOAL_LEDGER_DIR``               ``worker/ledger.py``; written by tests, the demo, the soak
``SHOAL_LEDGER_DIGESTS``           ``worker/training.py``; written by tests
``SHOAL_EXPORT_DIR``               ``worker/training.py``; written by tests and the soak
``SHOAL_FAULTS`` ...               ``core/faults.py``; written by tests and the soak
``SHOAL_REDIS_WAIT_MS`` ...        ``core/durable.py``, ``core/connection.py``
``SHOAL_CHECKPOINT_HMAC_KEY``      ``storage/manifest.py``
``SHOAL_STREAM_CACHE_ROOT``        ``storage/streaming.py``
``SHOAL_STEP_PACE`` ...            ``examples/digits.py``; written by the chaos soak
``SHOAL_LM_*``                     ``examples/lm.py``; written by tests and benches
=================================  ==========================================================

Variables of the deployment scripts (``deploy/*.sh``: ``SHOAL_REDIS_NODES``,
``SHOAL_SENTINELS`` ...) are read by those shell scripts only and documented in
``docs/deploy.md``; variables of the tests (``SHOAL_TEST_*``) and benches (``SHOAL_BENCH_*``)
belong to them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


class EnvVar(str):
    """An environment variable's name (the ``str`` itself), its :attr:`meaning` and its
    :attr:`default` (the value an unset or empty variable stands for; "" : none, or a default
    computed by its reader, which the meaning states)."""

    meaning: str
    default: str

    def __new__(cls, name: str, meaning: str, default: str = "") -> "EnvVar":
        var = super().__new__(cls, name)
        var.meaning = meaning
        var.default = default
        ALL[name] = var
        return var

    def __reduce__(self):  # pickled (a multiprocessing child's environment) as its plain name
        return (str, (str(self),))

    def get(self, environ: Mapping[str, str] | None = None) -> str:
        """The value in ``environ`` (default: ``os.environ``); the default when it is unset or
        empty."""
        value = (os.environ if environ is None else environ).get(self, "")
        return value or self.default


#: name -> variable, every one of this module.
ALL: dict[str, EnvVar] = {}

# ---- operator tooling ------------------------------------------------------------------------
HOME = EnvVar("SHOAL_HOME", "shoal's own files on this machine (the embedded Redis server's directory is "
                            "<home>/redis); unset: ~/.shoal")
NODE = EnvVar("SHOAL_NODE", "a queue node agent's node name (set by `shoal agent --queue --node`, read by its "
                            "launch units); unset: the host name")
AGENT_DIR = EnvVar("SHOAL_AGENT_DIR", "a queue node agent's run directory (`--run-dir`): its launch units' "
                                      "logs and worker-id files; unset: <home>/agent")
LAUNCH_META_INTERVAL = EnvVar("SHOAL_LAUNCH_META_INTERVAL", "seconds between a launch unit's progress reports "
                                                            "to its RQ job's meta", "3")
API_TOKEN = EnvVar("SHOAL_API_TOKEN", "the HTTP API's bearer token (at least 16 characters, no spaces); unset: "
                                      "the server is read-only (`shoal serve --token-file` replaces it)")

# ---- the node agent and its workers -----------------------------------------------------------
IFACE = EnvVar("SHOAL_IFACE", "the network interface whose address gloo advertises to the peers (`--iface` of "
                              "`shoal worker` and `shoal agent`); unset: the one that reaches Redis")
WORKER_ID_FILE = EnvVar("SHOAL_WORKER_ID_FILE", "a file the worker writes its worker id to once it joined, so "
                                                "that its node agent can name it when it reports its exit (set "
                                                "by the agent per slot)")
AGENT_PID = EnvVar("SHOAL_AGENT_PID", "the pid of the node agent that started this worker (set by the agent): "
                                      "the worker is orphaned once its parent is no longer that process")
ORPHAN_REDIS_S = EnvVar("SHOAL_ORPHAN_REDIS_S", "seconds an orphaned worker goes on without an answer from Redis "
                                                "before it exits (a number > 0)", "60")
BACKEND = EnvVar("SHOAL_BACKEND", "the collective backend the node agent chose for this worker (nccl, gloo)")
DEVICE = EnvVar("SHOAL_DEVICE", "the model device the node agent chose for this worker (cuda, cpu)")
PLACEMENT = EnvVar("SHOAL_PLACEMENT", "why the node agent chose that backend and device, for people")
RENDEZVOUS_LEGACY = EnvVar("SHOAL_RENDEZVOUS_LEGACY", "1: the rendezvous of before issue 17 (benches only, to "
                                                      "compare both in one run)")
LEDGER_DIR = EnvVar("SHOAL_LEDGER_DIR", "a directory each worker appends its committed steps to (the ledger "
                                        "that proves exactly-once); unset: no ledger")
LEDGER_DIGESTS = EnvVar("SHOAL_LEDGER_DIGESTS", "1: each ledger entry also holds the digest of the worker's "
                                              "weights after the step (tests compare the members'); unset: none")
EXPORT_DIR = EnvVar("SHOAL_EXPORT_DIR", "a directory each worker saves its final weights to when the job "
                                        "completes (final-<worker>.pt); unset: none saved")

# ---- faults (tests and the chaos soak) ----------------------------------------------------
FAULTS = EnvVar("SHOAL_FAULTS", "fault rules of the workers, WHO@N:PHASE:ACTION,... (core/faults.py); unset: none")
COORD_FAULTS = EnvVar("SHOAL_COORD_FAULTS", "fault rules of the coordinators, KIND@N:PHASE:ACTION,... "
                                            "(core/faults.py); unset: none")

# ---- Redis and storage ------------------------------------------------------------------------
REDIS_WAIT_MS = EnvVar("SHOAL_REDIS_WAIT_MS", "how long a durable write waits for a replica's confirmation, ms",
                       "500")
REDIS_WAIT_REPLICAS = EnvVar("SHOAL_REDIS_WAIT_REPLICAS", "replicas a durable write waits for (a whole number); "
                                                          "unset: 1 under Sentinel, else 0")
CHECKPOINT_HMAC_KEY = EnvVar("SHOAL_CHECKPOINT_HMAC_KEY", "the key (UTF-8) that signs and verifies checkpoint "
                                                          "manifests; unset: not signed")
STREAM_CACHE_ROOT = EnvVar("SHOAL_STREAM_CACHE_ROOT", "the directory under which a streaming dataset makes its "
                                                      "per-process caches; unset: <tmp>/shoal-stream-cache")

# ---- the examples -----------------------------------------------------------------------------
STEP_PACE = EnvVar("SHOAL_STEP_PACE", "seconds the paced example jobs sleep in every step", "0.03")
STEP_PACE_FILE = EnvVar("SHOAL_STEP_PACE_FILE", "a file whose number replaces SHOAL_STEP_PACE, read again every "
                                                "second (the chaos soak steers it)")
LM_LAYERS = EnvVar("SHOAL_LM_LAYERS", "the example GPT's layers (build_large: 12)", "4")
LM_D_MODEL = EnvVar("SHOAL_LM_D_MODEL", "the example GPT's width (build_large: 1536)", "256")
LM_HEADS = EnvVar("SHOAL_LM_HEADS", "the example GPT's attention heads (build_large: 16)", "4")
LM_SEQ_LEN = EnvVar("SHOAL_LM_SEQ_LEN", "the example GPT's sequence length", "128")
LM_LR = EnvVar("SHOAL_LM_LR", "the example GPT's learning rate", "2e-3")
