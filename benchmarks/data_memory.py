"""Host memory and speed of `plait data`: a JSON Lines corpus of documents and a text
file, each tokenized with a byte-level BPE (a `tokenizers` file trained here on the
corpus, 4096 ids), with a tenth held out.

Each command runs in a fresh process and its peak resident memory is read
(ru_maxrss of the child) with its wall time. With --compare TREE the same commands
also run on the code of another checkout (TREE/src on PYTHONPATH), alternating
with this one round by round, so the two are measured side by side. The outputs
of the two must be the same bytes (checked).

    python benchmarks/data_memory.py [--mb 200] [--rounds 3] [--compare OLD_CHECKOUT]
                                     [--json out.json]
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
from report import compare_parser, peak_gib, report, run_script, trees

WORDS = ["the", "mesh", "model", "layer", "device", "train", "step", "data", "token", "batch",
         "pipeline", "tensor", "parallel", "checkpoint", "resume", "plait", "shard", "axis",
         "expert", "attention", "rotary", "gradient", "optimizer", "schedule", "memory",
         "compile"]


def _corpus(work: Path, megabytes: int) -> tuple[Path, Path, Path]:
    """(documents.jsonl, the same text as one file, a tokenizer) of about `megabytes`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = np.random.default_rng(0)
    docs, text = work / "docs.jsonl", work / "docs.txt"
    size = 0
    with docs.open("w") as jf, text.open("w") as tf:
        while size < megabytes * 2**20:
            n = int(rng.integers(20, 400))
            body = " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), n)) + "."
            jf.write(json.dumps({"text": body}) + "\n")
            tf.write(body + "\n")
            size += len(body) + 1
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    with text.open() as f:
        sample = [next(f) for _ in range(2000)]
    tok.train_from_iterator(sample, trainers.BpeTrainer(
        vocab_size=4096, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(work / "tok.json"))
    return docs, text, work / "tok.json"


def _digest(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def main() -> None:
    ap = compare_parser(__doc__)
    ap.add_argument("--mb", type=int, default=200, help="size of the corpus text, MiB")
    args = ap.parse_args()
    measured = trees(args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        docs, text, tok = _corpus(work, args.mb)
        commands = {"documents": [str(docs), "out.bin", "--tokenizer", str(tok),
                                  "--held-out", "0.1"],
                    "text": [str(text), "out.bin", "--tokenizer", str(tok),
                             "--held-out", "0.1"]}
        peaks: dict = {t: {c: [] for c in commands} for t in measured}
        seconds: dict = {t: {c: [] for c in commands} for t in measured}
        digests: dict = {}
        tokens: dict = {}
        for r in range(args.rounds):
            for name, tree in measured.items():
                for c, argv in commands.items():
                    gib, took = peak_gib(tree, ["data", *argv], work)
                    peaks[name][c].append(gib)
                    seconds[name][c].append(took)
                    outputs = (work / "out.bin", work / "out.val.bin")
                    digests.setdefault(c, set()).add(_digest(*outputs))
                    tokens[c] = sum(p.stat().st_size // 2 for p in outputs)
                print(f"round {r + 1}: {name} " + ", ".join(
                    f"{c} {v[-1]:.2f} GiB {seconds[name][c][-1]:.1f} s"
                    for c, v in peaks[name].items()), file=sys.stderr)
        same = {c: len(d) == 1 for c, d in digests.items()}
    report({"corpus_mib": args.mb, "tokens": tokens, "outputs_identical": same,
            "peak_gib": peaks, "seconds": seconds,
            "median_gib": {t: {c: statistics.median(v) for c, v in p.items()}
                           for t, p in peaks.items()},
            "median_seconds": {t: {c: statistics.median(v) for c, v in p.items()}
                               for t, p in seconds.items()}}, args.json)


if __name__ == "__main__":
    run_script(main)
