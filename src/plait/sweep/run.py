"""Running a sweep: compile every distinct program once (in worker processes when it
pays), predict every shape, rank; and `--run`: train the top shapes for a few steps."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from plait import mesh as mesh_lib
from plait.config import Experiment
from plait.errors import UserError
from plait.hardware import Hardware
from plait.progress import Display
from plait.sweep import compiled, cost
from plait.sweep.shapes import Candidate, anchors, enumerate_shapes, program_key

MAX_SIMULATED = 512
Program = list[Candidate]  # candidates compiled by one program


def schedule_names(text: str | None) -> tuple[str, ...] | None:
    """`--schedules gpipe,1f1b`: the pipeline schedules a sweep tries (None: all); an
    unknown name is refused as anywhere else (`schedules.kind`)."""
    from plait.parallel import schedules

    if text is None:
        return None
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    if not names:
        raise UserError(f"--schedules {text!r} names no schedule; choose from "
                        f"{', '.join(schedules.SCHEDULES)}")
    for name in names:
        schedules.kind(name)
    return names


def programs_of(exp: Experiment, n: int, schedules: tuple[str, ...] | None = None,
                combos: list[dict] | None = None
                ) -> tuple[list[list[Candidate]], dict[tuple, Program]]:
    """The candidates for n devices (each crossed with `combos`, the `--vary` settings) in
    groups that differ only by their microbatch count (pipeline shapes only of
    `schedules`, when given), and the distinct programs to compile for them: each group's
    anchors (`shapes.anchors`), those that compile alike once (`shapes.program_key`)."""
    if n > MAX_SIMULATED:
        raise UserError(f"--devices {n} is more than plait simulates on one CPU "
                        f"({MAX_SIMULATED}); sweep a smaller slice or on the target machine")
    cands, reasons = enumerate_shapes(exp, n, combos)
    if schedules is not None:
        cands = [c for c in cands if not c.pipeline or c.pipeline["schedule"] in schedules]
    if not cands:
        why = "; ".join(reasons[:3]) or "no factorisation"
        raise UserError(f"no mesh shape of {n} devices fits {exp.name}: {why}")
    groups: dict[tuple, list[Candidate]] = {}
    for c in cands:
        groups.setdefault(c.program_group(), []).append(c)
    programs: dict[tuple, Program] = {}
    for group in groups.values():
        for c in anchors(group):
            programs.setdefault(program_key(exp, c), []).append(c)
    return list(groups.values()), programs


def _label(program: Program) -> str:
    rep = program[0]
    if rep.pipeline:
        names = "/".join(dict.fromkeys(c.pipeline["schedule"] for c in program))
        return " ".join(x for x in (rep.mesh, names, f"N={rep.microbatches}",
                                    rep.varied_text) if x)
    return rep.label


def _compile_all(exp: Experiment, n: int, programs: list[Program], workers: int, progress: bool,
                 per_node: int | None = None, kernels: bool = False,
                 measure=compiled.timed_measure, init=compiled.worker_init):
    """Yield (program, figures, seconds) as each program is compiled and read; figures
    None where XLA aborted compiling it (in worker processes only: in this process an
    abort ends plait)."""
    from rich.progress import Progress

    done = 0

    def note(prog: Program, seconds: float) -> None:
        nonlocal done
        done += 1
        # Off a terminal, a line per program instead of the bar (logs, CI, nohup).
        shown.say(f"plait sweep: compiled {done}/{len(programs)} {_label(prog)} "
                  f"({seconds:.1f}s)")

    with Display(*Progress.get_default_columns(), shown=progress) as shown:
        bar = shown.bar
        task = bar.add_task(f"compiling {len(programs)} programs", total=len(programs))
        if workers == 1:
            for prog in programs:
                bar.update(task, description=f"compiling {_label(prog)}")
                figures, seconds = measure(exp, prog[0], n, per_node, kernels)
                note(prog, seconds)
                yield prog, figures, seconds
                bar.advance(task)
            return
        bar.update(task, description=f"compiling {len(programs)} programs in {workers} processes")
        for prog, figures, seconds in _compile_in_pool(exp, n, programs, workers, per_node,
                                                       kernels, measure, init):
            if figures is not None:
                note(prog, seconds)
            else:
                print(f"plait sweep: XLA aborted compiling {_label(prog)}; left out of the "
                      "ranking", file=sys.stderr, flush=True)
            yield prog, figures, seconds
            bar.update(task, description=f"compiled {_label(prog)}")
            bar.advance(task)


def _compile_in_pool(exp: Experiment, n: int, programs: list[Program], workers: int,
                     per_node: int | None, kernels: bool, measure, init):
    """Yield (program, figures, seconds) from `workers` processes, figures None for a
    program whose compile killed its process (an XLA check failure aborts it). A dead
    process breaks the whole pool, so those running then are compiled again one at a
    time, each in a pool of its own, which names the one that aborts, and a fresh pool
    goes on with the rest."""
    def submit(pool, prog: Program):
        return pool.submit(measure, exp, prog[0], n, per_node, kernels)

    todo = list(reversed(programs))
    while todo:
        lost = yield from _run_pool(todo, workers, submit, init, n)
        for prog in lost:
            if (yield from _run_pool([prog], 1, submit, init, n)):
                yield prog, None, 0.0


def _run_pool(queue: list[Program], size: int, submit, init, n: int):
    """Yield (program, figures, seconds) of the programs popped from `queue`, `size` at
    a time (no more: a process's death fails every call in flight), until it is empty;
    return the programs in flight when a process died (none if none did)."""
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
    from concurrent.futures.process import BrokenProcessPool
    from multiprocessing import get_context

    with ProcessPoolExecutor(size, mp_context=get_context("spawn"), initializer=init,
                             initargs=(n,)) as pool:
        running: dict = {}
        while queue or running:
            broken = False
            while queue and len(running) < size:
                prog = queue.pop()
                try:
                    running[submit(pool, prog)] = prog
                except BrokenProcessPool:  # a process died since the last wait
                    queue.append(prog)  # never ran: the next pool takes it
                    wait(running)  # every call in flight has ended or failed with it
                    broken = True
                    break
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                try:
                    figures, seconds = fut.result()
                except BrokenProcessPool:
                    broken = True
                    continue
                yield running.pop(fut), figures, seconds
            if broken:
                return list(running.values())
    return []


def run_sweep(exp: Experiment, n: int, hw: Hardware, progress: bool = True,
              workers: int | None = None, kernels: bool = False,
              schedules: tuple[str, ...] | None = None,
              failed: list[str] | None = None, journal: Path | None = None,
              fresh: bool = False, combos: list[dict] | None = None) -> list[dict]:
    """Compile every distinct program once, predict every shape, rank. `kernels`: count
    each program's kernels, for `--run`'s calibration (compiles slower). The shapes of a
    program XLA aborted compiling are left out; their meshes go into `failed`. With a
    `journal` file, each program's figures are appended to it as they are read and
    those it already holds for this sweep are read back, not compiled (`fresh`: none
    are). `combos`: settings to try on every shape (`sweep.vary`)."""
    groups, programs = programs_of(exp, n, schedules, combos)
    book = None
    if journal is not None:
        from plait.sweep.journal import Journal, sweep_identity

        book = Journal(journal, sweep_identity(exp, n, hw.devices_per_node, kernels), fresh)
    keys = {id(prog): key for key, prog in programs.items()}
    known = {key: book.get(key) for key in programs} if book else {}
    todo = [prog for key, prog in programs.items() if known.get(key) is None]
    if book and len(todo) < len(programs):
        print(f"plait sweep: {len(programs) - len(todo)} of {len(programs)} programs read "
              f"from {journal} (compiled by an earlier run of this sweep; --fresh compiles "
              "them again)", file=sys.stderr, flush=True)

    read: dict[tuple, tuple[dict | None, float]] = {
        key: known[key] for key in programs if known.get(key) is not None}
    if todo:
        for prog, figures, seconds in _compile_all(
                exp, n, todo, workers or compiled.default_workers(len(todo)), progress,
                hw.devices_per_node, kernels):
            if book:
                book.add(keys[id(prog)], _label(prog), figures, seconds)
            read[keys[id(prog)]] = figures, seconds
    if failed is not None:
        failed += [_label(prog) for key, prog in programs.items() if read[key][0] is None]

    rows: list[dict] = []
    for group in groups:
        done = {c.microbatches: (_label(programs[key]), *read[key])
                for c in anchors(group) for key in [program_key(exp, c)]
                if read[key][0] is not None}
        if len(done) < len(anchors(group)):  # XLA aborted compiling one: only the other
            group = [c for c in group if c.microbatches in done]
        figures = {N: f for N, (_, f, _) in done.items()}
        for c, r in zip(group, cost.predict_group(exp, group, figures, hw, n), strict=True):
            from_ = [done[c.microbatches]] if c.microbatches in done else done.values()
            r["compile_s"] = sum(s for _, _, s in from_)
            r["priced_from"] = " and ".join(label for label, _, _ in from_)
            rows.append(r)
    return rank(rows)


def rank(rows: list[dict]) -> list[dict]:
    """Fitting shapes first (not those `--run` could not run), then by predicted step
    time; `rank` numbered from 1."""
    rows.sort(key=lambda r: (not r["fits"] or "measured_error" in r, r["predicted_step_s"],
                             r["mesh"],
                             str(r.get("pipeline_schedule")),
                             r.get("pipeline_microbatches") or 0))
    for i, r in enumerate(rows, 1):
        r["rank"] = i
    return rows


def candidate_of(row: dict, n: int) -> Candidate:
    """The shape a result row stands for (its mesh and settings)."""
    sizes = mesh_lib.resolve(mesh_lib.load_spec(row["mesh"]), n)
    return Candidate(sizes, dict(row.get("settings") or {}), tuple(row.get("varied") or {}))


def train_one(exp: Experiment, cand: Candidate, n: int, steps: int) -> float | str:
    """The median step time of the shape `cand` trained for `steps` steps in this process
    (the first, which compiles, not counted), or the one line saying why it did not run."""
    from plait.errors import RunFailed
    from plait.train.loop import train_briefly

    try:
        summary = train_briefly(cand.experiment(exp), mesh_lib.build_mesh(cand.sizes, n), steps)
    except (UserError, RunFailed) as e:
        return str(e)
    times = [rec["step_time_s"] for rec in summary["records"][1:]]
    return float(np.median(times)) if times else "no step timed"


def train_in_own_process(exp: Experiment, cand: Candidate, n: int, steps: int) -> float | str:
    """`train_one` in a fresh process, as `plait train` runs (`plait.sweep.isolated`);
    a failure there, or the process's death, is the shape's one line."""
    from plait.sweep import isolated

    try:
        return isolated.call(train_one, exp, cand, n, steps, devices=n)
    except (isolated.ProcessDied, isolated.ProcessRaised) as e:
        return str(e)


def visits(count: int, rounds: int) -> list[tuple[int, int]]:
    """(round, row index) in the order `--run` trains them: round 1 in rank order, round 2
    back, and so on, so that a machine drifting slowly over the run (a CPU warming, a
    neighbour's load) weighs on every shape alike in the median of two or more rounds,
    not on the last ranks only."""
    order = []
    for r in range(1, rounds + 1):
        order += [(r, i) for i in (range(count) if r % 2 else reversed(range(count)))]
    return order


def measure_runs(exp: Experiment, rows: list[dict], n: int, steps: int = 6,
                 journal: Path | None = None, fresh: bool = False,
                 progress: bool = True, rounds: int = 1,
                 train: Callable[[Experiment, Candidate, int, int], float | str]
                 = train_in_own_process) -> None:
    """Train each row's shape for a few steps on the devices at hand, `rounds` times (see
    `visits`), each training in a process of its own (`train`: how); add the median over
    rounds of its median step time (`measured_step_s`, and each round's in
    `measured_rounds_s` when there are several). A shape that fails to run (too big for
    the devices after all, a failure of the step, its process killed) gets
    `measured_error`, its one line, said on stderr, and is not tried in later rounds; the
    others still run. With a `journal` file, each time is appended as measured, and those
    it holds for these shapes and rounds (the same experiment, steps, plait and machine)
    are read back, not measured again (`fresh`: none are). Progress: a bar on a
    terminal, else a line a shape and round."""
    from rich.progress import Progress

    from plait.sweep.journal import Measured, run_identity

    book = Measured(journal, run_identity(exp, n, steps), fresh) if journal else None
    times: list[dict[int, float]] = [{} for _ in rows]
    todo = []
    for round_, i in visits(len(rows), rounds):
        kept = book.get(rows[i], round_) if book else None
        if kept is None:
            todo.append((round_, i))
        else:
            times[i][round_] = kept
    if len(todo) < len(rows) * rounds:
        print(f"plait sweep: {len(rows) * rounds - len(todo)} of {len(rows) * rounds} step "
              f"times read from {journal} (measured by an earlier --run of this sweep on "
              "this machine; --fresh measures them again)", file=sys.stderr, flush=True)
    cands = [candidate_of(r, n) for r in rows]
    of_round = f" of {rounds} rounds" if rounds > 1 else ""
    # Visits to make: none of a shape that failed, in an earlier round or before.
    total = sum(1 for _, i in todo if "measured_error" not in rows[i])
    with Display(*Progress.get_default_columns(), shown=progress) as shown:
        bar = shown.bar
        task = bar.add_task(f"training {total} shapes{of_round}", total=total)
        done = 0
        for pos, (round_, i) in enumerate(todo):
            r, label = rows[i], cands[i].label
            at = f" round {round_}" if rounds > 1 else ""
            if "measured_error" in r:  # failed in an earlier round: not counted
                continue
            bar.update(task, description=f"training rank {r['rank']} ({label}){at}")
            got = train(exp, cands[i], n, steps)
            done += 1
            if isinstance(got, str):
                r["measured_error"] = got
                total -= sum(1 for _, j in todo[pos + 1:] if j == i)
                bar.update(task, total=total)
                print(f"plait sweep: rank {r['rank']} ({label}) did not run: {got}",
                      file=sys.stderr, flush=True)
            else:
                times[i][round_] = got
                if book:
                    book.add(r, round_, label, got)
                shown.say(f"plait sweep: trained {done}/{total} rank {r['rank']} ({label})"
                          f"{at}: {1e3 * got:.1f} ms a step")
            bar.advance(task)
    for r, got in zip(rows, times, strict=True):
        if "measured_error" in r or not got:
            r["measured_step_s"] = None
            continue
        r["measured_step_s"] = float(np.median(list(got.values())))
        if rounds > 1:
            r["measured_rounds_s"] = [got[j] for j in sorted(got)]
