"""Shared by the benchmarks: the machine they ran on, writing a table into its docs page, and runs in
a fresh process with their peak resident memory (:func:`run_child`).

Each benchmark owns one section of a page under ``docs/`` (the documentation site), between
``<!-- NAME:start -->`` and ``<!-- NAME:end -->``; :func:`write_docs_section` replaces what is between
the markers (and adds them at the end of the page if they are missing). ``--docs`` is the flag that
writes; ``--readme`` is its former name, kept so that the commands recorded on the pages still run.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def examples_on_path() -> None:
    """Put ``examples/`` (the workloads the benchmarks train: ``workloads.py``) first on ``sys.path``."""
    path = str(ROOT / "examples")
    if path not in sys.path:
        sys.path.insert(0, path)


@contextlib.contextmanager
def checkout(ref: str) -> Iterator[Path]:
    """A detached git worktree of this repository at ``ref`` (a commit, branch or tag), removed on exit: the
    library as it was there, for the benchmarks that compare two versions on one machine."""
    scratch = Path(tempfile.mkdtemp(prefix="checkout-"))
    tree = scratch / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), ref], cwd=ROOT, check=True,
                   capture_output=True, text=True)
    try:
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
        shutil.rmtree(scratch, ignore_errors=True)


def machine() -> str:
    """One line: the GPU where torch sees one, CPU model, cores, memory, Python and torch versions."""
    cpu = platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip():
                    break  # the first processor's fields
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    if "model name" in fields:
        # a virtual machine's CPU may be named only by its line ("AMD EPYC"): its family and model tell one
        # generation from another (family 23 model 1: Zen 1; family 25 model 17: Zen 4)
        cpu = fields["model name"]
        if "cpu family" in fields and "model" in fields:
            cpu += f" (family {fields['cpu family']}, model {fields['model']})"
    mem = ""
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        mem = f", {pages * size / 2**30:.0f} GiB RAM"
    except (ValueError, OSError, AttributeError):
        pass
    gpu = ""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}), "
    return (
        f"{gpu}{cpu}, {os.cpu_count()} cores{mem}, Python {platform.python_version()}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} torch threads"
    )


def command() -> str:
    """The command that ran this benchmark, as typed from the repository root."""
    return "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])


def write_docs_section(page: str, name: str, body: str) -> Path:
    """Replace the section ``name`` of the docs page ``page`` (a path under ``docs/``) with ``body``.

    Returns the page's path. The page must exist: every page is in the site's navigation.
    """
    path = DOCS / page
    if not path.is_file():
        pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
        raise FileNotFoundError(f"page={page!r}: no such docs page ({path}); the pages are {pages}")
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    text = path.read_text()
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
    print(f"{path.relative_to(ROOT)} updated (section {name})")
    return path


def file_text(spec: str) -> str:
    """The text of ``spec``: a file, or ``REV:PATH`` for a file of this repository at a git revision."""
    if Path(spec).is_file():
        return Path(spec).read_text()
    rev, sep, path = spec.partition(":")
    if not sep:
        raise FileNotFoundError(f"{spec}: no such file (a file at a git revision is written REV:PATH)")
    return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True, text=True).stdout


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def run_child(module: str, function: str, run: str, config: dict[str, Any]) -> dict[str, Any]:
    """``module.function(run, config)`` in a fresh process (a benchmark module of this folder): the
    dict it returns, with ``"peak_rss"``, the process's peak resident set in bytes (``os.wait4``)."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import importlib; "
        "m = importlib.import_module(sys.argv[2]); f = getattr(m, sys.argv[3]); "
        "c = json.loads(sys.argv[5]); w = m.Workload(**c) if hasattr(m, 'Workload') else c; "
        "print('RESULT ' + json.dumps(f(sys.argv[4], w)))"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # glibc raises its mmap threshold as tensors are freed, after which freed tensors linger in the
    # heap and the resident size stops following live memory; a fixed threshold keeps every tensor
    # of 64 KiB or more in its own mapping, returned when freed (the same for every run)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(64 * 1024))
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(Path(__file__).parent), module, function, run, json.dumps(config)],
            stdout=out, stderr=err, text=True, env=env, cwd=str(ROOT),
        )
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own resource usage
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise RuntimeError(f"run {run!r} failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"run {run!r} printed no result:\n{stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    result["peak_rss"] = int(usage.ru_maxrss) * 1024  # KiB on Linux
    return result
