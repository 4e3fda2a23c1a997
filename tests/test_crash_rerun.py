"""tests/crash_rerun.py on a pytest-xdist run of its own (no JAX): a test that aborts
its worker once passes on the rerun, one that aborts it every time fails, and a Python
failure is not run again."""

import subprocess
import sys
from pathlib import Path

import pytest

TESTS = '''
import os
from pathlib import Path

def test_aborts_once():
    mark = Path(os.environ["CRASH_MARKS"]) / "once"
    if not mark.exists():
        mark.write_text("")
        os.abort()

def test_aborts_always():
    os.abort()

def test_fails_in_python():
    mark = Path(os.environ["CRASH_MARKS"]) / "python"
    mark.write_text(mark.read_text() + "x" if mark.exists() else "x")
    assert False
'''


@pytest.mark.slow
def test_a_crashed_worker_s_test_runs_once_more(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test_crashes.py").write_text(TESTS)
    (tmp_path / "t" / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "marks").mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-p", "crash_rerun", "-p",
         "no:cacheprovider", "-rA", str(tmp_path / "t")],
        cwd=tmp_path / "t", capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": str(Path(__file__).parent), "CRASH_MARKS": str(tmp_path / "marks"),
             "PATH": "/usr/bin:/bin"})
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "PASSED test_crashes.py::test_aborts_once" in text, text
    assert "FAILED test_crashes.py::test_aborts_always" in text, text
    assert "FAILED test_crashes.py::test_fails_in_python" in text, text
    assert (tmp_path / "marks" / "python").read_text() == "x"  # ran once
    assert "CRASH test_crashes.py::test_aborts_once" in text, text
    assert "CRASH test_crashes.py::test_aborts_always" in text, text
    # The aborting thread's stack only (pytest's own handler prints every thread's).
    assert text.count("most recent call first") == 3, text
