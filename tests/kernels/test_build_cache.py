"""The CPU kernels' build cache (``lightning_baoc.kernels.build``): one directory per source and build
command, so that environments and processes whose commands differ never rebuild each other's library, and
a library in the cache that does not load is rebuilt once, or named with its path and the loader's reason.

The fast tests build a stand-in source (no torch headers: it compiles and links in about a second) with the
real ``_build`` and torch's real ``load`` in a ``TORCH_EXTENSIONS_DIR`` under ``tmp_path``. A new process is
simulated by a fresh torch versioner (torch's record of what a process has built), or is a real subprocess
where the library must not be loaded in the test's own process (the loader returns a library it has loaded
by path, whatever the file holds now). The slow tests start processes of two environments at once, and build
the real kernels.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.utils.cpp_extension as cpp_extension
from torch.utils._cpp_extension_versioner import ExtensionVersioner

from lightning_baoc import kernels
from lightning_baoc.kernels import build

LOGGER = "lightning_baoc.kernels"
ROOT = Path(__file__).resolve().parents[2]
#: A library with one function: builds in about a second (no torch headers) and loads anywhere.
STAND_IN = 'extern "C" int lightning_baoc_stand_in() { return 42; }\n'
#: A library that links (a shared library may leave symbols to the loader) and never loads: a data symbol
#: that nothing defines, which the loader resolves when it opens the library.
UNLOADABLE = ('extern int lightning_baoc_no_such_symbol;\n'
              'extern "C" int* lightning_baoc_stand_in() { return &lightning_baoc_no_such_symbol; }\n')

MISSING = build._missing_tool()  # noqa: SLF001 - no compiler or no ninja: nothing here can build
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"cannot build: {MISSING}")


@pytest.fixture
def ext(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The extensions directory of this test, with the stand-in source in place of ``cpu_step.cpp``."""
    source = tmp_path / "stand_in.cpp"
    source.write_text(STAND_IN)
    monkeypatch.setattr(build, "SOURCE", source)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv("TORCH_NO_COMPILER_WRAPPER", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(kernels, "_ANNOUNCED", set())
    return tmp_path / "ext"


def _new_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a new process starts with: no record of what torch has built (torch skips the build of a name
    it built before in a process, and so would hide every rebuild)."""
    monkeypatch.setattr(cpp_extension, "JIT_EXTENSION_VERSIONER", ExtensionVersioner())


def _outputs(ext: Path) -> dict[str, int]:
    """Every object file and library under ``ext``, with its modification time (ns): what a build rewrites."""
    return {str(p.relative_to(ext)): p.stat().st_mtime_ns for p in sorted(ext.rglob("*")) if p.suffix in (".o", ".so")}


def _runs(ext: Path) -> dict[str, int]:
    """How many times ninja has run each command under ``ext`` (compile and link; ninja logs every run)."""
    runs: dict[str, int] = {}
    for log in ext.glob("*/.ninja_log"):
        for line in log.read_text().splitlines()[1:]:
            key = f"{log.parent.name}/{line.split(chr(9))[3]}"
            runs[key] = runs.get(key, 0) + 1
    return runs


def _detail(status: build.KernelStatus | str) -> str:
    return status.detail if isinstance(status, build.KernelStatus) else f"failed: {status}"


FLAGS = kernels.compile_flags()


def test_two_environments_with_the_same_torch_keep_their_own_builds(
    ext: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two virtual environments with the same torch: its headers and libraries at two paths (here the second
    reaches torch through a symlink), so two build commands. Alternating processes of the two build once
    each and then load; sharing one directory, each rebuilt the other's library at every alternation."""
    torch_dir = Path(cpp_extension._TORCH_PATH)  # noqa: SLF001 - where torch's build command finds it
    other = tmp_path / "venv" / "site-packages" / "torch"
    other.parent.mkdir(parents=True)
    other.symlink_to(torch_dir, target_is_directory=True)
    details, outputs = [], []
    for where in (torch_dir, other, torch_dir, other, torch_dir):
        _new_process(monkeypatch)
        monkeypatch.setattr(cpp_extension, "_TORCH_PATH", str(where))
        monkeypatch.setattr(cpp_extension, "TORCH_LIB_PATH", str(where / "lib"))
        details.append(_detail(build._build(FLAGS, ["-fopenmp"])))  # noqa: SLF001 - the build itself
        outputs.append(_outputs(ext))
    assert [d.split(" in ")[0] for d in details[:2]] == ["built", "built"], details
    assert details[2:] == ["loaded from the cache"] * 3, details
    assert len(outputs[1]) == 4 and outputs[1] == outputs[2] == outputs[3] == outputs[4], outputs  # 2 x (.o, .so)
    assert sorted(_runs(ext).values()) == [1, 1, 1, 1], _runs(ext)  # one compile and one link per environment
    commands = [p.read_text() for p in sorted(ext.glob("*/build.ninja"))]
    assert len(commands) == 2 and sum(f"-isystem {other}/include " in c for c in commands) == 1, commands


def test_processes_with_other_build_commands_keep_their_own_builds(
    ext: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Processes of one environment started in different ways: a compiler wrapper (ccache) on one's PATH,
    the compiler named by its path in another's CXX, an extra flag. Each builds once, and alternating they
    all load; sharing one directory, ninja rebuilt the object file whenever the command alternated."""
    wrapper = tmp_path / "bin" / "ccache"
    wrapper.parent.mkdir()
    wrapper.write_text('#!/bin/sh\nexec "$@"\n')  # a compiler wrapper that only runs the compiler
    wrapper.chmod(0o755)
    path = os.environ["PATH"]
    plain = {"TORCH_NO_COMPILER_WRAPPER": "1"}
    variants = [
        (plain, FLAGS),
        ({"PATH": f"{wrapper.parent}{os.pathsep}{path}"}, FLAGS),
        ({**plain, "CXX": shutil.which("c++") or "c++"}, FLAGS),
        (plain, [*FLAGS, "-DLIGHTNING_BAOC_STAND_IN=1"]),
    ]
    details = []
    for _ in range(2):
        for env, flags in variants:
            _new_process(monkeypatch)
            monkeypatch.setenv("PATH", path)
            for key in ("TORCH_NO_COMPILER_WRAPPER", "CXX"):
                monkeypatch.delenv(key, raising=False)
            for key, value in env.items():
                monkeypatch.setenv(key, value)
            details.append(_detail(build._build(flags, ["-fopenmp"])))  # noqa: SLF001 - the build itself
        if len(details) == len(variants):
            built = _outputs(ext)
    assert [d.split(" in ")[0] for d in details[:4]] == ["built"] * 4, details
    assert details[4:] == ["loaded from the cache"] * 4, details
    assert len(built) == 8 and _outputs(ext) == built, (built, _outputs(ext))
    assert sorted(_runs(ext).values()) == [1] * 8, _runs(ext)
    commands = [p.read_text() for p in ext.glob("*/build.ninja")]
    assert sorted(c.splitlines()[1] for c in commands) == sorted(
        ["cxx = c++", "cxx = c++", "cxx = ccache c++", f"cxx = {shutil.which('c++')}"]), commands


_BUILD_STAND_IN = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from lightning_baoc.kernels import build
    build.SOURCE = Path(sys.argv[1])
    status = build._build(build.compile_flags(), ["-fopenmp"])
    print("STATUS", status.detail if isinstance(status, build.KernelStatus) else f"failed: {status}")
    """
)


def _in_another_process(source: Path, ext: Path) -> str:
    """Build (or load) the stand-in ``source`` in a new process; its status."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _BUILD_STAND_IN, str(source)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return next(line for line in done.stdout.splitlines() if line.startswith("STATUS "))


@pytest.mark.parametrize("keep", [pytest.param(32, marks=pytest.mark.slow), "half"])  # a cut header: slow (a rebuild)
def test_a_truncated_library_in_the_cache_is_rebuilt_once_and_loads(
    keep: int | str, ext: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A library cut short (a process killed while linking, a full disk) that ninja finds up to date: the
    next process says it rebuilds it, and why, rebuilds it once (object file and library) and loads it; it
    is not reported as a directory that cannot be written. Cut within its ELF header the loader refuses it;
    cut after it, the loader would map it and the process die of a bus error, so it is found before the
    load. Built in another process: this one must not have loaded the whole library (the loader returns a
    library it has loaded by its path, whatever the file holds now)."""
    assert _in_another_process(build.SOURCE, ext).startswith("STATUS built in ")
    [library] = ext.glob("*/*.so")
    whole = library.stat().st_size
    keep = whole // 2 if keep == "half" else keep
    os.truncate(library, keep)
    cut = _outputs(ext)
    _new_process(monkeypatch)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        status = build._build(FLAGS, ["-fopenmp"])  # noqa: SLF001 - the build itself
    assert isinstance(status, build.KernelStatus) and status.available and status.detail.startswith("built in "), status
    assert library.stat().st_size == whole
    assert all(_outputs(ext)[name] > mtime for name, mtime in cut.items()) and len(cut) == 2, (cut, _outputs(ext))
    said = [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]
    why = (f"does not load ({os.path.realpath(library)}: file too short)" if keep < 64
           else f"is cut short ({keep} of its {whole} bytes)")
    assert said[0] == (f"lightning_baoc: rebuilding the compiled CPU optimizer step: its library in the cache "
                       f"({library}) {why} ..."), said
    assert said[-1].startswith("lightning_baoc: built the compiled CPU optimizer step in "), said
    _new_process(monkeypatch)
    assert _detail(build._build(FLAGS, ["-fopenmp"])) == "loaded from the cache"  # noqa: SLF001
    assert sorted(_runs(ext).values()) == [2, 2], _runs(ext)  # the first build and the one rebuild


def test_a_library_that_does_not_load_is_named_with_its_path_and_reason(
    ext: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A library that links and does not load (a symbol nothing defines): built afresh, the status names it
    with its path and the loader's reason, and its fix (not "cannot be written"); later processes report it
    without rebuilding it. Cached without that note (left by a process that stopped before it wrote it), it
    is rebuilt once, and named again."""
    build.SOURCE.write_text(UNLOADABLE)
    flags = kernels.compile_flags()
    statuses, outputs = [], []
    for forget_the_note in (False, False, True):
        _new_process(monkeypatch)
        if forget_the_note:
            for note in ext.glob(f"*/{build.FAILED_NOTE}"):
                note.unlink()
        statuses.append(build._build(flags, ["-fopenmp"]))  # noqa: SLF001 - the build itself
        outputs.append(_outputs(ext))
    [library] = ext.glob("*/*.so")
    for status in statuses:
        assert isinstance(status, build.KernelStatus) and not status.available, status
        assert status.detail == (f"their library {library}, built afresh, does not load: {os.path.realpath(library)}: "
                                 f"undefined symbol: lightning_baoc_no_such_symbol"), status.detail
        assert status.fix.endswith(f"then delete {library.parent} to build them again"), status.fix
    assert outputs[1] == outputs[0]  # the note: not rebuilt
    assert all(outputs[2][name] > mtime for name, mtime in outputs[1].items()) and len(outputs[1]) == 2  # rebuilt once
    monkeypatch.setattr(kernels, "_STATUS", statuses[-1])
    with pytest.raises(RuntimeError, match=f"their library {library}, built afresh, does not load: .*undefined symbol"):
        kernels.use_compiled("compiled")


_STAND_IN_AT_ONCE = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from lightning_baoc.kernels import build
    build.SOURCE = Path(sys.argv[1])
    time.sleep(max(0.0, float(sys.argv[2]) - time.time()))  # all processes start their build together
    status = build._build(build.compile_flags(), ["-fopenmp"])
    print("STATUS", status.detail if isinstance(status, build.KernelStatus) else f"failed: {status}")
    """
)


@pytest.mark.slow
def test_processes_of_two_environments_starting_at_once_build_once_per_environment(ext: Path, tmp_path: Path) -> None:
    """Six processes at once, three whose torch is reached through a symlink (another environment's path):
    two builds, one per environment (torch's lock in each directory: the others wait and load), and a later
    process of either loads."""
    import time

    other = tmp_path / "venv"
    other.mkdir()
    (other / "torch").symlink_to(Path(cpp_extension._TORCH_PATH), target_is_directory=True)  # noqa: SLF001
    base = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext))
    paths = {"one": str(ROOT), "two": f"{other}{os.pathsep}{ROOT}"}  # the symlinked torch first on the path
    start = time.time() + 8.0  # after every process has imported torch
    running = [(which, subprocess.Popen(
        [sys.executable, "-c", _STAND_IN_AT_ONCE, str(build.SOURCE), str(start)],
        env=dict(base, PYTHONPATH=paths[which]), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for which in ("one", "two") * 3]
    results: dict[str, list[str]] = {"one": [], "two": []}
    for which, process in running:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        results[which].append(next(line for line in out.splitlines() if line.startswith("STATUS ")))
    # every process has the library (one that waited for another's build says it was built meanwhile)
    assert all(line.startswith(("STATUS built in ", "STATUS loaded from the cache")) for lines in results.values()
               for line in lines), results
    assert sorted(_runs(ext).values()) == [1, 1, 1, 1], _runs(ext)  # per environment, one compile and one link
    built = _outputs(ext)
    for which in ("one", "two"):
        env = dict(base, PYTHONPATH=paths[which])
        later = subprocess.run([sys.executable, "-c", _STAND_IN_AT_ONCE, str(build.SOURCE), "0"], env=env,
                               capture_output=True, text=True, timeout=300)
        assert "STATUS loaded from the cache" in later.stdout, later.stdout + later.stderr[-3000:]
    assert _outputs(ext) == built


_REAL = textwrap.dedent(
    """
    from lightning_baoc import kernels
    print("STATUS", kernels.cpu_kernels().detail)
    print("TORCH", __import__("torch").__file__)
    """
)


@pytest.mark.slow
def test_the_real_kernels_of_two_environments_are_built_once_each(tmp_path: Path) -> None:
    """The real kernels, in processes of two environments alternating (the second's torch through a
    symlink): two builds, then loads; the libraries are never rebuilt."""
    other = tmp_path / "venv"
    other.mkdir()
    (other / "torch").symlink_to(Path(cpp_extension._TORCH_PATH), target_is_directory=True)  # noqa: SLF001
    ext = tmp_path / "ext"
    base = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext))
    base.pop(kernels.KERNELS_ENV, None)
    paths = {"one": str(ROOT), "two": f"{other}{os.pathsep}{ROOT}"}
    lines = []
    for which in ("one", "two", "one", "two"):
        done = subprocess.run([sys.executable, "-c", _REAL], env=dict(base, PYTHONPATH=paths[which]),
                              capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
        lines.append(done.stdout.split())
        if len(lines) == 2:
            built = _outputs(ext)
    assert lines[1][-1].startswith(str(other)), lines  # the second environment's torch ran
    assert [line[1] for line in lines] == ["built", "built", "loaded", "loaded"], lines
    assert len(built) == 4 and _outputs(ext) == built
