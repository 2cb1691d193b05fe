"""Run-time settings read from ``MPICOMM_*`` environment variables.

Every setting is also a keyword argument of the function that uses it; the environment
variable only supplies the default, so a job can be reconfigured from ``mpiexec -x`` /
``mpiexec -genv`` without editing the training script.

==================================  ==========================================================
variable                            meaning
==================================  ==========================================================
``MPICOMM_CHECK``                   ``1``: checked mode (ranks cross-check every collective's
                                    operation, shape and dtype before running it).
``MPICOMM_CUDA_AWARE``              ``auto`` (default), ``1`` or ``0``: pass CUDA pointers to
                                    MPI directly, or stage through pinned host memory (``1``
                                    is refused with ``ValueError`` when the MPI library's
                                    own query says it has no CUDA support).
``MPICOMM_ABORT_ON_ERROR``          ``1`` (default): an uncaught exception on any rank calls
                                    ``MPI_Abort`` so that the job ends instead of hanging,
                                    with one message (:mod:`mpicomm.abort`).
``MPICOMM_TRACEBACK``               ``1``: that message has the traceback even for an error
                                    raised the same way on every rank (default: one line).
``MPICOMM_LOG_LEVEL``               level of the ``mpicomm`` logger (default ``WARNING``).
``MPICOMM_RING_SEGMENT_BYTES``      bytes per pipelined segment of the ring passes (default
                                    1 MiB, an integer >= 1). Must be the same on every rank:
                                    checked mode compares it before each collective.
``MPICOMM_STAGING_CHUNK_BYTES``     bytes per asynchronous copy when CUDA data is staged
                                    through pinned host memory (default 4 MiB, an integer
                                    >= 1; :mod:`mpicomm.staging` has the tuning advice).
                                    Changes no message: ranks may differ.
``MPICOMM_METRICS``                 path of a per-step metrics JSON-lines file
                                    (:mod:`mpicomm.observe.metrics`; ``{rank}``: one per
                                    rank).
``MPICOMM_TIMELINE``                path of a merged Chrome trace of every collective, written
                                    by rank 0 at exit (:mod:`mpicomm.observe.trace`).
``MPICOMM_STALL_S``                 seconds a collective may wait before the stall inspector
                                    reports who has not arrived (:mod:`mpicomm.observe.stall`;
                                    ``0``: off; checked mode defaults to 300).
``MPICOMM_MPIEXEC``                 the launcher ``python -m mpicomm run`` and the tests use
                                    (default: the ``mpiexec`` beside this Python, else PATH).
``MPICOMM_PS_SPLIT_BYTES``          parameter server: keys of at least this many bytes are
                                    split over all servers (default 65536, an integer >= 1).
``MPICOMM_PS_CHUNK_BYTES``          parameter server: dense pieces larger than this are cut
                                    into chunks that ``KVStore.push_pull`` pipelines (default
                                    2097152 across hosts, 0 on one host; 0: none;
                                    :mod:`mpicomm.ps.sharding`).
``MPICOMM_PS_SPIN_US``              parameter server: microseconds a waiting server or worker
                                    keeps probing (yielding the CPU between probes) before it
                                    sleeps (default 1000000 where the host has a core per
                                    rank, else 200; :func:`mpicomm.ps.wire.spin_window_s`);
``MPICOMM_PS_MAX_SLEEP_US``         ... and its longest sleep between probes (default 1000):
                                    the worst added latency of a reply after an idle period.
``MPICOMM_PS_SERVERS``              parameter-server ranks, set by ``python -m mpicomm run
                                    --servers S`` (read with ``mpicomm.cli.ps_servers``;
                                    ``examples/train_ps.py`` takes it as ``--servers``).
``MPICOMM_CLOCK``                   ``wall`` (default) or ``virtual``: every timing mpicomm
                                    reads comes from :mod:`mpicomm.clock` (virtual: a
                                    simulated cluster's time, load-independent);
``MPICOMM_VIRTUAL_RATE``            virtual clock: each host's link rate (``1gbit``);
``MPICOMM_VIRTUAL_DELAY``           ... one-way latency between hosts (``100us``);
``MPICOMM_VIRTUAL_RANKS_PER_HOST``  ... ranks per host R (default 1);
``MPICOMM_HOST_SIZES``              ... consecutive ranks per host (``2,2,1``; wins over R);
``MPICOMM_HOST_NICS``               network ports per host (default 1; local rank j on port
                                    j mod N): the two-link cost model and the virtual links;
``MPICOMM_VIRTUAL_SCHEDULE``        ... a schedule file of rate/delay changes;
``MPICOMM_VIRTUAL_SHM_RATE``        ... shared memory within a host (default ``80gbit``)
``MPICOMM_VIRTUAL_SHM_DELAY``       ... and its latency (default ``1us``);
``MPICOMM_VIRTUAL_FRAMING``         ... headers per frame on the links between hosts
                                    (``none``, ``tcp`` or ``PAYLOAD,HEADER``);
``MPICOMM_VIRTUAL_COSTS``           ... the compute cost table to reuse (JSON; see
                                    :mod:`mpicomm.costtable`; ``docs/virtual-clock.md``).
``MPICOMM_VIRTUAL_STALL_S``         ... real seconds a waiting rank tolerates no virtual
                                    progress before it ends the job (default 120).
``MPICOMM_EMU_HOSTS``               emulated cluster (set by ``launchers/emulated-cluster``,
                                    never by hand): number of hosts H;
``MPICOMM_EMU_RANKS_PER_HOST``      ranks per host R (world rank r lives on host ``r // R``);
``MPICOMM_EMU_RATE``                the configured link rate, for reports;
``MPICOMM_EMU_BURST``               the links' token-bucket size in bytes (``--burst``), for
                                    reports;
``MPICOMM_EMU_QUEUE``               the links' queue allowance in seconds (``--queue``), for
                                    reports;
``MPICOMM_EMU_SHAPING``             ``tbf``, or ``htb-ack-first`` with ``--ack-priority``, for
                                    reports;
``MPICOMM_EMU_DELAY``               injected one-way delay in seconds between hosts;
``MPICOMM_EMU_DELAY_FILE``          file with the current delay, rewritten by ``--schedule``;
``MPICOMM_EMU_SCHEDULE``            the schedule file, for reports;
``MPICOMM_EMU_STEP_FILE``           where ``report_step`` writes the step (see
                                    ``mpicomm.emulate.linkdelay``).
``MPICOMM_CHECKPOINT_DIR``          where :mod:`mpicomm.checkpoint` keeps checkpoints (set by
                                    ``python -m mpicomm run --checkpoint-dir DIR``).
``MPICOMM_RESTART``                 restarts so far, set by ``python -m mpicomm run --restarts``.
``MPICOMM_RESTART_FAILED_AT``       set on a restart: ``time.time()`` when the failed
                                    attempt's launcher exited.
``MPICOMM_RESTART_LAUNCHED_AT``     set on a restart: ``time.time()`` when this attempt
                                    was started (the restart's phases).
``MPICOMM_CACHE_DIR``               where :mod:`mpicomm.workloads` keeps generated data sets
                                    and corpus indexes (default ``$XDG_CACHE_HOME/mpicomm``,
                                    else ``~/.cache/mpicomm``).
==================================  ==========================================================

Every value is checked where it is read: an unreadable one raises ``ValueError`` naming
the variable (inside a collective's argument checks, so on every rank in checked mode).
"""

