"""What a user sees while the compiled CPU step is built or loaded (``lightning_baoc.kernels``): a build
is a pause before the first step (measured: 10.7 s on an idle 2-core machine, 79.5 s on a loaded one),
so it is said at warning level when it starts, every ``PROGRESS_SECONDS`` while it runs, and when it is
done, with the step that runs; a load from the cache is one info line.

The fast tests run the real ``_build`` and ``use_compiled`` with torch's ``load`` replaced by a pause
(no compiler needed); the slow one builds the real kernels in a fresh ``TORCH_EXTENSIONS_DIR``."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension
from torch import nn

from lightning_baoc import BlockwiseAdamW, kernels
from lightning_baoc.kernels import build

LOGGER = "lightning_baoc.kernels"


def _fake_build(monkeypatch: pytest.MonkeyPatch, where: Path, seconds: float, rebuild: bool = False) -> list[str]:
    """torch's ``load`` replaced by a pause of ``seconds`` that leaves a library in ``where``, where
    ``_build`` looks (a cached one stays as it is, unless ``rebuild``); returns the names it was called with."""
    calls: list[str] = []

    def load(name: str, **_: object) -> None:
        calls.append(name)
        time.sleep(seconds)
        library = where / name / f"{name}.so"
        if rebuild or not library.exists():
            library.parent.mkdir(parents=True, exist_ok=True)
            library.write_bytes(b"")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    monkeypatch.setattr(build, "_build_directory", lambda name: where / name)
    monkeypatch.setattr(kernels, "_ANNOUNCED", set())
    return calls


def _said(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]


def test_a_build_is_said_at_warning_level_with_progress_and_the_step_that_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _fake_build(monkeypatch, tmp_path, 0.45)
    monkeypatch.setattr(build, "PROGRESS_SECONDS", 0.1)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        status = build._build(kernels.compile_flags(), [])  # noqa: SLF001 - the build itself, torch's load faked
    said = _said(caplog)
    assert isinstance(status, build.KernelStatus) and status.available and status.detail.startswith("built in 0.")
    assert all(level == logging.WARNING for level, _ in said), said
    first, *progress, last = [text for _, text in said]
    assert first.startswith("lightning_baoc: building the compiled CPU optimizer step (first use on this machine: "
                            "10 s to a minute or more, once; later runs load it from the cache in "), first
    assert str(tmp_path) in first and first.endswith(" ...")
    assert len(progress) >= 2 and all(t.startswith("lightning_baoc: still building the compiled CPU optimizer step: ")
                                      and t.endswith(" s so far ...") for t in progress), progress
    assert last.startswith(f"lightning_baoc: built the compiled CPU optimizer step in {status.build_seconds:.1f} s; "
                           f"the optimizer steps CPU parameters with the compiled kernels (cached in {tmp_path}"), last

    # the same process asking which step runs: already said, not again
    monkeypatch.setattr(kernels, "_STATUS", status)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert kernels.use_compiled("auto") is True
    assert _said(caplog) == []


def test_a_load_from_the_cache_is_one_info_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = _fake_build(monkeypatch, tmp_path, 0.0)
    build._build(kernels.compile_flags(), [])  # noqa: SLF001 - the first build: the library is now cached
    monkeypatch.setattr(kernels, "_ANNOUNCED", set())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        status = build._build(kernels.compile_flags(), [])  # noqa: SLF001
        assert isinstance(status, build.KernelStatus) and status.detail == "loaded from the cache"
        monkeypatch.setattr(kernels, "_STATUS", status)
        assert kernels.use_compiled("auto") is True and kernels.use_compiled("auto") is True
    assert len(calls) == 2
    assert _said(caplog) == [(logging.INFO, "lightning_baoc: compiled CPU step kernels in use (loaded from the cache)")]


def test_a_cache_that_torch_rebuilds_says_it_is_rebuilding(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A library in the cache that torch rebuilds anyway (ninja finds it out of date: an object file
    removed): no start line (a load was expected), then a progress line that says it rebuilds, and the
    done line."""
    _fake_build(monkeypatch, tmp_path, 0.0)
    build._build(kernels.compile_flags(), [])  # noqa: SLF001
    so = next(tmp_path.rglob("*.so"))
    os.utime(so, (time.time() - 100, time.time() - 100))
    _fake_build(monkeypatch, tmp_path, 0.25, rebuild=True)
    monkeypatch.setattr(build, "PROGRESS_SECONDS", 0.1)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        status = build._build(kernels.compile_flags(), [])  # noqa: SLF001
    texts = [text for level, text in _said(caplog) if level == logging.WARNING]
    assert isinstance(status, build.KernelStatus) and status.detail.startswith("built in ")
    assert texts[0].startswith("lightning_baoc: rebuilding the compiled CPU optimizer step (its cache in "), texts
    assert "is out of date" in texts[0] and texts[-1].startswith("lightning_baoc: built the compiled CPU optimizer step in ")


