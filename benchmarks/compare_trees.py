"""The same benchmark against two source trees, interleaved pass by pass: did a change cost throughput?

Starts this checkout's ``benchmarks/bench_engine.py --serve-passes`` twice, once
against each tree (``--old`` and ``--new``, e.g. a ``git worktree`` of the parent
commit and this checkout): ``PYTHONPATH`` and the working directory point at
the tree, so the driver and the workers it spawns import that tree's diffrt
(the driver uses only the public engine API, so an older tree runs it too).
Both drivers keep every engine configuration alive; then, ``--rounds`` times,
each configuration runs one timed pass in the old tree and one in the new,
back to back (which goes first alternates). The two passes of a pair are
seconds apart, so drift of a shared machine — which on a 2-core VM moves a
whole run by 10-20 % within minutes — hits both trees alike. Prints, per
configuration, the median req/s of each tree, the ratio of the medians and the
median of the per-round ratios. Printed, never asserted.

    git worktree add /tmp/old HEAD~1
    .venv/bin/python benchmarks/compare_trees.py --old /tmp/old --new . --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from diffrt.cli.bench_stats import median

DRIVER = Path(__file__).resolve().parent / "bench_engine.py"


class Driver:
    """One ``bench_engine.py --serve-passes`` process importing one tree."""

    def __init__(self, tree: Path, bench_args: list[str]):
        env = dict(os.environ, PYTHONPATH=str(tree))
        # cwd too: ``python -m`` (how workers start) puts the cwd ahead of PYTHONPATH
        self.proc = subprocess.Popen(
            [sys.executable, str(DRIVER), "--serve-passes", *bench_args], cwd=tree, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self._line()
        if not line.startswith("ready "):
            raise SystemExit(f"bench_engine.py in {tree} did not start: {line!r}")
        self.subjects = [tuple(s) for s in json.loads(line[len("ready "):])]

    def _line(self) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(("ready ", "wall ")):
                return line.strip()
        raise SystemExit(f"bench_engine.py exited with {self.proc.wait()}")

    def run(self, index: int, tag: str) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"run {index} {tag}\n")
        self.proc.stdin.flush()
        return float(self._line().split()[1])

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


def requests_per_pass(bench_args: list[str]) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--requests", type=int, default=32)
    return parser.parse_known_args(bench_args)[0].requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True)
    parser.add_argument("--new", type=Path, default=Path("."))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("bench_args", nargs="*", help="passed to bench_engine.py (after --)")
    args = parser.parse_args()
    n_requests = requests_per_pass(args.bench_args)
    drivers = {}
    try:
        for name in ("old", "new"):  # one at a time: start-up is the noisiest part
            drivers[name] = Driver(getattr(args, name).resolve(), args.bench_args)
            print(f"{name} tree ready", file=sys.stderr, flush=True)
        subjects = drivers["new"].subjects
        if drivers["old"].subjects != subjects:
            raise SystemExit(f"the trees run different configurations: "
                             f"{drivers['old'].subjects} vs {subjects}")
        rps: dict[str, list[list[float]]] = {"old": [[] for _ in subjects],
                                             "new": [[] for _ in subjects]}
        for r in range(args.rounds):
            for i in range(len(subjects)):
                for name in ("old", "new") if (r + i) % 2 == 0 else ("new", "old"):
                    wall = drivers[name].run(i, f"r{r}")
                    rps[name][i].append(n_requests / wall)
            print(f"round {r + 1} done", file=sys.stderr, flush=True)
    finally:
        for driver in drivers.values():
            driver.close()
    print(f"\nbench_engine.py {' '.join(args.bench_args)}: req/s, {args.rounds} rounds of "
          "back-to-back old/new passes per configuration\n")
    print(f"{'mode':<26}{'max_num_seqs':>13}{'old':>9}{'new':>9}{'new/old':>9}"
          f"{'median of ratios':>18}")
    ratios = []
    for i, (label, n) in enumerate(subjects):
        old, new = median(rps["old"][i]), median(rps["new"][i])
        paired = median([b / a for a, b in zip(rps["old"][i], rps["new"][i], strict=True)])
        ratios.append(new / old)
        print(f"{label:<26}{n:>13}{old:>9.2f}{new:>9.2f}{new / old:>9.3f}{paired:>18.3f}")
    print(f"\nmedian new/old over configurations: {median(ratios):.3f}, "
          f"lowest {min(ratios):.3f}")


if __name__ == "__main__":
    main()
