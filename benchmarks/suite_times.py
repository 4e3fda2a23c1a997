"""Where the test suite's time went, from `python -m pytest -n 2 --compile-times DIR`
(tests/compile_times.py): the sum over the workers of the tests' wall time, the share
JAX spent tracing, lowering and compiling in the tests' own processes (a test's `plait`
subprocesses count in its wall time only), the files and tests that took longest, the
tests that waited with a core idle, and the jitted functions whose compiles cost most,
and how many compiles the persistent cache answered (a steadier measure of a cut than
this machine's wall time). Reads the workers' JSON; runs nothing."""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

STAGES = ("trace", "lower", "compile")


def summary(out: Path, top: int) -> dict:
    tests: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    functions: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    hits: collections.Counter = collections.Counter()
    workers = sorted(out.glob("*.json"))
    if not workers:
        print(f"suite_times: no worker JSON in {out}; run the suite with "
              f"--compile-times {out} first", file=sys.stderr)
        raise SystemExit(2)
    for path in workers:
        data = json.loads(path.read_text())
        for name, times in data["tests"].items():
            tests[name].update(times)
        for name, (secs, n, *hit) in data["functions"].items():  # no hits: older JSON
            functions[name] += secs
            calls[name] += n
            hits[name] += sum(hit)
    total = collections.Counter()
    files: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name, times in tests.items():
        total.update(times)
        files[name.split("::")[0]].update(times)

    def row(times):
        jax_s = sum(times[s] for s in STAGES)
        r = {"wall_s": round(times["wall"], 1), "jax_compile_s": round(jax_s, 1),
             "rest_s": round(times["wall"] - jax_s, 1)}
        if "cpu" in times:  # older JSON has none
            r["cpu_s"] = round(times["cpu"], 1)
        return r

    def longest(table, key=lambda t: t["wall"]):
        return {k: row(v) for k, v in sorted(table.items(), key=lambda kv: -key(kv[1]))[:top]}

    def waited(t):  # wall time with no CPU of its own or of a waited-for child
        return t["wall"] - t["cpu"] if "cpu" in t else 0.0

    return {"workers": len(workers), "tests": len(tests), "total": row(total),
            "by_stage_s": {s: round(total[s], 1) for s in STAGES},
            "compiles": total["compiles"], "cache_hits": total["cache_hits"],
            "files": longest(files), "tests_longest": longest(tests),
            "tests_waiting": {k: v for k, v in longest(tests, waited).items()
                              if v.get("cpu_s", v["wall_s"]) < v["wall_s"]},
            "functions": {k: {"s": round(v, 1), "calls": calls[k], "cache_hits": hits[k]}
                          for k, v in functions.most_common(top)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="the --compile-times directory")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", type=Path, help="also write the summary here")
    a = ap.parse_args()
    s = summary(a.dir, a.top)
    t = s["total"]
    print(f"{s['tests']} tests on {s['workers']} workers: {t['wall_s'] / 60:.1f} test-minutes, "
          f"{t['jax_compile_s'] / t['wall_s']:.0%} tracing, lowering and compiling in-process "
          f"({', '.join(f'{k} {v:.0f} s' for k, v in s['by_stage_s'].items())}); "
          f"{s['compiles']} compiles, {s['cache_hits']} of them found in the persistent cache")
    for title, key in (("files", "files"), ("tests", "tests_longest")):
        print(f"\nlongest {title}: wall s, in-process JAX compile s")
        for name, r in s[key].items():
            print(f"{r['wall_s']:8.1f} {r['jax_compile_s']:8.1f}  {name}")
    if s["tests_waiting"]:
        print("\ntests that waited longest (a core idle): wall s, CPU s of the test and its"
              " waited-for subprocesses")
        for name, r in s["tests_waiting"].items():
            print(f"{r['wall_s']:8.1f} {r['cpu_s']:8.1f}  {name}")
    print("\ncostliest jitted functions (stage name: s, calls, of them cache hits)")
    for name, r in s["functions"].items():
        print(f"{r['s']:8.1f} {r['calls']:6d} {r['cache_hits']:6d}  {name}")
    if a.json:
        a.json.write_text(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()
