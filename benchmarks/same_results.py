"""Do two versions of the library give the same results? Risk-validation tables and quality runs, side by side.

A refactoring must not change behaviour. This benchmark checks out two commits (``--before`` and
``--after``) into temporary git worktrees and, on this machine, in each of them:

- regenerates the three risk-validation tables (digits, char GPT, DDPM) from the finished runs cached in
  ``benchmarks/runs/`` (the same cache for both versions: the measured harms are fixed, the predicted
  risks, the allocations and every statistic of the table are recomputed by the version under test),
  with the exact commands recorded on ``docs/benchmarks/risk-validation.md``;
- trains a sample of ``benchmarks/quality.py`` runs afresh (every workload and recipe, seed 0, the
  uniform formats and a BAOC row, ``--quality-steps`` steps each) and compares the cached JSON results:
  every figure (the loss curve, the final metric, the state bytes, the formats chosen), the run time
  aside.

Both versions run on the same machine, in the same way: comparing a table regenerated here with one
recorded on another CPU would mix the two (float reductions differ between CPUs). The table says,
per artifact, whether the two versions' outputs are identical, and where they are not, the first
line that differs.

Example::

    python benchmarks/same_results.py --before 8dbecef --after HEAD --docs
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import DOCS, ROOT, checkout, command, machine, markdown_table, write_docs_section

TASKS = ("digits", "chargpt", "ddpm")
QUALITY_ROWS = ("fp32", "bf16", "int8", "nomomentum", "factored", "baoc_0.25")
QUALITY_WORKLOADS = ("vit_digits", "char_gpt", "ddpm_digits")
QUALITY_RECIPES = ("realistic", "stress")
# machine- and location-dependent lines of a benchmark's output, left out of the comparison
_VOLATILE = (
    re.compile(r"^Machine: "),
    re.compile(r" updated \(section "),
    re.compile(r"^Plot: "),
)


def recorded_command(task: str) -> list[str]:
    """The arguments recorded for ``task`` on the risk-validation page (what produced its table)."""
    text = (DOCS / "benchmarks" / "risk-validation.md").read_text()
    section = re.search(rf"<!-- risk_validation_{task}:start -->(.*?)<!-- risk_validation_{task}:end -->", text, re.S)
    if section is None:
        raise SystemExit(f"docs/benchmarks/risk-validation.md has no section risk_validation_{task}")
    found = re.search(r"Command: `python benchmarks/risk_validation\.py ([^`]*)`", section.group(1))
    if found is None:
        raise SystemExit(f"section risk_validation_{task} records no command")
    return found.group(1).split()


def normalize(text: str, scratch: Path) -> list[str]:
    """Lines of a benchmark's output without what depends on the machine or the scratch folders."""
    out = []
    for line in text.replace(str(scratch), "SCRATCH").splitlines():
        if any(p.search(line) for p in _VOLATILE):
            continue
        out.append(line.replace('<details markdown="1">', "<details>"))
    return out


def run(tree: Path, args: list[str]) -> str:
    """Run a benchmark script of ``tree`` with ``tree`` first on the path; its stdout and stderr."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed in {tree} (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def risk_tables(tree: Path, scratch: Path, tag: str) -> dict[str, list[str]]:
    """Each task's risk-validation output, regenerated from a copy of the cached runs."""
    out = {}
    for task in TASKS:
        cache = scratch / f"{tag}-risk-{task}"
        cache.mkdir(parents=True)
        shutil.copy(ROOT / "benchmarks" / "runs" / f"risk_validation_{task}.json", cache)
        text = run(tree, ["benchmarks/risk_validation.py", *recorded_command(task), "--results-dir", str(cache)])
        out[f"risk validation, {task}"] = normalize(text, cache)
    return out


def quality_runs(tree: Path, scratch: Path, tag: str, steps: int) -> dict[str, list[str]]:
    """Each quality run's JSON result (run time left out), trained afresh by the version in ``tree``."""
    cache = scratch / f"{tag}-quality"
    run(tree, ["benchmarks/quality.py", "--workloads", *QUALITY_WORKLOADS, "--rows", *QUALITY_ROWS,
               "--recipes", *QUALITY_RECIPES, "--seeds", "0", "--steps", str(steps), "--results-dir", str(cache)])
    out = {}
    for path in sorted(cache.rglob("*.json")):
        record = json.loads(path.read_text())
        record.pop("seconds", None)
        out[f"quality, {path.relative_to(cache).with_suffix('').as_posix()}"] = json.dumps(
            record, indent=1, sort_keys=True).splitlines()
    return out


def first_difference(a: list[str], b: list[str]) -> str:
    for line in difflib.unified_diff(a, b, lineterm="", n=0):
        if line.startswith(("-", "+")) and not line.startswith(("---", "+++")):
            return f"`{line[:120]}`"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the earlier commit (any git revision)")
    parser.add_argument("--after", default="HEAD", help="the later commit (default: HEAD)")
    parser.add_argument("--quality-steps", type=int, default=60,
                        help="steps of each quality run (BAOC allocates after max(20, steps // 5); default: 60)")
    parser.add_argument("--docs", action="store_true", help="write the table into docs/benchmarks/same-results.md")
    args = parser.parse_args()
    outputs = {}
    with tempfile.TemporaryDirectory(prefix="same-results-") as work:
        scratch = Path(work)
        for tag, ref in (("before", args.before), ("after", args.after)):
            with checkout(ref) as tree:
                print(f"{tag}: {ref} in {tree}", flush=True)
                outputs[tag] = risk_tables(tree, scratch, tag)
                outputs[tag].update(quality_runs(tree, scratch, tag, args.quality_steps))
    rows, same = [], 0
    for name in sorted(set(outputs["before"]) | set(outputs["after"])):
        a, b = outputs["before"].get(name), outputs["after"].get(name)
        if a is None or b is None:
            rows.append([name, "missing in " + ("before" if a is None else "after"), "", ""])
            continue
        identical = a == b
        same += identical
        rows.append([name, len(a), "yes" if identical else "**no**", "" if identical else first_difference(a, b)])
    body = "\n\n".join([
        f"Machine: {machine()}. Command: `{command()}`",
        f"{same} of {len(rows)} outputs identical between `{args.before}` and `{args.after}` "
        f"(risk validation: the whole printed report of each task; quality: each run's JSON result, "
        f"{args.quality_steps} steps, seed 0, run time left out).",
        markdown_table(["output", "lines", "identical", "first difference"], rows),
    ])
    print(body)
    if args.docs:
        write_docs_section("benchmarks/same-results.md", "same_results", body)
    if same != len(rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
