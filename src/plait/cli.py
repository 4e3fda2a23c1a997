"""`plait train | inspect | sweep | schedule | plan | launch | data`.

Any mistake in the user's input ends in one line on stderr naming the problem
and the fix, with exit status 2 and no traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import plait
from plait import cluster, xla_flags
from plait.errors import RunFailed, UserError


def _quiet_libraries() -> None:
    """Keep the console for plait's own lines. Libraries' warnings and errors (orbax's
    tracebacks from a failed save, a corrupt checkpoint's ignored coroutines) go only to
    RUN_DIR/plait.log once a run directory is open (`plait.train.rundir.open_log`)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    try:
        import absl.logging

        absl.logging.set_verbosity(absl.logging.WARNING)
    except ImportError:  # pragma: no cover
        pass
    logging.basicConfig(format="plait: %(levelname)s: %(message)s", level=logging.WARNING)
    for handler in logging.getLogger().handlers:
        handler.addFilter(lambda r: r.name == "plait" or r.name.startswith("plait."))
    logging.captureWarnings(True)  # Python warnings become log records (py.warnings)
    sys.unraisablehook = _unraisablehook
    for name in ("orbax", "absl", "jax"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _unraisablehook(unraisable) -> None:
    """Errors native code reports after the fact (TensorStore completing a failed save's
    write on an asyncio loop that orbax already closed) go to the log file, not the
    console; anything else is printed as Python would."""
    value = unraisable.exc_value
    if isinstance(value, RuntimeError) and str(value) == "Event loop is closed":
        logging.getLogger("orbax.late").warning(
            "late error of a failed save",
            exc_info=(unraisable.exc_type, value, unraisable.exc_traceback))
        return
    sys.__unraisablehook__(unraisable)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", help="experiment file, e.g. experiments/quickstart.toml")
    p.add_argument("--mesh", help="mesh file (meshes/x.toml) or inline spec like data=2,tensor=4")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (value parsed as TOML); repeatable")
    p.add_argument("--devices", type=int, default=None,
                   help="devices the mesh uses (default: what the mesh needs; with a -1 axis, "
                        "every accelerator or one simulated device per CPU core)")
    p.add_argument("--coordinator", help="host:port of process 0, to join a multi-process run")
    p.add_argument("--num-processes", type=int, help="processes in the multi-process run")
    p.add_argument("--process-id", type=int, help="this process's index in the run")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="plait", description="Train one model over any device mesh.")
    ap.add_argument("--version", action="version", version=f"plait {plait.version()}")
    sub = ap.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train an experiment (resumes from --run-dir)")
    _common(t)
    t.add_argument("--run-dir", help="run directory (default: runs/<experiment name>)")
    t.add_argument("--steps", type=int, help="train to this many steps (sets train.steps; a "
                   "resumed run keeps its learning-rate schedule unless "
                   "optimizer.decay_steps is set)")
    t.add_argument("--from-step", type=int, metavar="N",
                   help="resume from the kept checkpoint of step N instead of the newest "
                        "(the newer ones are kept, renamed N.superseded)")
    t.add_argument("--profile", metavar="START:STOP",
                   help="write a jax.profiler trace of steps START+1..STOP into "
                        "RUN_DIR/profile (e.g. 10:15)")

    i = sub.add_parser("inspect", help="compile the train step and report FLOPs, "
                                       "collective bytes and memory per device")
    _common(i)
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.add_argument("--hardware", default=None,
                   help="price the collectives, within a host and across hosts, with this "
                        "hardware description's bandwidths and latencies (as plait sweep)")
    i.add_argument("--compare-tensor-modes", action="store_true",
                   help="compile the step under 1-D, 2-D, 2.5-D and 3-D tensor parallelism on "
                        "the mesh's device count (or --devices) and compare bytes and memory")

    sw = sub.add_parser("sweep", help="compile every mesh shape for N devices, predict step "
                                      "time and memory on target hardware, and rank them")
    sw.add_argument("experiment", help="experiment file")
    sw.add_argument("--devices", type=int, required=True, help="devices to sweep over (N)")
    sw.add_argument("--hardware", default=None,
                    help="hardware description: a meshes/NAME.toml with a [hardware] table "
                         "(default: cpu-2core)")
    sw.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (value parsed as TOML); repeatable")
    sw.add_argument("--top", type=int, default=None, help="rows to print (and to --run)")
    sw.add_argument("--run", action="store_true",
                    help="also train the top rows for a few steps here and add measured times")
    sw.add_argument("--out", default=None, help="directory for sweep.csv, .json and .png "
                                                "(default: sweeps/<experiment>-<N>)")
    sw.add_argument("--workers", type=int, default=None,
                    help="processes compiling in parallel (default: up to 4, by core count)")

    pl = sub.add_parser("plan", help="print a DLRM's embedding plan (kind and place of each "
                                      "table) and each device's memory")
    _common(pl)
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")

    la = sub.add_parser("launch", help="start P local processes joined by jax.distributed, "
                                       "e.g. plait launch --processes 2 -- train EXP --mesh data=8")
    la.add_argument("--processes", type=int, required=True, help="processes to start (P)")
    la.add_argument("--port", type=int, default=None, help="coordinator port (default: free)")
    la.add_argument("command_args", nargs=argparse.REMAINDER,
                    help="-- then a plait command (train or inspect) and its arguments")

    sc = sub.add_parser("schedule", help="print a pipeline schedule's table and figures")
    sc.add_argument("name", metavar="SCHEDULE",
                    help="gpipe, 1f1b, interleaved, chimera or zb-h1 "
                         "(plait.parallel.schedules.SCHEDULES)")
    sc.add_argument("--stages", type=int, required=True, help="pipeline ranks D")
    sc.add_argument("--microbatches", type=int, required=True, help="microbatches N")
    sc.add_argument("--virtual-stages", type=int, default=None,
                    help="stages per rank for schedules that interleave (default: the "
                         "schedule's, 2 for interleaved)")
    sc.add_argument("--recompute", action="store_true",
                    help="count the executor's buffers as pipeline.recompute = true does "
                         "(stage inputs stashed, the forward recomputed in the backward)")
    sc.add_argument("--json", action="store_true", help="print one JSON object")
    sc.add_argument("--png", help="also draw the table into this PNG file")
    d = sub.add_parser(
        "data", help="prepare data: a text file -> a token file (byte-level ids), or Criteo "
        "TSV days -> a directory training memory-maps",
        usage="plait data TEXT_FILE OUT.bin [--tokenizer tokenizer.json] [--dtype uint16|uint32]\n"
              "       plait data criteo DAY.tsv[.gz] [DAY ...] --out DIR [--malformed skip|stop]")
    d.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="TEXT_FILE OUT.bin, or the word criteo and Criteo TSV day files")
    d.add_argument("--out", help="criteo: the output directory (rerun to convert only new days)")
    d.add_argument("--dtype", choices=("uint16", "uint32"), default="uint16",
                   help="element type of the token file (uint16 for vocabularies up to 65536)")
    d.add_argument("--tokenizer", metavar="tokenizer.json",
                   help="encode with this Hugging Face tokenizers file (kept beside OUT.bin "
                   "and in the runs that train on it); default: byte-level ids 0-255")
    d.add_argument("--malformed", choices=("skip", "stop"), default="skip",
                   help="criteo: skip lines that do not parse (counted) or stop at the first")
    sp = sub.add_parser(
        "sample", help="generate text from a GPT run's checkpoint (KV cache, one device)",
        usage="plait sample RUN_DIR --prompt TEXT [--tokens N] [--temperature T] [--top-k K] "
              "[--seed S] [--step N]")
    sp.add_argument("run_dir", metavar="RUN_DIR", help="the --run-dir of a plait train run")
    sp.add_argument("--prompt", required=True, help="the text to continue")
    sp.add_argument("--tokens", type=int, default=100, help="how many tokens to generate")
    sp.add_argument("--temperature", type=float, default=1.0,
                    help="softmax temperature; 0 takes the most likely token every time")
    sp.add_argument("--top-k", type=int, default=0,
                    help="draw only among the K most likely tokens (0: all)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the draws")
    sp.add_argument("--step", type=int, help="a kept checkpoint's step (default: the newest)")
    return ap


