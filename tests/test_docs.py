"""README and BUILD.md say what works: the shell blocks marked `<!-- doc-test -->` run as
written, and every other `plait ...` command in their shell blocks parses with today's
options (a renamed flag or subcommand fails here, not for a reader)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, subprocess_env

DOCS = ("README.md", "BUILD.md")
FENCE = re.compile(r"^( *)```sh\n(.*?)^\1```", re.S | re.M)


def blocks(name: str) -> list[tuple[bool, str]]:
    """(marked to run, text) of each ```sh block, indentation removed."""
    text = (ROOT / name).read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[:m.start()].rstrip().splitlines()
        marker = before[-1].strip() if before else ""
        body = "\n".join(line[len(m.group(1)):] for line in m.group(2).splitlines())
        out.append((marker == "<!-- doc-test -->", body))
    return out


def commands(block: str) -> list[str]:
    """The `plait ...` commands of a block, continuation lines joined, comments cut."""
    joined = re.sub(r"\\\n\s*", " ", block)
    found = []
    for line in joined.splitlines():
        line = line.split(" #")[0].strip()
        for part in re.split(r"&&|;", line):
            part = re.sub(r"\$\w+", "0", part.strip()).rstrip("& ")  # a loop's $i
            if part.startswith(("plait ", "GLIBC_TUNABLES=")) and "[" not in part:
                found.append(part.split("plait ", 1)[1])
    return found


def test_every_shown_plait_command_parses():
    from plait.cli import parser

    seen = 0
    for name in DOCS:
        for _, block in blocks(name):
            for cmd in commands(block):
                words = shlex.split(cmd)
                if "--" in words:  # launch: the inner command is train's
                    words = words[words.index("--") + 1:]
                try:
                    parser().parse_args(words)
                except SystemExit:
                    pytest.fail(f"{name}: `plait {cmd}` does not parse")
                seen += 1
    assert seen >= 10


RUNNABLE = [(name, i) for name in DOCS for i, (marked, _) in enumerate(blocks(name)) if marked]


@pytest.mark.parametrize("name,index", RUNNABLE)
def test_marked_blocks_run_as_written(tmp_path, name, index):
    """In a fresh directory holding the repository's experiments and docs, as a reader
    who cloned it would have them; `plait` is the installed console script."""
    for entry in ("experiments", "docs", "README.md", "BUILD.md", "meshes", "tests"):
        os.symlink(ROOT / entry, tmp_path / entry)
    env = subprocess_env()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    script = blocks(name)[index][1]
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, f"{name} block {index}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stdout + out.stderr


def test_some_blocks_are_marked_to_run():
    assert len(RUNNABLE) >= 2


def test_the_readmes_usage_names_each_flag_of_each_command():
    """README's Usage block names every flag of every subcommand (its sweep had lost
    --vary, --run-steps, --run-rounds and --set; its eval --dtype)."""
    from plait.cli_args import options, parser, subcommands

    text = (ROOT / "README.md").read_text()
    usage = text[text.index("## Usage"):]
    usage = usage[:usage.index("```", usage.index("```sh") + 5)]
    entries = re.split(r"\n(?=plait )", usage)
    for name, p in subcommands(parser()).items():
        said = " ".join(e for e in entries
                        if re.match(rf"plait (\S+\|)*{name}(\|\S+)* ", e))
        flags = [o for o in options(p) if o.startswith("--") and o != "--help"]
        assert [f for f in flags if f not in said] == [], name


def test_every_hand_written_usage_line_names_each_flag():
    """A subcommand whose usage line is written out (data, sample, eval, import, export)
    names every flag it takes: `plait eval`'s had lost --dtype and --devices."""
    from plait.cli_args import options, parser, subcommands

    written = {name: p for name, p in subcommands(parser()).items() if p.usage}
    assert {"data", "sample", "eval", "import", "export"} <= set(written)
    for name, p in written.items():
        flags = [o for o in options(p) if o.startswith("--") and o != "--help"]
        assert [f for f in flags if f not in p.usage] == [], name