from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def env_flag(name: str, default: bool) -> bool:
    """Read a boolean ``MPICOMM_*`` variable; raise ``ValueError`` on an unreadable value."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def env_int(name: str, default: int, low: int | None = None) -> int:
    """Read an integer ``MPICOMM_*`` variable (``>= low``); ``ValueError`` otherwise."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer") from None
    if low is not None and value < low:
        raise ValueError(f"{name}={raw!r}: expected an integer >= {low}")
    return value


#: Default of ``MPICOMM_RING_SEGMENT_BYTES``.
RING_SEGMENT_BYTES = 1 << 20


def ring_segment_bytes() -> int:
    """``MPICOMM_RING_SEGMENT_BYTES`` (checked; read on every call, so it is never stale)."""
    return env_int("MPICOMM_RING_SEGMENT_BYTES", RING_SEGMENT_BYTES, 1)


#: Default of ``MPICOMM_STAGING_CHUNK_BYTES``.
STAGING_CHUNK_BYTES = 4 << 20


def staging_chunk_bytes() -> int:
    """``MPICOMM_STAGING_CHUNK_BYTES`` (checked; read on every call)."""
    return env_int("MPICOMM_STAGING_CHUNK_BYTES", STAGING_CHUNK_BYTES, 1)


def env_choice(name: str, choices: tuple[str, ...], default: str) -> str:
    """Read an enumerated ``MPICOMM_*`` variable; raise ``ValueError`` outside ``choices``."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return value
