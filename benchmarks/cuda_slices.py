"""The GPU slices of ``benchmarks/cuda_all.sh``: what each measures, which have run, and the docs written from that.

A GPU comes for minutes at a time. ``bash benchmarks/cuda_all.sh OUT_DIR SECONDS`` spends them on the slices of
:data:`SLICES`, in that order (the CUDA tests first: they are the correctness gate), and records each slice in
``benchmarks/runs/cuda_all/state.json`` when it ends: its state, the GPU, the commit and the date. A later call
reads the file and goes on with the slices not done yet. From the same file come the table of slices on
``docs/benchmarks/index.md`` (section ``cuda_slices``) and the sentences that say whether each GPU-only feature
has run on a GPU (sections ``gpu_status_<key>`` of the pages in :data:`FEATURES`); every docs section a slice
rewrites on a GPU gets a first line naming that GPU and that commit (:func:`stamp`).

The script calls this module before its first slice (``begin``) and after each (``finish``: record, stamp, render,
pack), each call printing the next slice to run and its time limit; ``check`` checks a command without running it
(the dry run's ``SMOKE=1``), ``quality-next`` picks the next run of quality at scale that fits. By hand:

    python benchmarks/cuda_slices.py pending      # the slices a GPU call would run, in order
    python benchmarks/cuda_slices.py render       # the docs' table and GPU statuses again from the state file

Only ``quality-next`` imports torch (through the benchmark), so that the calls between slices take a fraction
of a second.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import re
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
STATE = Path("benchmarks/runs/cuda_all/state.json")  # relative to the checkout's root
INDEX = "benchmarks/index.md"  # under docs/: the page with the table of slices
#: What a slice may write, relative to the root: what a call packs into OUT_DIR/tree.tgz when it changed.
WRITTEN = ("README.md", "docs", "benchmarks/runs")
#: The code the CUDA tests check: a change to it runs them again.
CODE = ("lightning_baoc", "tests")


@dataclass(frozen=True)
class Slice:
    """One part of the GPU run, recorded when it ends."""

    name: str
    script: str  # the per-topic script whose part this is (its commands, run alone)
    what: str  # what it measures, for the table
    writes: str  # the docs sections and run caches it writes, for the table
    seconds: int  # GPU time it needs to start: a call with less left leaves it for the next (an estimate)
    cap: int  # the most it may take; 0: whatever is left (a resumable slice stops before a run that would not fit)
    dry_seconds: int  # the same on the CPU's dry run
    resumable: bool = False  # done a part at a time, over several calls


#: The slices in the order a call runs them: the tests; then what has never been measured on a GPU (the graph
#: step's step times, the interleaved offload schedule, DeepSpeed on CUDA); then the measurements the docs already
#: hold from earlier code; last the quality runs at scale, which take what each call leaves.
SLICES: tuple[Slice, ...] = (
    Slice("cuda_tests", "cuda_suite.sh, cuda_step_time.sh, cuda_offload.sh",
          "the CUDA tests: every format on the GPU as on the CPU, the Triton kernels, the CUDA graph step with real "
          "graphs, the interleaved offload schedule's streams, the step without host synchronisation, the memory "
          "instruments", "(the log)", 240, 420, 60),
    Slice("step_time_gpt2", "cuda_step_time.sh",
          "step time of GPT-2 small's 124M parameters in 148 tensors: every format's graph and planned step against "
          "fused and foreach AdamW and the 8-bit peers",
          "[Step time](step-time.md#on-a-gpu) `step_time_gpt2-small_cuda`",
          150, 300, 120),
    Slice("offload_schedule", "cuda_offload.sh",
          "the interleaved offload schedule against host-only offload: the step of 1.2B offloaded parameters and a "
          "Lightning GPT with every state offloaded",
          "[BlockwiseAdamW](../optimizer.md#offloaded-states-the-interleaved-schedule) "
          "`offload_schedule_cuda`; `benchmarks/runs/offload_schedule_cuda/`", 360, 540, 60),
    Slice("step_time_ragged", "cuda_step_time.sh", "the same on 20M parameters in 33 ragged tensors",
          "[Step time](step-time.md#on-a-gpu) `step_time_ragged_cuda`", 90, 240, 60),
    Slice("step_time_many", "cuda_step_time.sh", "the same on 1,000 tensors of 4,096 elements",
          "[Step time](step-time.md#on-a-gpu) `step_time_many_cuda`", 90, 240, 60),
    Slice("deepspeed_memory", "cuda_deepspeed.sh",
          "BAOC under Lightning's DeepSpeedStrategy beside DeepSpeed AdamW: a 40M GPT at ZeRO-2 and ZeRO-3, peak CUDA "
          "memory and state bytes", "[DeepSpeed ZeRO](../deepspeed.md#peak-memory-on-a-gpu) `deepspeed_memory_cuda`",
          180, 420, 120),
    Slice("suite_step_time", "cuda_suite.sh",
          "where the CUDA step's time goes (host against kernels), and the step time of 20 x Linear(1024, 1024) with "
          "fp32 and bf16 weights", "[Step time](step-time.md#on-a-gpu) `step_time_cuda`, `step_time_bf16_cuda`",
          180, 360, 60),
    Slice("suite_memory", "cuda_suite.sh",
          "total memory of whole runs, the peak over the steady state, the planned against the measured peak, the "
          "peak memory of Lightning runs with BAOC", "[Total memory](total-memory.md#on-a-gpu) `total_memory_cuda`; "
          "[Peak memory](peak-memory.md#on-a-gpu) `peak_memory_cuda`, `peak_excess_cuda`, `peak_planned_cuda`",
          240, 480, 120),
    Slice("suite_quality", "cuda_suite.sh",
          "quality with bf16 weights (char GPT, DDPM) and SGD's and Lion's momentum formats (ViT), 3 seeds, 2 recipes",
          "[Total memory](total-memory.md#on-a-gpu) `bf16_weights_cuda`; [Quality](quality.md) `sgd_lion_cuda`; "
          "`benchmarks/runs/*_cuda/`", 150, 0, 120, resumable=True),
    Slice("quality_at_scale", "cuda_quality_at_scale.sh",
          "BAOC beside fp32 AdamW, uniform int8 and the 8-/4-bit peers on a byte-level GPT of 40M and 124M parameters",
          "[Quality at scale](quality-at-scale.md) `quality_at_scale`; `benchmarks/runs/quality_at_scale/`",
          150, 0, 60, resumable=True),
)
BY_NAME = {s.name: s for s in SLICES}


@dataclass(frozen=True)
class Feature:
    """A GPU-only feature, and the slices that run it on a GPU: its page says what they did."""

    key: str  # its section on the page: gpu_status_<key>
    page: str  # under docs/
    title: str
    slices: tuple[str, ...]
    earlier: str = ""  # what ran on a GPU before the slices recorded anything
    gap: str = ""  # where no slice runs it: why


FEATURES: tuple[Feature, ...] = (
    Feature("triton", "optimizer.md", "The Triton kernels", ("cuda_tests", "suite_step_time"),
            earlier="their tests passed on an NVIDIA H100 and their step times were measured there (recorded in "
            "commit 919b471, 2026-11-27), before the planned step, the CUDA graph step and the factored formats' two "
            "launches"),
    Feature("graph_step", "optimizer.md", "The CUDA graph step", ("cuda_tests", "step_time_gpt2")),
    Feature("amp_scaling", "optimizer.md", "AMP's gradient scaler on the device's path (`amp_scaling`)", (),
            gap="its tests (`tests/optim/test_amp.py`) run the device's path through Triton's interpreter on the CPU "
            "and are skipped where CUDA is present, and no GPU test covers it yet"),
    Feature("offload", "optimizer.md", "The interleaved offload schedule", ("cuda_tests", "offload_schedule")),
    Feature("deepspeed", "deepspeed.md", "BAOC under DeepSpeed on CUDA", ("deepspeed_memory",),
            gap="the ZeRO client's and the callback's tests run on CPU ranks"),
    Feature("step_time_shapes", "benchmarks/step-time.md", "The GPU step on the three shape sets",
            ("step_time_gpt2", "step_time_ragged", "step_time_many")),
    Feature("quality_at_scale", "benchmarks/quality-at-scale.md", "Quality at scale", ("quality_at_scale",)),
)

SECTION = re.compile(r"<!-- (\S+?):start -->\n?(.*?)<!-- \1:end -->", re.S)
STAMP = re.compile(r"\A\*Measured on .* at commit [^*]*\*\n*")


# ------------------------------------------------------------------------------------------ the state file


def load_state(root: Path) -> dict[str, dict[str, Any]]:
    """Each recorded slice's last entry (empty where the file is missing)."""
    path = root / STATE
    return json.loads(path.read_text())["slices"] if path.is_file() else {}


