"""The step time of two versions of the library, interleaved: is a change's step within noise of the one before?

``benchmarks/step_time.py`` measures each format's step as a ratio to ``torch.optim.AdamW(fused=True)`` in the
same process and round. This script runs it for the library at ``--before`` (a temporary git worktree) and for
this checkout, alternately (the order shuffled each round, so that a background load falls on both alike),
``--rounds`` times each, and prints per format: each version's median ratio over the rounds, the range of
its rounds, and the relative change of the medians. A change is within noise where the after median lies
inside the before version's range of rounds (and the other way round). Each version builds its compiled
kernels in a cache directory of its own (two checkouts sharing one rebuild each other's kernels).

Example (the step-time page's model at 1 thread, 5 rounds each)::

    python benchmarks/step_time_ab.py --before a828927 --rounds 5 -- --threads 1

The arguments after ``--`` go to ``step_time.py`` of both versions (``--quick`` is added unless
``--full`` is given: no docs page is written either way).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import checkout, command, machine, markdown_table

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^(\d+) threads?, (.+): ([\d.]+) ms, ([\d.]+)x torch AdamW fused$", re.M)


def ratios(output: str) -> dict[str, float]:
    """``label -> ratio to fused AdamW`` from ``step_time.py``'s per-optimizer lines (``"1 thread, int8"``)."""
    return {f"{label} ({threads} thr)": float(ratio) for threads, label, _, ratio in LINE.findall(output)}


def _run(tree: Path, extensions: Path, arguments: list[str]) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree), TORCH_EXTENSIONS_DIR=str(extensions))
    done = subprocess.run([sys.executable, str(tree / "benchmarks" / "step_time.py"), *arguments], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"step_time.py failed in {tree}:\n{done.stderr[-3000:]}")
    found = ratios(done.stdout)
    if not found:
        raise SystemExit(f"step_time.py in {tree} printed no ratios:\n{done.stdout[-2000:]}")
    return found


def summary(before: list[dict[str, float]], after: list[dict[str, float]]) -> tuple[list[list[str]], int]:
    """The table's rows and the number of formats outside noise."""
    rows, outside = [], 0
    for label in before[0]:
        if label.startswith("torch AdamW fused"):
            continue
        b = [r[label] for r in before if label in r]
        a = [r[label] for r in after if label in r]
        if not a:
            continue
        mb, ma = statistics.median(b), statistics.median(a)
        within = min(b) <= ma <= max(b) or min(a) <= mb <= max(a)
        outside += not within
        rows.append([label, f"{mb:.2f}x ({min(b):.2f}-{max(b):.2f})", f"{ma:.2f}x ({min(a):.2f}-{max(a):.2f})",
                     f"{(ma / mb - 1):+.1%}", "within noise" if within else "outside"])
    return rows, outside


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, passed = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the commit measured against this checkout")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each version (default: 5)")
    parser.add_argument("--full", action="store_true", help="step_time.py's own model and rounds, not --quick")
    parser.add_argument("--seed", type=int, default=0, help="seed of the order of the versions in each round")
    args = parser.parse_args(own)
    arguments = passed if args.full or "--quick" in passed else ["--quick", *passed]
    with checkout(args.before) as old, tempfile.TemporaryDirectory(prefix="step-time-ab-") as work:
        trees = {"before": (old, Path(work) / "ext-before"), "after": (ROOT, Path(work) / "ext-after")}
        for tree, extensions in trees.values():  # builds each version's kernels once, untimed
            _run(tree, extensions, arguments)
        runs: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
        order = random.Random(args.seed)
        for r in range(args.rounds):
            versions = list(trees)
            order.shuffle(versions)
            for version in versions:
                runs[version].append(_run(*trees[version], arguments))
            print(f"round {r + 1} of {args.rounds} done", flush=True)
    rows, outside = summary(runs["before"], runs["after"])
    print(markdown_table(["optimizer", f"before ({args.before}): median (range)", "after (this checkout)", "change", ""],
                         rows))
    print(f"\n{len(rows) - outside} of {len(rows)} within noise. Machine: {machine()}. Command: `{command()}`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
