"""The same benchmark from two source trees, interleaved: did a change cost throughput?

Runs ``benchmarks/bench_engine.py`` of each tree (``--old`` and ``--new``, e.g. a
``git worktree`` of the parent commit and this checkout) in turn, ``--rounds``
times, each with ``PYTHONPATH`` pointing at its own tree (spawned workers
inherit it), so drift of a shared machine hits both alike. Prints, per engine
configuration, the median req/s of each tree and the ratio new / old.
Printed, never asserted.

    git worktree add /tmp/old HEAD~1
    .venv/bin/python benchmarks/compare_trees.py --old /tmp/old --new . --rounds 3 -- --repeats 1
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from diffrt.cli.bench_stats import median

#: a row of bench_engine's table: mode, max_num_seqs, req/s (engine rows carry p50/p99 too)
ROW = re.compile(r"^(?P<mode>\S.*?)\s{2,}(?P<n>\d+)\s+(?P<rps>\d+\.\d+)")


def run_bench(tree: Path, bench_args: list[str]) -> dict[tuple[str, int], float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, str(tree / "benchmarks" / "bench_engine.py"),
                           *bench_args], cwd=tree, env=env, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise SystemExit(f"bench_engine.py in {tree} failed:\n{proc.stderr[-3000:]}")
    rows = {}
    for line in proc.stdout.splitlines():
        m = ROW.match(line)
        if m:
            rows[(m["mode"].strip(), int(m["n"]))] = float(m["rps"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True)
    parser.add_argument("--new", type=Path, default=Path("."))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("bench_args", nargs="*", help="passed to bench_engine.py (after --)")
    args = parser.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for i in range(args.rounds):
        for name in ("old", "new") if i % 2 == 0 else ("new", "old"):
            runs[name].append(run_bench(trees[name], args.bench_args))
            print(f"round {i + 1}: {name} done", file=sys.stderr, flush=True)
    keys = [k for k in runs["new"][0] if all(k in r for rs in runs.values() for r in rs)]
    print(f"\nbench_engine.py {' '.join(args.bench_args)}: median req/s of {args.rounds} "
          "interleaved runs per tree\n")
    print(f"{'mode':<26}{'max_num_seqs':>13}{'old':>9}{'new':>9}{'new/old':>9}")
    for key in keys:
        old = median([r[key] for r in runs["old"]])
        new = median([r[key] for r in runs["new"]])
        print(f"{key[0]:<26}{key[1]:>13}{old:>9.2f}{new:>9.2f}{new / old:>9.3f}")


if __name__ == "__main__":
    main()