def test_the_optimizer_that_triggers_the_build_says_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Through the public path: the first ``BlockwiseAdamW`` of a process on a machine without the
    library builds it and says so; a second says nothing more."""
    _fake_build(monkeypatch, tmp_path, 0.0)
    monkeypatch.setattr(kernels, "_STATUS", None)
    monkeypatch.setattr(build, "_loaded", lambda: False)
    monkeypatch.setattr(build, "_missing_tool", lambda: None)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        BlockwiseAdamW([nn.Parameter(torch.zeros(4))], kernels="auto")
        BlockwiseAdamW([nn.Parameter(torch.zeros(4))], kernels="auto")
    texts = [text for _, text in _said(caplog)]
    assert [t.split(" (")[0].split(" in ")[0] for t in texts] == [
        "lightning_baoc: building the compiled CPU optimizer step",
        "lightning_baoc: built the compiled CPU optimizer step",
    ], texts
    assert all(level == logging.WARNING for level, _ in _said(caplog))


_BUILD = textwrap.dedent(
    """
    import time
    import torch
    from torch import nn
    from lightning_baoc import BlockwiseAdamW, kernels
    from lightning_baoc.kernels import build
    build.PROGRESS_SECONDS = 2.0
    start = time.perf_counter()
    BlockwiseAdamW([nn.Parameter(torch.zeros(4))], kernels="compiled")
    print("STATUS", kernels.cpu_kernels().detail, f"{time.perf_counter() - start:.1f}")
    print("FROM", __import__("pathlib").Path(kernels.__file__).parents[2])
    """
)


@pytest.mark.slow
@pytest.mark.skipif(not kernels.cpu_kernels().available, reason=f"no compiled kernels: {kernels.cpu_kernels().detail}")
def test_a_real_first_build_and_a_later_load_say_so(tmp_path: Path) -> None:
    """The real kernels, built in a fresh ``TORCH_EXTENSIONS_DIR`` with nothing configured in logging
    (Python prints warnings to stderr then): the start line, progress lines, the done line with the step
    that runs; a second process loads them from the cache and prints nothing."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    env.pop(kernels.KERNELS_ENV, None)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    first = subprocess.run([sys.executable, "-c", _BUILD], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr[-3000:]
    lines = [line for line in first.stderr.splitlines() if line.startswith("lightning_baoc:")]
    assert lines[0].startswith("lightning_baoc: building the compiled CPU optimizer step (first use on this machine"), lines
    assert any(line.startswith("lightning_baoc: still building the compiled CPU optimizer step: ") for line in lines), lines
    assert lines[-1].startswith("lightning_baoc: built the compiled CPU optimizer step in ") and (
        "; the optimizer steps CPU parameters with the compiled kernels" in lines[-1]
    ), lines
    assert "STATUS built in " in first.stdout, first.stdout
    again = subprocess.run([sys.executable, "-c", _BUILD], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "STATUS loaded from the cache" in again.stdout, again.stdout + again.stderr[-2000:]
    assert "lightning_baoc:" not in again.stderr, again.stderr


def test_a_step_waiting_for_another_process_s_build_says_so_and_for_how_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Another process holds the build's lock: a warning when the wait starts, one every ``PROGRESS_SECONDS``
    with the time so far, and one when it ends with how long it took."""
    import threading

    monkeypatch.setattr(build, "PROGRESS_SECONDS", 0.1)
    lock = tmp_path / "lock"
    lock.touch()
    threading.Timer(0.45, lock.unlink).start()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        build._wait_for_build_lock(tmp_path, poll=0.02)  # noqa: SLF001 - the wait itself
    said = _said(caplog)
    assert all(level == logging.WARNING for level, _ in said), said
    texts = [text for _, text in said]
    assert texts[0].startswith("lightning_baoc: waiting for another process's build of the CPU kernels ("), texts
    assert any(t.startswith("lightning_baoc: still waiting for another process's build of the CPU kernels: ") for t in texts), texts
    assert texts[-1].startswith("lightning_baoc: waited ") and texts[-1].endswith(
        "s for another process's build of the CPU kernels; loading them"), texts


def _checkout(root: Path) -> Path:
    """A copy of the package under ``root``, as another checkout of the same source holds it."""
    import shutil

    shutil.copytree(Path(kernels.__file__).resolve().parents[1], root / "lightning_baoc",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.mark.slow  # two real builds; the cache's keys are held fast by tests/kernels/test_build_cache.py
@pytest.mark.skipif(not kernels.cpu_kernels().available, reason=f"no compiled kernels: {kernels.cpu_kernels().detail}")
def test_two_checkouts_of_the_same_source_compile_once(tmp_path: Path) -> None:
    """A working tree and a fresh clone (two copies of the package at two paths) share one build: the
    first process builds, the others load from the cache, and the library is never rebuilt. (torch's
    ``build.ninja`` records the source's path: built from each checkout's own, every load of the other
    checkout recompiled; measured 28 rebuilds in an hour on a CI machine.)"""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    env.pop(kernels.KERNELS_ENV, None)
    a, b = _checkout(tmp_path / "a"), _checkout(tmp_path / "b")
    details = []
    for checkout in (a, b, a):
        run_env = dict(env, PYTHONPATH=str(checkout) + os.pathsep + env.get("PYTHONPATH", ""))
        done = subprocess.run([sys.executable, "-c", _BUILD], cwd=checkout, env=run_env, capture_output=True, text=True,
                              timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        assert f"FROM {checkout}" in done.stdout, done.stdout  # the checkout's own package ran
        details.append(next(line for line in done.stdout.splitlines() if line.startswith("STATUS ")))
        if len(details) == 1:
            built = {p: p.stat().st_mtime_ns for p in (tmp_path / "ext").rglob("*.so")}
    assert details[0].startswith("STATUS built in "), details
    assert details[1].startswith("STATUS loaded from the cache") and details[2].startswith("STATUS loaded from the cache"), details
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "ext").rglob("*.so")} == built