def cmd_sample(args) -> int:
    from plait.sample import sample

    text, info = sample(args.run_dir, args.prompt, args.tokens, args.temperature,
                        args.top_k, args.seed, args.step)
    print(args.prompt + text)
    print(f"plait: {len(info['tokens'])} tokens from the checkpoint at step {info['step']} "
          f"(tokenizer: {info['tokenizer']})", file=sys.stderr)
    return 0


def _setup(args):
    """Experiment, mesh spec, devices and Mesh: everything checked before any file is written."""
    from plait import mesh as mesh_lib
    from plait.config import load_experiment

    sets = list(args.sets)
    if getattr(args, "steps", None) is not None:
        sets.append(f"train.steps={args.steps}")
    exp = load_experiment(args.experiment, sets)
    if args.mesh == "auto":
        from plait.sweep.auto import auto_mesh

        return auto_mesh(args, exp)
    if args.mesh:
        spec = mesh_lib.load_spec(args.mesh)
    elif exp.mesh:
        spec = mesh_lib.MeshSpec(dict(exp.mesh), f"[mesh] of {args.experiment}",
                                 cpu_fallback=True)
    else:
        spec = mesh_lib.MeshSpec({"data": -1}, "the default mesh")
    if args.devices is not None and args.devices < 1:
        raise UserError(f"--devices must be at least 1, got {args.devices}")
    cluster.join(args)
    n = mesh_lib.provision_devices(spec, args.devices)
    # Divisibility is checked by train.build.Job, before anything is written.
    return exp, mesh_lib.build_mesh(mesh_lib.resolve(spec, n), n, spec.dcn)


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
    from plait.config import load_experiment
    from plait.hardware import load_hardware
    from plait.tasks import task_class
    from plait.views.sweep import render, write_outputs

    exp = load_experiment(args.experiment, list(args.sets))
    if args.devices < 1:
        raise UserError(f"--devices must be at least 1, got {args.devices}")
    if args.devices > sweep.MAX_SIMULATED:
        raise UserError(f"--devices {args.devices} is more than plait simulates on one CPU "
                        f"({sweep.MAX_SIMULATED}); sweep a smaller slice")
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers must be at least 1, got {args.workers}")
    hw = load_hardware(args.hardware or "cpu-2core")
    mesh_lib.provision_devices(mesh_lib.MeshSpec({"data": args.devices}, "--devices"),
                               args.devices)
    t0 = time.perf_counter()
    rows = sweep.run_sweep(exp, args.devices, hw, workers=args.workers)
    elapsed = time.perf_counter() - t0
    top = rows[: args.top] if args.top else rows
    fit = None
    if args.run:
        sweep.measure_runs(exp, top, args.devices)
        fit = sweep.calibrate(rows)
        if fit:
            rows = sweep.rank(rows)
            top = rows[: args.top] if args.top else rows
    out = Path(args.out or f"sweeps/{exp.name}-{args.devices}")
    meta = {"experiment": exp.name, "devices": args.devices, "hardware": hw.name,
            "unit": task_class(exp.model.kind).unit,
            "device_memory_bytes": hw.memory(args.devices), "sweep_s": elapsed,
            "calibration": fit}
    write_outputs(rows, out, meta)
    render(top, meta)
    if fit:
        print(f"plait: overheads fitted to the {fit['measured_shapes']} measured shapes on "
              f"these devices: {fit['per_step_s'] * 1e3:.3g} ms per step + "
              f"{fit['per_kernel_s'] * 1e6:.3g} us per kernel, added to every prediction "
              "(they describe the machine measured, whatever --hardware says)")
        for r in [r for r in rows if r.get("measured_step_s")]:
            print(f"  {r['mesh']:<28} model {r['model_step_s'] * 1e3:8.3f} ms, calibrated "
                  f"{r['predicted_step_s'] * 1e3:8.3f} ms, measured "
                  f"{r['measured_step_s'] * 1e3:8.3f} ms ({r['kernels']:,.0f} kernels)")
    print(f"plait: {len(rows)} shapes in {elapsed:.0f}s; wrote {out}/sweep.csv, sweep.json, "
          "sweep.png")
    return 0


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
    show(s, args.json, args.png, args.recompute)
    return 0


