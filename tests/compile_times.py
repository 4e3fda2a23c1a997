"""Where the suite's time goes: `python -m pytest -n 2 --compile-times DIR` writes,
per test worker, each test's wall time and the seconds JAX spent in this process
tracing, lowering and compiling (by jitted function), from `jax.monitoring`'s
events, and how many of its compiles the persistent cache answered (a "compile" event
times those too: it spans the cache's read). `python benchmarks/suite_times.py DIR` sums
them. A test's `plait` subprocesses are in its wall time and, once waited for, in its CPU
time only."""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path

import jax.monitoring
import pytest

# JAX's duration events for the three stages of a jit's first call.
STAGES = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "compile"}
# Recorded inside a compile (before its duration event) when the persistent cache had it.
CACHE_HIT = "/jax/compilation_cache/cache_hits"


def _cpu() -> float:
    """CPU seconds of this process and of the children it has waited for: a test whose
    wall time is far above it waited (on a subprocess's timeout, a sleep, a lock) with
    a core to spare."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class CompileTimes:
    def __init__(self, out: Path):
        self.out, self.test = out, None
        self.tests: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.functions: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.hits: collections.Counter = collections.Counter()
        self.hit = False
        jax.monitoring.register_event_duration_secs_listener(self.heard)
        jax.monitoring.register_event_listener(self.counted)

    def counted(self, event: str, **_) -> None:
        if event == CACHE_HIT:
            self.hit = True

    def heard(self, event: str, secs: float, fun_name: str | None = None, **_) -> None:
        stage = STAGES.get(event)
        if stage is None:
            return
        test = self.test or "(outside tests)"
        self.tests[test][stage] += secs
        self.functions[f"{stage} {fun_name}"] += secs
        self.calls[f"{stage} {fun_name}"] += 1
        if stage == "compile":
            self.tests[test]["compiles"] += 1
            if self.hit:
                self.tests[test]["cache_hits"] += 1
                self.hits[f"{stage} {fun_name}"] += 1
            self.hit = False

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.test, t0, c0 = item.nodeid, time.perf_counter(), _cpu()
        yield
        self.tests[item.nodeid]["wall"] += time.perf_counter() - t0
        self.tests[item.nodeid]["cpu"] += _cpu() - c0
        self.test = None

    def pytest_sessionfinish(self, session):
        if not self.tests:  # pytest-xdist's controller: its workers ran the tests
            return
        self.out.mkdir(parents=True, exist_ok=True)
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        (self.out / f"{worker}.json").write_text(json.dumps({
            "tests": self.tests,
            "functions": {k: [v, self.calls[k], self.hits[k]]
                          for k, v in self.functions.items()}}))
