"""A test whose pytest-xdist worker died (a signal, an abort from C++) runs once more.

Native code rarely takes a whole worker down in a test that passes on every other run
(CI of 2026-11-25: tests/test_local_sgd.py's first test, a fatal signal after the
native error's message had scrolled out of the kept output; that test alone and the
whole suite passed on every run here before and since). A crash loses the worker and everything
the test could have told, so it says nothing about plait; the test is run again on a
fresh worker, and a second crash fails it. A Python failure (an assertion, an
exception) is never run again. Each rerun is named in the summary.

Loaded by conftest.py; tests/test_crash_rerun.py runs it on tests that abort.
"""

from __future__ import annotations

import faulthandler
import os
import sys

import pytest

_crashed: dict[str, str] = {}  # nodeid -> the worker it took down (controller side)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched) -> None:
    if crashitem in _crashed:
        return  # crashed twice: the report stays "failed"
    worker = getattr(report, "node", None)  # xdist sets it before this hook
    _crashed[crashitem] = worker.gateway.id if worker is not None else "?"
    sched.mark_test_pending(crashitem)
    report.outcome = "rerun"


def pytest_report_teststatus(report: pytest.TestReport):
    if report.outcome == "rerun":
        return "rerun", "R", ("RERUN", {"yellow": True})
    return None


def pytest_terminal_summary(terminalreporter) -> None:
    if _crashed:
        terminalreporter.section("crashed workers", sep="=", yellow=True)
    for nodeid, worker in _crashed.items():
        terminalreporter.write_line(
            f"CRASH {nodeid}: worker {worker} died running it; it ran once more on a "
            "fresh worker (its outcome is in the summary)", yellow=True)


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin
def pytest_configure(config: pytest.Config) -> None:
    # The crashing thread's stack only: pytest's handler dumps every thread's, which
    # pushes the native error's message (XLA's fatal log, just above the dump) off the
    # tail of the output that CI keeps. The same stream pytest's handler writes to.
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, ValueError):  # xdist's workers replace sys.stderr
        fd = sys.__stderr__.fileno()
    faulthandler.enable(file=os.dup(fd), all_threads=False)