def cmd_data(args) -> int:
    if args.inputs[0] == "criteo":
        from plait.data.criteo_bin import convert

        if not args.out:
            raise UserError("plait data criteo needs --out DIR (the directory to write)")
        if len(args.inputs) < 2:
            raise UserError("plait data criteo needs at least one Criteo TSV day file")
        manifest = convert(args.inputs[1:], args.out, args.malformed)
        rows = sum(p["rows"] for p in manifest["parts"])
        print(f"plait: {args.out} holds {rows:,} rows in {len(manifest['parts'])} part(s); use "
              f"data.source = \"criteo_bin\", data.path = \"{args.out}\"")
        return 0
    from plait.data.tokens import encode_text_file

    if len(args.inputs) != 2 or args.out:
        raise UserError("plait data takes TEXT_FILE OUT.bin (a token file), or criteo DAY.tsv "
                        "... --out DIR")
    text, out = args.inputs
    n = encode_text_file(text, out, args.dtype, args.tokenizer)
    if args.tokenizer:
        from plait.data.tokenizer import HFTokenizer

        size, what = HFTokenizer(args.tokenizer).vocab_size, f"{Path(args.tokenizer).name} ids"
    else:
        size, what = 256, "byte-level tokens"
    print(f"plait: wrote {n:,} {what} ({args.dtype}) to {out}; use data.source = \"tokens\", "
          f"data.path = \"{out}\", model.vocab >= {size}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _quiet_libraries()
    xla_flags.apply_defaults()  # before any device is touched
    try:
        return {"train": cmd_train, "inspect": cmd_inspect, "data": cmd_data,
                "schedule": cmd_schedule, "sweep": cmd_sweep, "plan": cmd_plan,
                "launch": cmd_launch, "sample": cmd_sample}[args.command](args)
    except UserError as e:
        print(f"plait: error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"plait: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("plait: interrupted", file=sys.stderr)
        return 130


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
