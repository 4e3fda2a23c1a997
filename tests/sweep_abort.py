"""Stand-ins for sweep.compiled's measure and worker init, in a module spawned workers
import cheaply: one mesh's "compile" ends its process, as an XLA check failure does.
And what a process started by plait.sweep.isolated sees."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class Shape:
    mesh: str
    pipeline: dict | None = None

    @property
    def label(self) -> str:
        return self.mesh


ABORTS = "tensor=2"


def init(n: int) -> None:
    pass


def measure(exp, c: Shape, n: int, per_node, kernels) -> tuple[dict, float]:
    if c.mesh == ABORTS:
        os._exit(134)  # what abort() leaves, without a core file
    return {"mesh": c.mesh}, 0.0


def sees() -> dict:
    """This process's devices, compile cache, allocator setting and logging filter."""
    import logging

    import jax

    return {"pid": os.getpid(), "devices": jax.device_count(),
            "cache": jax.config.jax_compilation_cache_dir,
            "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "unset"),
            "quiet": bool(logging.getLogger().handlers[0].filters)}
