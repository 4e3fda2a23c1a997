"""`plait sweep`: every mesh shape for N devices, compiled ahead of time, predicted, ranked.

- `shapes`: the candidates (the task's mesh axes and sweep settings) and which
  of them share a compiled program;
- `compiled`: compile on simulated CPU devices, read FLOPs, collectives and
  memory, extrapolate what the task says is linear;
- `cost`: the stated cost model on a hardware description (`plait.hardware`);
- `run`: the whole sweep, worker processes, `--run` measurements;
- `vary`: `--vary KEY=V1,V2`, settings besides the mesh tried on every shape;
- `journal`: each program's figures, and each `--run` time, appended as read, so a
  sweep cut short resumes.
Tables and plots of the results are in `plait.views.sweep`.
"""

from plait.sweep.compiled import COMPILER_OPTIONS, measure
from plait.sweep.cost import calibrate, predict
from plait.sweep.journal import NAME as JOURNAL
from plait.sweep.journal import RUNS
from plait.sweep.run import (
    MAX_SIMULATED,
    candidate_of,
    measure_runs,
    rank,
    run_sweep,
    schedule_names,
)
from plait.sweep.shapes import Candidate, enumerate_shapes
from plait.sweep.vary import combinations

__all__ = ["COMPILER_OPTIONS", "JOURNAL", "MAX_SIMULATED", "RUNS", "Candidate", "calibrate",
           "candidate_of", "combinations", "enumerate_shapes", "measure", "measure_runs",
           "predict", "rank", "run_sweep", "schedule_names"]
