"""Joining a multi-process run: jax.distributed from flags or a launcher's environment,
with deliberate coordination timeouts (docs/reliability.md). Imports JAX only to join,
so the supervisor (plait.supervise) can ask `from_environment` without it."""

from __future__ import annotations

import os

from plait.errors import UserError


def from_environment() -> bool:
    """A launcher's environment: JAX's own variable, or one task of a multi-task srun
    (SLURM_PROCID is set by srun, not by salloc, so a lone plait never waits for peers)."""
    return bool(os.environ.get("JAX_COORDINATOR_ADDRESS")) or (
        int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_PROCID" in os.environ)


def check_port(port: int, said: str) -> None:
    """`said`: how the user wrote it, for the message."""
    if not 1 <= port <= 65535:
        raise UserError(f"{said} is not a TCP port; use one from 1 to 65535")


def check_coordinator(address: str) -> None:
    """HOST:PORT with a port and a host that resolves: JAX split the address itself and
    raised IndexError without a port, crashed (SIGSEGV) on a port that is not a number,
    took 70000, and waited minutes for a host that does not exist."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UserError(f"--coordinator {address!r} is not HOST:PORT (e.g. node0:1234, "
                        "the host of process 0 and a free port)")
    check_port(int(port), f"--coordinator {address}: port {port}")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port))
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(f"--coordinator {address}: the host {host} does not resolve "
                        f"({getattr(e, 'strerror', None) or e}); use the host of process 0"
                        ) from None


def seconds(name: str, default: int) -> int:
    text = os.environ.get(name, str(default))
    try:
        value = int(text)
    except ValueError:
        raise UserError(f"{name}={text!r} is not a whole number of seconds") from None
    if value < 1:
        raise UserError(f"{name} must be at least 1 second, got {value}")
    return value


def join(args) -> None:
    """Start jax.distributed from flags, or from a cluster launcher's environment."""
    from plait import mesh as mesh_lib

    flags = (args.coordinator, args.num_processes, args.process_id)
    explicit = any(f is not None for f in flags)
    if not explicit and not from_environment():
        return
    import jax

    if explicit:
        if None in flags:
            raise UserError("--coordinator, --num-processes and --process-id go together; "
                            "give all three")
        if not 0 <= args.process_id < args.num_processes:
            raise UserError(
                f"--process-id {args.process_id} is outside 0..{args.num_processes - 1}")
        check_coordinator(args.coordinator)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # Deliberate timeouts (docs/reliability.md): a process silent for HEARTBEAT seconds is
    # presumed dead and the run ends; a finishing process waits SHUTDOWN for the others.
    timeouts = {"heartbeat_timeout_seconds": seconds("PLAIT_HEARTBEAT_TIMEOUT_S", 30),
                "shutdown_timeout_seconds": seconds("PLAIT_SHUTDOWN_TIMEOUT_S", 60)}
    if explicit:
        jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                                   process_id=args.process_id, **timeouts)
    else:
        jax.distributed.initialize(**timeouts)
    try:  # known before the backend starts only through this private handle
        from jax._src import distributed

        count = distributed.global_state.num_processes or 1
    except (ImportError, AttributeError):  # pragma: no cover - JAX moved it
        count = args.num_processes or 1
    mesh_lib.set_pending_process_count(count)


def barrier(name: str) -> None:
    """Wait until every process of a multi-process run gets here (the coordination
    service's barrier, not a collective). On CPUs Gloo gives a process 30 s to find its
    peer at a collective's first use; a peer still compiling (a loaded machine, a
    bigger share of the model) would fail the run there. Waiting here first absorbs
    the difference, up to PLAIT_BARRIER_TIMEOUT_S (default 1800)."""
    import jax

    if jax.process_count() == 1:
        return
    from jax._src import distributed  # the client jax.distributed.initialize made

    client = distributed.global_state.client
    if client is None:  # a multi-process backend joined some other way (TPU pods)
        return
    client.wait_at_barrier(f"plait-{name}", seconds("PLAIT_BARRIER_TIMEOUT_S", 1800) * 1000)


def host_array(x):
    """Every value of `x` on this host as a NumPy array: a replicated scalar from this
    process's copy; a per-replica array gathered from every process when it spans
    several (each process must call this at the same step)."""
    import numpy as np

    if x.ndim == 0:
        return np.asarray(x.addressable_shards[0].data)
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(x)