def save_state(root: Path, slices: dict[str, dict[str, Any]]) -> None:
    path = root / STATE
    path.parent.mkdir(parents=True, exist_ok=True)
    ordered = {s.name: slices[s.name] for s in SLICES if s.name in slices}
    path.write_text(json.dumps({"slices": ordered}, indent=1, sort_keys=False) + "\n")


def code_hash(root: Path) -> str:
    """A hash of the code the CUDA tests check (the package and the tests): what makes them run again."""
    digest = hashlib.sha256()
    for top in CODE:
        for path in sorted((root / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".so"):
                digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def is_settled(entry: dict[str, Any] | None, slice_: Slice, code: str, dry_run: bool) -> bool:
    """Whether a slice needs no run: done (the tests: done on this code), on a GPU unless this is a dry run."""
    if entry is None or entry["state"] != "done" or (entry.get("dry_run") and not dry_run):
        return False
    return slice_.name != "cuda_tests" or entry.get("code") == code


def pending(state: dict[str, dict[str, Any]], code: str, dry_run: bool, redo: set[str] = frozenset(),
            skip: set[str] = frozenset()) -> list[Slice]:
    """The slices a call would run, in order: those not settled, or named in ``redo``, less those in ``skip``."""
    return [s for s in SLICES
            if s.name not in skip and (s.name in redo or not is_settled(state.get(s.name), s, code, dry_run))]


def next_slice(todo: list[Slice], attempted: dict[str, str], left: int, dry_run: bool, smoke: bool,
               gate: bool) -> tuple[Slice | None, int, list[str]]:
    """The slice to run now with ``left`` seconds, its time limit, and why others wait.

    ``attempted``: the slices this call ran, with the state they ended in (none runs twice in a call). The CUDA
    tests come first: while they are to run and do not fit, nothing runs; when they failed in this call, nothing
    runs after them (unless ``gate`` is off). Any other slice that does not fit is left for the next call, and
    the next one that fits runs.
    """
    waiting: list[str] = []
    for s in todo:
        if s.name in attempted:
            if s.name == "cuda_tests" and attempted[s.name] != "done" and gate:
                why = f"the CUDA tests did not pass ({attempted[s.name]}): the measurements wait for them"
                return None, 0, waiting + [why]
            continue
        need = 1 if smoke else s.dry_seconds if dry_run else s.seconds
        if need > left:
            waiting.append(f"{s.name}: needs {need} s, {left} s left")
            if s.name == "cuda_tests":
                return None, 0, waiting + ["the CUDA tests come first: nothing else runs before them"]
            continue
        limit = left if s.cap == 0 or dry_run else min(left, s.cap)
        return s, limit, waiting
    return None, 0, waiting


def record(state: dict[str, dict[str, Any]], name: str, outcome: str, detail: str, seconds: int, device: str,
           commit: str, date: str, code: str, dry_run: bool) -> dict[str, Any]:
    """The entry of a slice that ended: ``outcome`` done, partial (a resumable slice with more to do), failed or
    unavailable (something it needs is not installed)."""
    if outcome not in ("done", "partial", "failed", "unavailable"):
        raise ValueError(f"outcome={outcome!r}: one of done, partial, failed, unavailable")
    entry = {"state": outcome, "device": device, "commit": commit, "date": date, "seconds": seconds}
    if detail:
        entry["detail"] = detail
    if name == "cuda_tests":
        entry["code"] = code
    if dry_run:
        entry["dry_run"] = True
    state[name] = entry
    return entry


# ------------------------------------------------------------------------------------------ the docs


def where(entry: dict[str, Any]) -> str:
    return f"{entry['device']} at commit {entry['commit']}, {entry['date']}"


def state_text(entry: dict[str, Any] | None) -> str:
    """A slice's state in words: "not run yet", "done on DEVICE at commit C, DATE", ..."""
    if entry is None:
        return "not run yet"
    if entry.get("dry_run"):
        return f"not run yet on a GPU (a dry run on the CPU, {entry['date']})"
    detail = f" ({entry['detail']})" if entry.get("detail") else ""
    return {
        "done": f"done on {where(entry)}{detail}",
        "partial": f"in part{detail}, on {where(entry)}; the next call goes on",
        "failed": f"failed on {where(entry)}{detail}",
        "unavailable": f"not run: {entry.get('detail', 'a dependency is missing')}, on {where(entry)}",
    }[entry["state"]]


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def slices_table(state: dict[str, dict[str, Any]]) -> str:
    """The table of slices on ``docs/benchmarks/index.md``: slice, what it measures, where it writes, its state."""
    rows = [[f"`{s.name}`", s.what, s.writes, state_text(state.get(s.name))] for s in SLICES]
    return ("Written by `benchmarks/cuda_all.sh` from `benchmarks/runs/cuda_all/state.json` (in this order a call "
            "runs them):\n\n" + markdown_table(["slice", "what it measures", "written to", "state"], rows))


def feature_text(feature: Feature, state: dict[str, dict[str, Any]]) -> str:
    """Whether ``feature`` has run on a GPU, from its slices' entries: "not yet run on a GPU" until one has."""
    link = os.path.relpath(f"docs/{INDEX}", f"docs/{Path(feature.page).parent}").replace(os.sep, "/") + "#gpu-slices"
    head = f"**{feature.title}:**"
    if not feature.slices:
        return f"{head} not yet run on a GPU: {feature.gap}."
    entries = [(name, state.get(name)) for name in feature.slices]
    ran = [(name, e) for name, e in entries if e is not None and not e.get("dry_run")]
    done = [name for name, e in ran if e["state"] == "done"]
    verdict = ("ran on a GPU" if len(done) == len(entries) else "not yet run on a GPU" if not ran
               else "ran in part on a GPU")
    parts = "; ".join(f"slice `{name}` {state_text(e)}" for name, e in entries)
    gap = f" ({feature.gap})" if feature.gap else ""
    if feature.earlier:
        return f"{head} earlier, {feature.earlier}; as it is now, {verdict}{gap} ({parts}) ([GPU slices]({link}))."
    return f"{head} {verdict}{gap}: {parts} ([GPU slices]({link}))."


def replace_section(text: str, name: str, body: str) -> str:
    """``text`` with the section ``name`` (between ``<!-- name:start -->`` and ``<!-- name:end -->``, the markers
    of ``benchmarks/_report.py``) replaced by ``body``; added at the end where the markers are missing."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        return re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    return text.rstrip() + "\n\n" + block + "\n"


def render(root: Path, state: dict[str, dict[str, Any]]) -> list[Path]:
    """Write the table of slices and every feature's GPU status into the docs; the pages changed."""
    changed = []
    pages: dict[str, list[tuple[str, str]]] = {INDEX: [("cuda_slices", slices_table(state))]}
    for feature in FEATURES:
        pages.setdefault(feature.page, []).append((f"gpu_status_{feature.key}", feature_text(feature, state)))
    for page, sections in pages.items():
        path = root / "docs" / page
        text = before = path.read_text()
        for name, body in sections:
            text = replace_section(text, name, body)
        if text != before:
            path.write_text(text)
            changed.append(path)
    return changed


def sections(text: str) -> dict[str, str]:
    """The docs sections of a page: name -> body."""
    return {m.group(1): m.group(2) for m in SECTION.finditer(text)}


def stamp(text: str, before: str, line: str) -> str:
    """``text`` with ``line`` first in every section whose body differs from ``before``'s (or is new): the sections a
    slice just wrote, each then naming the GPU and the commit it ran on. The ``gpu_status_*`` and ``cuda_slices``
    sections, written from the state file, are left as they are."""
    old = sections(before)

    def one(match: re.Match[str]) -> str:
        name, body = match.group(1), match.group(2)
        if name == "cuda_slices" or name.startswith("gpu_status_") or old.get(name) == body:
            return match.group(0)  # not written by the slice (a section it rewrote has lost its stamp)
        return f"<!-- {name}:start -->\n{line}\n\n{STAMP.sub('', body)}<!-- {name}:end -->"

    return SECTION.sub(one, text)


# ------------------------------------------------------------------------------------------ what a call changed


def fingerprint(root: Path) -> dict[str, str]:
    """Each file a slice may write (:data:`WRITTEN`), by its path under ``root``: a hash of its bytes."""
    out = {}
    for top in WRITTEN:
        base = root / top
        paths = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else []
        for path in paths:
            if "__pycache__" not in path.parts:
                out[path.relative_to(root).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def changed_since(root: Path, before: dict[str, str]) -> list[str]:
    """The files under :data:`WRITTEN` that are new or changed since ``before`` (a :func:`fingerprint`)."""
    return sorted(path for path, digest in fingerprint(root).items() if before.get(path) != digest)


def pack(root: Path, paths: list[str], out: Path) -> None:
    """``paths`` (relative to ``root``) into the tarball ``out``, written whole or not at all."""
    tmp = out.with_name(out.name + ".part")
    with tarfile.open(tmp, "w:gz") as tar:
        for path in paths:
            tar.add(root / path, arcname=path)
    os.replace(tmp, out)


# ------------------------------------------------------------------------------------------ the smoke check


def script_flags(script: Path) -> set[str]:
    """The ``--flags`` a benchmark script's parser takes (its ``add_argument`` calls, and those of
    ``quality.parse_table_arguments`` where it calls that)."""
    sources = [script] + ([script.parent / "quality.py"] if "parse_table_arguments" in script.read_text() else [])
    flags = {"--help"}
    for source in sources:
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
    return flags


def check_command(root: Path, argv: list[str]) -> list[str]:
    """What is wrong with a command of a slice, without running it: a script or test that does not exist, a flag
    its parser does not take. Empty when nothing is."""
    if argv[:3] == ["python3", "-m", "pytest"]:
        problems = []
        for arg in argv[3:]:
            if arg.startswith("tests/"):
                file, _, test = arg.partition("::")
                path = root / file
                if not path.is_file():
                    problems.append(f"{file}: no such test file")
                elif test and test.split("[")[0] not in {n.name for n in ast.walk(ast.parse(path.read_text()))
                                                         if isinstance(n, ast.FunctionDef)}:
                    problems.append(f"{arg}: no such test")
        return problems
    if argv[0] != "python3" or len(argv) < 2:
        return [f"{' '.join(argv)}: not a python3 command of a benchmark script"]
    script = root / argv[1]
    if not script.is_file():
        return [f"{argv[1]}: no such script"]
    known = script_flags(script)
    return [f"{argv[1]}: no flag {flag}" for flag in argv[2:]
            if flag.startswith("--") and flag.split("=")[0] not in known]


# ------------------------------------------------------------------------------------------ quality at scale


#: The peers' rows of quality at scale and the package each needs: a row whose package is not installed waits
#: for a call where it is (``WHEELS``), rather than being recorded as not available.
PEERS = {"bnb_8bit": "bitsandbytes", "torchao_8bit": "torchao", "torchao_4bit": "torchao", "flashoptim": "flashoptim"}


def next_quality_run(root: Path, left: int, device: str, dry_run: bool) -> tuple[tuple[str, str, int] | None, str]:
    """The next run of quality at scale's plan not on disk that fits in ``left`` seconds (the tiny one on a dry
    run), and a line on the plan's progress. A run's time is the longest of its size's runs on disk on this
    device, else one timed step times its steps; one that would not finish waits for the next call, rather
    than being cut off. Imports torch (through the benchmark)."""
    import importlib.util

    sys.path.insert(0, str(root / "benchmarks"))
    import quality_at_scale as q

    plan = [("tiny", "fp32", 0)] if dry_run else q.PLAN
    todo = [run for run in plan if not q.result_path(*run).exists()]
    progress = f"{len(plan) - len(todo)} of {len(plan)} runs of the plan on disk"
    if left <= 0:
        return None, progress
    waiting = []
    for size, row, seed in todo:
        package = PEERS.get(row)
        if package and importlib.util.find_spec(package) is None:
            waiting.append(f"{row} waits for {package}")
            continue
        done = [r["seconds"] for r in q.load(size).values() if r["status"] == "ok" and r.get("device") == device]
        need = 1.15 * max(done) + 20 if done else 1.3 * q.time_steps(size, device) * q.SIZES[size]["steps"] + 60
        if need > left:
            return None, f"{progress}; the next ({size} {row} seed {seed}) needs about {need:.0f} s, {left} s left"
        return (size, row, seed), progress
    return None, progress + (f"; {', '.join(sorted(set(waiting)))}" if waiting else "")


# ------------------------------------------------------------------------------------------ the command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["pending", "render", "begin", "finish", "check", "section", "quality-next"])
    parser.add_argument("args", nargs=argparse.REMAINDER,
                        help="check: the command; finish: NAME OUTCOME; section: PAGE NAME FILE")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout (default: this one)")
    parser.add_argument("--scratch", type=Path, help="begin, finish: the call's scratch folder")
    parser.add_argument("--out", type=Path, help="finish: OUT_DIR, where tree.tgz goes")
    parser.add_argument("--left", type=int, default=0, help="begin, finish, quality-next: seconds left in this call")
    parser.add_argument("--dry-run", action="store_true", help="a dry run on the CPU (recorded as one)")
    parser.add_argument("--smoke", action="store_true", help="begin, finish: the smallest dry run (every slice fits)")
    parser.add_argument("--no-gate", action="store_true", help="begin, finish: measure where the CUDA tests failed")
    parser.add_argument("--redo", default="", help="slices to run again though done (space-separated)")
    parser.add_argument("--skip", default="", help="slices not to run in this call (space-separated)")
    parser.add_argument("--device", default="unknown", help="finish: the GPU's name (the dry run's: cpu (dry run))")
    parser.add_argument("--on", default="cuda", choices=["cuda", "cpu"], help="quality-next: torch's device")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--date", default="unknown")
    parser.add_argument("--seconds", type=int, default=0, help="finish: how long the slice took")
    parser.add_argument("--detail", default="", help="finish: a line on the outcome (tests passed, runs done)")
    parser.add_argument("--detail-file", type=Path, help="quality-next: where the plan's progress is written")
    parser.add_argument("--unpack", type=Path, help="begin: a tree.dry-run.tgz of an earlier dry run, unpacked first")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    names = set(args.redo.split()) | set(args.skip.split())
    if names - set(BY_NAME):
        parser.error(f"--redo/--skip: no slice {sorted(names - set(BY_NAME))}; the slices are {list(BY_NAME)}")
    if args.command == "pending":
        todo = pending(load_state(root), code_hash(root), args.dry_run, set(args.redo.split()), set(args.skip.split()))
        for s in todo:
            print(f"{s.name}: {s.what} (needs {s.seconds} s{'' if s.cap else ', resumable'})")
        return 0
    if args.command == "render":
        for path in render(root, load_state(root)):
            print(f"{path.relative_to(root)} updated")
        return 0
    if args.command == "check":
        problems = check_command(root, args.args[1:] if args.args[:1] == ["--"] else args.args)
        print("\n".join(problems) or "ok: " + " ".join(args.args), file=sys.stderr if problems else sys.stdout)
        return 2 if problems else 0
    if args.command == "section":  # section PAGE NAME FILE: a result file's text as a docs section
        page, name, file = args.args
        path = root / "docs" / page
        path.write_text(replace_section(path.read_text(), name, Path(file).read_text()))
        return 0
    if args.command == "quality-next":
        run, progress = next_quality_run(root, args.left, args.on, args.dry_run)
        if args.detail_file is not None:
            args.detail_file.write_text(progress + "\n")
        print(" ".join(map(str, run)) if run else "")
        return 0
    # begin, then finish NAME OUTCOME after each slice: each prints the next slice to run and its time limit
    scratch = args.scratch
    if scratch is None:
        parser.error(f"{args.command} needs --scratch")
    attempted_file = scratch / "attempted.json"
    attempted = json.loads(attempted_file.read_text()) if attempted_file.is_file() else {}
    if args.command == "begin":  # what the call's tree.tgz is measured from: the checkout before anything it adds
        (scratch / "call.json").write_text(json.dumps(fingerprint(root)))
        if args.unpack is not None and args.unpack.is_file():  # an earlier dry run's results, to go on from
            with tarfile.open(args.unpack) as tar:
                tar.extractall(root, filter="data")
    else:  # finish NAME OUTCOME: record, stamp what the slice wrote, render the docs, pack what the call changed
        finish(root, scratch, args, attempted)
        attempted_file.write_text(json.dumps(attempted))
    # then the next slice, with the docs as they are before it runs (to find the sections it writes)
    pages = {p.relative_to(root).as_posix(): p.read_text()
             for p in [root / "README.md", *(root / "docs").rglob("*.md")]}
    (scratch / "pages.json").write_text(json.dumps(pages))
    todo = pending(load_state(root), code_hash(root), args.dry_run, set(args.redo.split()), set(args.skip.split()))
    chosen, limit, waiting = next_slice(todo, attempted, args.left, args.dry_run, args.smoke, not args.no_gate)
    (scratch / "waiting.txt").write_text("".join(f"left for the next call: {line}\n" for line in waiting))
    if chosen is not None:
        print(chosen.name, limit)
    return 0


def finish(root: Path, scratch: Path, args: argparse.Namespace, attempted: dict[str, str]) -> None:
    """A slice ended: its entry in the state file, a stamp on the sections it wrote, the docs rendered, and the
    files the call changed packed into ``OUT_DIR/tree.tgz`` (``tree.dry-run.tgz`` on a dry run)."""
    name, outcome = args.args
    state = load_state(root)
    entry = record(state, name, outcome, args.detail, args.seconds, args.device, args.commit, args.date,
                   code_hash(root), args.dry_run)
    save_state(root, state)
    attempted[name] = outcome
    line = f"*Measured on {where(entry)} (`benchmarks/cuda_all.sh`, slice `{name}`).*"
    for page, before in json.loads((scratch / "pages.json").read_text()).items():
        path = root / page
        text = path.read_text()
        if text != before:
            path.write_text(stamp(text, before, line))
    render(root, state)
    if args.out is not None:
        changed = changed_since(root, json.loads((scratch / "call.json").read_text()))
        pack(root, changed, args.out / ("tree.dry-run.tgz" if args.dry_run else "tree.tgz"))
        (scratch / "changed.txt").write_text("".join(f"{p}\n" for p in changed))
    detail = f": {args.detail}" if args.detail else ""
    print(f"{name}: {outcome} in {args.seconds} s{detail}{' (dry run)' if args.dry_run else ''}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
