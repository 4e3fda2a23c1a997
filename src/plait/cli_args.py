"""`plait`'s command line: every subcommand, its arguments and their help (the
handlers live in plait.cli)."""

from __future__ import annotations

import argparse
import difflib
import re

import plait


def processes(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", help="host:port of process 0, to join a multi-process run")
    p.add_argument("--num-processes", type=int, help="processes in the multi-process run")
    p.add_argument("--process-id", type=int, help="this process's index in the run")


def common(p: argparse.ArgumentParser) -> None:
    p.add_argument("experiment", help="experiment file, e.g. experiments/quickstart.toml")
    p.add_argument("--mesh", help="mesh file (meshes/x.toml) or inline spec like data=2,tensor=4")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (value parsed as TOML); repeatable")
    p.add_argument("--devices", type=int, default=None,
                   help="devices the mesh uses (default: what the mesh needs; with a -1 axis, "
                        "every accelerator or one simulated device per CPU core)")
    processes(p)


class Parser(argparse.ArgumentParser):
    """argparse with plait's one-line mistakes: the problem, a flag it may have meant,
    and where the usage is (not the usage itself, many lines of it, and for a mistyped
    flag the top-level command's rather than the subcommand's)."""

    def error(self, message: str):
        wrong = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
        if wrong:  # a mistyped subcommand: the closest (a few choices are read at once)
            choices = re.findall(r"'([^']*)'", wrong[2])
            close = difflib.get_close_matches(wrong[1], choices, 1) if len(choices) > 3 else []
            message += f" (did you mean '{close[0]}'?)" if close else ""
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")

    def parse_args(self, args=None, namespace=None):
        got, extra = self.parse_known_args(args, namespace)
        if extra:
            command = subcommands(self)[got.command]
            flags = options(command)
            meant = [m for x in extra if x.startswith("-")
                     for m in difflib.get_close_matches(x.split("=")[0], flags, n=1)]
            command.error(f"unrecognized arguments: {' '.join(extra)}"
                          + (f" (did you mean {', '.join(meant)}?)" if meant else ""))
        return got


def options(p: argparse.ArgumentParser) -> list[str]:
    """Every option string a (sub)command's parser takes."""
    return [o for a in p._actions for o in a.option_strings]


def subcommands(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser, by name."""
    return next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices


def parser() -> argparse.ArgumentParser:
    ap = Parser(prog="plait", description="Train one model over any device mesh.")
    ap.add_argument("--version", action="version", version=f"plait {plait.version()}")
    sub = ap.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train an experiment (resumes from --run-dir)")
    common(t)
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
    common(i)
    i.add_argument("--json", action="store_true", help="print one JSON object")
    i.add_argument("--hardware", default=None,
                   help="price the collectives, within a host and across hosts, with this "
                        "hardware description's bandwidths and latencies (as plait sweep; "
                        "auto: the one closest to this machine's device)")
    i.add_argument("--compare-tensor-modes", action="store_true",
                   help="compile the step under 1-D, 2-D, 2.5-D and 3-D tensor parallelism on "
                        "the mesh's device count (or --devices) and compare bytes and memory")

    sw = sub.add_parser("sweep", help="compile every mesh shape for N devices, predict step "
                                      "time and memory on target hardware, and rank them")
    sw.add_argument("experiment", help="experiment file")
    sw.add_argument("--devices", type=int, required=True, help="devices to sweep over (N)")
    sw.add_argument("--hardware", default=None,
                    help="hardware description: a meshes/NAME.toml with a [hardware] table, "
                         "or auto: the shipped one closest to this machine's device, e.g. "
                         "h200-node on an H200 (default: cpu-2core)")
    sw.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key (value parsed as TOML); repeatable")
    sw.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2",
                    help="also try these values of a config key on every shape, e.g. "
                         "model.remat=none,save_dots,full; repeatable (every combination)")
    sw.add_argument("--top", type=int, default=None, help="rows to print (and to --run)")
    sw.add_argument("--run", action="store_true",
                    help="also train the top rows for a few steps here and add measured times")
    sw.add_argument("--run-steps", type=int, default=None, metavar="STEPS",
                    help="steps --run trains each shape for; its time is the median of all "
                         "but the first (default: 6; more steady on a noisy machine)")
    sw.add_argument("--run-rounds", type=int, default=None, metavar="R",
                    help="times --run trains each shape, in rank order and back again by "
                         "turns; its time is the median over rounds (default: 1; 2 or more "
                         "where the machine drifts over the run)")
    sw.add_argument("--out", default=None,
                    help="directory for sweep.csv, .json and .png, and programs.jsonl and "
                         "runs.jsonl, the compiled figures and --run's times a rerun into it "
                         "resumes from (default: sweeps/<experiment>-<N>)")
    sw.add_argument("--fresh", action="store_true",
                    help="compile (and with --run, measure) every program again, ignoring "
                         "programs.jsonl and runs.jsonl in --out")
    sw.add_argument("--workers", type=int, default=None,
                    help="processes compiling in parallel (default: up to 4, by core count)")
    sw.add_argument("--schedules", default=None, metavar="NAMES",
                    help="pipeline schedules to try, comma-separated, e.g. 1f1b,chimera "
                         "(default: every one; each is a program to compile per mesh)")

    pl = sub.add_parser("plan", help="print a DLRM's embedding plan (kind and place of each "
                                      "table) and each device's memory")
    common(pl)
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
        "data", help="prepare data: a text file, or JSON Lines / Parquet documents, prompt "
        "and response records or conversations -> a token file (byte-level ids or a "
        "tokenizer's; a loss mask beside it), or Criteo TSV days -> a directory training "
        "memory-maps",
        usage="plait data TEXT_FILE OUT.bin [--tokenizer tokenizer.json] [--dtype uint16|uint32] "
              "[--held-out FRACTION]\n"
              "       plait data DOCS.jsonl|DOCS.parquet|'GLOB' [...] OUT.bin [--field text] "
              "[--prompt-field NAME | --chat NAME [--chat-template FILE]] "
              "[--tokenizer tokenizer.json] [--eos TOKEN] [--held-out FRACTION]\n"
              "       plait data criteo DAY.tsv[.gz]|'GLOB' [DAY ...] --out DIR "
              "[--malformed skip|stop]")
    d.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="TEXT_FILE OUT.bin; JSON Lines / Parquet files or quoted globs then "
                        "OUT.bin; or the word criteo and Criteo TSV day files (a glob's "
                        "files are read in natural order: part2 before part10)")
    d.add_argument("--field", metavar="NAME",
                   help="documents: the text field of each JSON record / Parquet column "
                        "(default: text)")
    d.add_argument("--prompt-field", metavar="NAME",
                   help="documents: each record is this prompt then its response (--field); "
                        "training learns the responses, not the prompts (a loss mask is "
                        "written beside OUT.bin)")
    d.add_argument("--chat", metavar="NAME",
                   help="documents: each record's NAME field is a conversation (a list of "
                        "{role, content}), rendered with the model's chat template; training "
                        "learns the assistant's turns (a loss mask is written beside OUT.bin)")
    d.add_argument("--chat-template", metavar="FILE",
                   help="--chat: a .jinja template or a tokenizer_config.json (default: the "
                        "one beside --tokenizer, which plait import copies into the run)")
    d.add_argument("--eos", metavar="TOKEN",
                   help="documents: the token that ends each one (default: the tokenizer's "
                        "end-of-text token)")
    d.add_argument("--held-out", type=float, metavar="FRACTION",
                   help="also write OUT.val.bin for evaluation: this fraction of the documents "
                        "(one in every 1/FRACTION) or, for a text file, its last part; "
                        "OUT.bin keeps the rest")
    d.add_argument("--out", help="criteo: the output directory (rerun to convert only new days)")
    d.add_argument("--dtype", choices=("uint16", "uint32"), default=None,
                   help="element type of the token file (default uint16, for vocabularies "
                        "up to 65536)")
    d.add_argument("--tokenizer", metavar="tokenizer.json",
                   help="encode with this Hugging Face tokenizers file (kept beside OUT.bin "
                   "and in the runs that train on it); default: byte-level ids 0-255")
    d.add_argument("--malformed", choices=("skip", "stop"), default=None,
                   help="criteo: skip lines that do not parse (counted; the default) or stop "
                        "at the first")
    sp = sub.add_parser(
        "sample", help="generate text from a decoder run's checkpoint (GPT or Llama; KV "
        "cache, one device)",
        usage="plait sample RUN_DIR (--prompt TEXT | --chat) [--chat] [--system TEXT] "
              "[--tokens N] "
              "[--temperature T] "
              "[--top-k K] [--seed S] [--step N]")
    sp.add_argument("run_dir", metavar="RUN_DIR", help="the --run-dir of a plait train run")
    sp.add_argument("--prompt", help="the text to continue")
    sp.add_argument("--chat", action="store_true",
                    help="the prompt is a user's message: put it through the run's chat "
                         "template (from plait import) and print the assistant's answer, "
                         "up to its end-of-text token; without --prompt, a conversation: "
                         "a message a line on standard input, each answered with the "
                         "turns before it")
    sp.add_argument("--system", metavar="TEXT",
                    help="--chat: a system message before the prompt")
    sp.add_argument("--tokens", type=int, help="how many tokens to generate (default: 100, or "
                    "half of model.seq_len if that is less)")
    sp.add_argument("--temperature", type=float, default=1.0,
                    help="softmax temperature; 0 takes the most likely token every time")
    sp.add_argument("--top-k", type=int, default=0,
                    help="draw only among the K most likely tokens (0: all)")
    sp.add_argument("--seed", type=int, default=0, help="seed of the draws")
    sp.add_argument("--step", type=int, help="a kept checkpoint's step (default: the newest)")
    ev = sub.add_parser(
        "eval", help="a language-model run's loss and perplexity on every token of a token "
        "file, on any mesh",
        usage="plait eval RUN_DIR [--data TOKENS.bin] [--step N|all [--png FILE]] [--mesh SPEC] "
              "[--devices N] [--batch ROWS] [--max-batches N] [--seq-len N] "
              "[--dtype uint16|uint32] [--json FILE] [--coordinator HOST:PORT --num-processes "
              "P --process-id I]")
    ev.add_argument("run_dir", metavar="RUN_DIR",
                    help="the --run-dir of a plait train run or a plait import")
    ev.add_argument("--data", help="token file to score, made with the run's tokenizer "
                    "(default: the run's data.eval_path)")
    ev.add_argument("--dtype", choices=("uint16", "uint32"),
                    help="element type of the token file (default: the run's data.dtype)")
    ev.add_argument("--step", help="a kept checkpoint's step, or 'all' for every kept one "
                    "(a table, and the best; default: the newest)")
    ev.add_argument("--png", help="with --step all: draw the loss against the step here")
    ev.add_argument("--mesh", help="mesh file or inline spec (default: the run's mesh)")
    ev.add_argument("--devices", type=int, default=None, help="devices the mesh uses")
    ev.add_argument("--batch", type=int,
                    help="windows of model.seq_len tokens a batch (default: train.global_batch)")
    ev.add_argument("--max-batches", type=int, help="score only the first N batches")
    ev.add_argument("--seq-len", type=int,
                    help="tokens a window (default: the run's model.seq_len; rotary models "
                         "only, e.g. to score a context longer than the one trained)")
    ev.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    processes(ev)
    im = sub.add_parser(
        "import", help=f"a Hugging Face model directory ({_architectures()}) -> a run "
        "directory whose step-0 checkpoint plait train continues",
        usage="plait import HF_DIR --run-dir RUN [--seq-len N]")
    im.add_argument("hf_dir", metavar="HF_DIR",
                    help="local directory with config.json and *.safetensors")
    im.add_argument("--run-dir", required=True, help="the run directory to create")
    im.add_argument("--seq-len", type=int,
                    help="training sequence length of a rotary model (default: the model's "
                         "context, at most 2048)")
    ex = sub.add_parser(
        "export", help="a decoder run's checkpoint -> a directory transformers loads "
        "(config.json, model.safetensors or 5 GB shards, tokenizer.json)",
        usage="plait export RUN_DIR --out DIR [--step N] [--dtype float32|bfloat16]")
    ex.add_argument("run_dir", metavar="RUN_DIR", help="the --run-dir of a plait train run")
    ex.add_argument("--out", required=True, help="the directory to create")
    ex.add_argument("--step", type=int, help="a kept checkpoint's step (default: the newest)")
    ex.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype of the written weights")
    return ap


def _architectures() -> str:
    """The Hugging Face architectures plait import reads, by their names' stems."""
    from plait.hf.config_json import ARCHITECTURES

    return ", ".join(a.removesuffix("ForCausalLM").removesuffix("LMHeadModel")
                     for a in ARCHITECTURES)
