"""`plait train | inspect | sweep | schedule | plan | launch | sample | eval | import | export`
(and `plait data`'s handler from plait.cli_data).

Any mistake in the user's input ends in one line on stderr naming the problem
and the fix, with exit status 2 and no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from plait import cluster, output_paths, quiet, xla_flags
from plait.cli_args import parser
from plait.cli_data import cmd_data
from plait.errors import UserError, reported


def cmd_sample(args) -> int:
    from plait.sample import converse, sample

    if args.prompt is None:
        if not args.chat:
            raise UserError("give the text to continue with --prompt TEXT (or --chat alone "
                            "to converse: a message a line on standard input)")
        if sys.stdin.isatty():
            print("plait: a message a line; Ctrl-D ends the conversation", file=sys.stderr)
        answers = converse(args.run_dir, sys.stdin, args.tokens, args.temperature,
                           args.top_k, args.seed, args.step, args.system)
        for text, info in answers:
            print(text, flush=True)
            if info["left_out"]:
                print(f"plait: the oldest {info['left_out']} messages no longer fit "
                      f"model.seq_len and were left out", file=sys.stderr)
        return 0
    text, info = sample(args.run_dir, args.prompt, args.tokens, args.temperature,
                        args.top_k, args.seed, args.step, args.chat, args.system)
    print(text if args.chat else args.prompt + text)
    print(f"plait: {len(info['tokens'])} tokens from the checkpoint at step {info['step']} "
          f"(tokenizer: {info['tokenizer']})", file=sys.stderr)
    return 0


def cmd_eval(args) -> int:
    from plait.evaluate import evaluate
    from plait.sample import decoder_run

    step: int | str | None = args.step
    if step is not None and step != "all":
        try:
            step = int(step)
        except ValueError:
            raise UserError(f"--step takes a checkpoint's step or 'all', got '{step}'") from None
    if args.png and step != "all":
        raise UserError("--png draws the loss of every kept checkpoint; add --step all")
    run_dir = Path(args.run_dir)
    exp, _ = decoder_run(run_dir, "plait eval scores")
    # Written after the scoring: refused, if they must be, before it.
    if args.png:
        output_paths.picture(args.png, "--png")
    if args.json:
        output_paths.file(args.json, "--json", ".json")
    cluster.join(args)
    mesh = _mesh(args, exp, f"the [mesh] of {run_dir / 'config.toml'}")
    import jax

    writer = jax.process_index() == 0
    got = evaluate(run_dir, args.data, mesh, step, args.batch, args.max_batches,
                   args.dtype, args.seq_len, progress=writer)
    if not writer:  # every process scored its rows; process 0 reports
        return 0
    if got["note"]:
        print(f"plait: {got['note']}", file=sys.stderr)
    w = got["windows"]
    left = (f"; the first {got['batches']} of {got['all_batches']} batches"
            if got["batches"] < got["all_batches"] else "")
    if step == "all":
        from plait.views import evaluation

        evaluation.table(got["curve"], got["step"])
        if args.png:
            evaluation.draw(got["curve"], f"{run_dir} on {got['data']}", args.png)
    which = "best: step" if step == "all" else "step"
    counted = (f"{got['tokens']:,} tokens" if got["kept_targets"] is None else
               f"the {got['kept_targets']:,} targets its loss mask keeps of {got['tokens']:,} "
               "tokens")
    print(f"plait: {which} {got['step']} of {run_dir} on {got['data']}: loss "
          f"{got['loss']:.4f}, perplexity {got['perplexity']:.3f} over {counted} "
          f"({w} window{'s' * (w != 1)} of {got['seq_len']} on mesh {got['mesh']}{left})")
    if args.json:
        Path(args.json).write_text(json.dumps(got, indent=1) + "\n")
    return 0


def cmd_import(args) -> int:
    from plait.hf.convert import import_model

    if args.seq_len is not None and args.seq_len < 1:
        raise UserError(f"--seq-len must be at least 1, got {args.seq_len}")
    got = import_model(args.hf_dir, args.run_dir, args.seq_len)
    m = got["model"]
    tok = "its tokenizer" if got["tokenizer"] else "no tokenizer.json (byte-level ids)"
    print(f"plait: imported {got['architecture']} ({m['layers']} layers, d_model "
          f"{m['d_model']}, {', '.join(got['dtypes'])}) into {args.run_dir} with {tok}")
    trained = got["trained_positions"]
    if args.seq_len and isinstance(trained, int) and args.seq_len > trained:
        print(f"plait: note: --seq-len {args.seq_len} is past the {trained:,} positions "
              "config.json says the model was trained on (max_position_embeddings); its "
              "rotary positions extend there untrained: fine-tune at that length before "
              "relying on it")
    print(f"plait: fine-tune with: plait train {args.run_dir}/config.toml --run-dir "
          f"{args.run_dir} --set data.path=TOKENS.bin")
    return 0


def cmd_export(args) -> int:
    from plait.hf.convert import export_run

    got = export_run(args.run_dir, args.out, args.step, args.dtype)
    files = len(got["files"])
    print(f"plait: exported step {got['step']} as {got['architecture']} ({got['tensors']} "
          f"tensors{f' in {files} files' if files > 1 else ''}, "
          f"{got['bytes'] / 2**20:,.1f} MiB {args.dtype}) to {args.out}")
    return 0


def _setup(args):
    """Experiment, mesh spec, devices and Mesh: everything checked before any file is written."""
    from plait.config_files import load_experiment

    sets, said = list(args.sets), {}
    if getattr(args, "steps", None) is not None:
        sets.append(f"train.steps={args.steps}")
        said["train.steps"] = "--steps"
    exp = load_experiment(args.experiment, sets, said)
    if args.mesh == "auto":
        from plait.sweep.auto import auto_mesh

        return auto_mesh(args, exp)
    cluster.join(args)
    return exp, _mesh(args, exp, f"[mesh] of {args.experiment}")


def _mesh(args, exp, where: str):
    """The Mesh of --mesh, else the experiment's [mesh] (`where`), else every device on
    data. Divisibility is checked by the task, before anything is written."""
    from plait import mesh as mesh_lib

    if args.mesh:
        spec = mesh_lib.load_spec(args.mesh)
    elif exp.mesh:
        spec = mesh_lib.MeshSpec(dict(exp.mesh), where, cpu_fallback=True)
    else:
        spec = mesh_lib.MeshSpec({"data": -1}, "the default mesh")
    if args.devices is not None and args.devices < 1:
        raise UserError(f"--devices must be at least 1, got {args.devices}")
    n = mesh_lib.provision_devices(spec, args.devices)
    return mesh_lib.build_mesh(mesh_lib.resolve(spec, n), n, spec.dcn)


def _profile_window(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        start, stop = (int(x) for x in text.split(":"))
    except ValueError:
        raise UserError(f"--profile takes START:STOP step numbers, e.g. 10:15; got '{text}'"
                        ) from None
    if not 0 <= start < stop:
        raise UserError(f"--profile {text}: need 0 <= START < STOP")
    return start, stop


def cmd_train(args) -> int:
    profile = _profile_window(args.profile)
    exp, mesh = _setup(args)
    from plait.train.loop import train

    run_dir = Path(args.run_dir) if args.run_dir else Path("runs") / exp.name
    train(exp, mesh, run_dir, profile, args.from_step)
    return 0


def cmd_inspect(args) -> int:
    if args.compare_tensor_modes and args.devices is not None and not args.mesh:
        # the modes' meshes of --devices devices, not the experiment's [mesh] (whose size
        # refused --devices 4 for an 8-device mesh)
        args = argparse.Namespace(**{**vars(args), "mesh": "data=-1"})
    exp, mesh = _setup(args)
    from plait.inspect import compare_tensor_modes, inspect_step
    from plait.views.inspect import render, render_comparison

    if args.compare_tensor_modes:
        rows = compare_tensor_modes(exp, mesh.devices.size)
        if args.json:
            print(json.dumps({"experiment": exp.name, "devices": mesh.devices.size,
                              "modes": rows}))
        else:
            render_comparison(exp.name, rows)
        return 0
    hw = None
    if args.hardware:
        from plait.hardware import load_hardware

        hw = load_hardware(args.hardware)
    report = inspect_step(exp, mesh, hw)
    if args.json:
        print(json.dumps(report))
    else:
        render(report)
    return 0


def cmd_sweep(args) -> int:
    from plait import mesh as mesh_lib
    from plait import sweep
    from plait.config_files import load_experiment
    from plait.hardware import load_hardware
    from plait.tasks import task_class
    from plait.views.sweep import render, render_calibration, write_outputs

    exp = load_experiment(args.experiment, list(args.sets))
    if args.devices < 1:
        raise UserError(f"--devices must be at least 1, got {args.devices}")
    if args.devices > sweep.MAX_SIMULATED:
        raise UserError(f"--devices {args.devices} is more than plait simulates on one CPU "
                        f"({sweep.MAX_SIMULATED}); sweep a smaller slice")
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers must be at least 1, got {args.workers}")
    if args.top is not None and args.top < 1:
        raise UserError(f"--top must be at least 1, got {args.top}")
    for flag, value in (("--run-steps", args.run_steps), ("--run-rounds", args.run_rounds)):
        if value is not None and not args.run:
            raise UserError(f"{flag} says how --run measures; add --run to train the top "
                            f"shapes, or drop {flag}")
    args.run_steps = 6 if args.run_steps is None else args.run_steps
    args.run_rounds = 1 if args.run_rounds is None else args.run_rounds
    if args.run_steps < 2:
        raise UserError(f"--run-steps must be at least 2 (the first step compiles and is not "
                        f"timed), got {args.run_steps}")
    if args.run_rounds < 1:
        raise UserError(f"--run-rounds must be at least 1, got {args.run_rounds}")
    schedules = sweep.schedule_names(args.schedules)
    combos = sweep.combinations(args.experiment, list(args.sets), args.vary)
    if args.run:  # each shape trains in a process of its own, with the device's memory
        from plait.sweep.isolated import leave_device_memory

        leave_device_memory()
    mesh_lib.provision_devices(mesh_lib.MeshSpec({"data": args.devices}, "--devices"),
                               args.devices)
    hw = load_hardware(args.hardware or "cpu-2core")  # "auto" asks the devices just set up
    out = output_paths.directory(args.out or f"sweeps/{exp.name}-{args.devices}", "--out")
    t0 = time.perf_counter()
    failed: list[str] = []
    journal = out / sweep.JOURNAL
    try:
        rows = sweep.run_sweep(exp, args.devices, hw, workers=args.workers, kernels=args.run,
                               schedules=schedules, failed=failed, journal=journal,
                               fresh=args.fresh, combos=combos)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(f"{_lines(journal)} compiled programs are kept in {journal}; "
                                "the same command resumes from them") from None
    elapsed = time.perf_counter() - t0
    top = rows[: args.top] if args.top else rows
    fit = None
    if args.run:
        runs = out / sweep.RUNS
        try:
            sweep.measure_runs(exp, top, args.devices, args.run_steps, journal=runs,
                               fresh=args.fresh, rounds=args.run_rounds)
        except KeyboardInterrupt:
            raise KeyboardInterrupt(f"{_lines(runs)} measured step times are kept in {runs} "
                                    f"(and the compiled programs in {journal}); the same "
                                    "command resumes from them") from None
        fit = sweep.calibrate(rows)
        rows = sweep.rank(rows)  # calibrated, and a shape that did not run after those that did
        top = rows[: args.top] if args.top else rows
    meta = {"experiment": exp.name, "devices": args.devices, "hardware": hw.name,
            "unit": task_class(exp.model.kind).unit,
            "device_memory_bytes": hw.memory(args.devices), "sweep_s": elapsed,
            "calibration": fit, "compile_aborted": failed,
            "run": {"steps": args.run_steps, "rounds": args.run_rounds} if args.run else None}
    write_outputs(rows, out, meta)
    render(top, meta)
    if fit:
        render_calibration(rows, fit)
    if failed:
        print(f"plait: XLA aborted compiling {len(failed)} program(s), whose shapes are not "
              f"ranked: {'; '.join(failed)} (a compiler failure, not a shape that does not "
              "fit; `plait inspect` on one of these meshes shows it)")
    print(f"plait: {len(rows)} shapes in {elapsed:.0f}s; wrote {out / 'sweep.csv'}, sweep.json, "
          "sweep.png")
    return 0


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def cmd_plan(args) -> int:
    exp, mesh = _setup(args)
    from plait.tasks import make_task
    from plait.views.plan import render_plan

    report = make_task(exp, mesh).placement_report()
    if report is None:
        raise UserError(f"plait plan shows the embedding plan of a DLRM (model.kind = "
                        f"\"dlrm\"); {args.experiment} is a {exp.model.kind}, whose layout "
                        "plait inspect shows")
    render_plan(report, args.json)
    return 0


def cmd_launch(args) -> int:
    from plait.launch import launch

    return launch(args.processes, args.command_args, args.port)


def cmd_schedule(args) -> int:
    from plait.parallel import schedules
    from plait.views.schedule import show

    s = schedules.build(args.name, args.stages, args.microbatches, args.virtual_stages or 0)
    if args.png:
        output_paths.picture(args.png, "--png")
    show(s, args.json, args.png, args.recompute)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    quiet.quiet_libraries()
    command = {"train": cmd_train, "inspect": cmd_inspect, "data": cmd_data,
               "schedule": cmd_schedule, "sweep": cmd_sweep, "plan": cmd_plan,
               "launch": cmd_launch, "sample": cmd_sample, "eval": cmd_eval,
               "import": cmd_import,
               "export": cmd_export}[args.command]

    def run() -> int:
        xla_flags.apply_defaults()  # before any device is touched
        return command(args)

    return reported("plait", run)


def entry() -> None:
    """The `plait` command. A process of a multi-process run runs under a supervisor
    (plait.supervise) that turns a lost peer into one line. After a failed run it leaves
    with os._exit once its line is out: threads of the failed write (orbax, TensorStore)
    would otherwise print their own tracebacks while the interpreter shuts down."""
    from plait import supervise

    if supervise.needed(sys.argv[1:]):
        sys.exit(supervise.supervise(sys.argv[1:]))
    status = main()
    if status == 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


if __name__ == "__main__":
    entry()
