"""What builds, caches, locks and announces the compiled CPU kernels (``cpu_step.cpp``).

:func:`load_kernels` builds the kernels with :func:`torch.utils.cpp_extension.load` the first time a process
needs them (measured: 10.7 s on an idle 2-core machine, 79.5 s on a loaded one) and loads them from torch's
extension cache afterwards (under a second). Which step runs, and when to ask for the kernels, is decided in
:mod:`lightning_baoc.kernels`.

The cache. torch builds with ninja, which rebuilds a library whenever the command that built it changes. The
command holds more than the flags: the compiler and a compiler wrapper (ccache, sccache) found on ``PATH``,
torch's include and library paths as this process reached them, Python's include path. Two environments with
the same torch (two virtual environments, one torch reached through a symlink) and processes of one environment
started in different ways differ there; sharing one cache directory, each rebuilt the other's library at every
alternation. The directory is therefore named by the source and by the build command itself
(:func:`_build_name`): the ``build.ninja`` torch would write, rendered for a placeholder name and source. Two
processes share a directory only where their commands are the same, so ninja never finds another's command in
it; several processes starting at once build once per directory (torch's lock file in it: the others wait,
:func:`_wait_for_build_lock`), and every checkout of the same source shares it (:func:`_shared_source`).

A library in the cache that is cut short (a process killed while linking, a full disk) or does not load is
rebuilt once: ninja finds it up to date whatever its content. One cut short is found before it is loaded (the
loader would map it and the process die of a bus error); one built afresh that does not load is reported with
its path and the loader's reason, and not rebuilt again by later processes.

What a user sees: a build is a pause before the first step, so it is said at warning level (the
``lightning_baoc.kernels`` logger; Python's logging prints warnings to stderr even where nothing is
configured): one line when it starts, one every :data:`PROGRESS_SECONDS` while it runs, and one when it is
done that says which step runs. A load from the cache takes no noticeable time and is said once, at info
level, by :func:`lightning_baoc.kernels.use_compiled`: a warning on every run's start would teach users to
skip warnings.

Example:
    >>> from lightning_baoc.kernels import build
    >>> status = build.load_kernels()  # doctest: +SKIP
    >>> status.available, status.detail  # doctest: +SKIP
    (True, 'loaded from the cache')
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import os
import shutil
import struct
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

# the logger the package documents for its kernels (a user filters it by this name)
log = logging.getLogger("lightning_baoc.kernels")

SOURCE = Path(__file__).with_name("cpu_step.cpp")
#: The start of the cache directory's name (and the library's): :func:`_build_name` appends the digests.
STEM = "lightning_baoc_cpu_step"


@dataclass(frozen=True)
class KernelStatus:
    """Whether the compiled CPU kernels are loaded, and how (or why not).

    Example:
        >>> KernelStatus(True, "loaded from the cache").available
        True
    """

    available: bool
    detail: str  # "built in 41.2 s", "loaded from the cache", or the reason they are not available
    build_seconds: float = 0.0
    fix: str = "Install a C++ compiler and ninja"  # what makes them available, where they are not
    said: bool = False  # a build said at warning level which step runs: it need not be said again


def compile_flags() -> list[str]:
    """Compiler flags of the kernels: optimized, no contraction into fused multiply-adds beyond the
    ones written (results must match the eager step), vector instructions the CPU has.

    Example:
        >>> "-ffp-contract=off" in compile_flags()
        True
    """
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512") and sys.platform.startswith("linux"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    if capability == "AVX512" and sys.platform.startswith("linux"):
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512"]
    return flags


#: The source path the build command is rendered with for the cache key (:func:`_build_command`): the real
#: one is the copy in the directory the key names (:func:`_shared_source`), so it cannot enter the key.
_PLACEHOLDER_SOURCE = os.path.join(os.sep, STEM, SOURCE.name)


def _takes(function: Callable[..., Any], **arguments: Any) -> Any:
    """``function`` called with those of ``arguments`` it declares: torch's private build helpers gain and
    lose parameters between versions (the SYCL ones, for one); a required one missing raises ``TypeError``."""
    declared = inspect.signature(function).parameters
    return function(**{key: value for key, value in arguments.items() if key in declared})


def _build_command(flags: list[str], ldflags: list[str]) -> str:
    """The build command torch runs for the kernels with ``flags`` and ``ldflags`` in this process.

    It is the ``build.ninja`` torch writes (its private ``_write_ninja_file_to_build_library``, rendered
    into a temporary directory) for a placeholder name and source: the compiler and its wrapper, torch's
    include and library paths as this process reached them, Python's include path and every flag. Where
    this torch lacks that helper or it changed, the same parts as its public functions give them.
    """
    from torch.utils import cpp_extension as ext

    options = {"with_cuda": False, "with_sycl": False, "verbose": False, "is_standalone": False}
    try:
        linker = _takes(ext._prepare_ldflags, extra_ldflags=list(ldflags), **options)  # noqa: SLF001 - see docstring
        with tempfile.TemporaryDirectory(prefix="lightning_baoc_") as scratch:
            ninja = os.path.join(scratch, "build.ninja")
            _takes(ext._write_ninja_file_to_build_library, path=ninja, name=STEM,  # noqa: SLF001 - see docstring
                   sources=[_PLACEHOLDER_SOURCE], extra_cflags=list(flags), extra_cuda_cflags=[], extra_sycl_cflags=[],
                   extra_ldflags=linker, extra_include_paths=[], **options)
            return Path(ninja).read_text()
    except (AttributeError, TypeError, ValueError, OSError) as err:  # a torch whose private helpers differ
        log.debug("lightning_baoc: the cache key of the CPU kernels from their build's parts (%s: %s)",
                  type(err).__name__, err)
    # what torch's build.ninja holds, from public functions: the same differences name different directories
    compiler = os.environ.get("CXX", "c++")
    wrapped = not os.environ.get("TORCH_NO_COMPILER_WRAPPER")
    wrappers = [shutil.which(w) or "" for w in ("ccache", "sccache")] if wrapped else []
    parts = [compiler, *wrappers, *ext.include_paths(), *ext.library_paths(), sysconfig.get_path("include") or "",
             *flags, *ldflags, sys.platform]
    return "\n".join(parts)


def _build_name(flags: list[str], ldflags: list[str]) -> str:
    """The name of the kernels' cache directory (and library): the source's digest, then the build command's.

    The command's digest takes in torch's version too: torch's headers are included as system headers,
    whose changes ninja does not track, so an upgrade in place (same paths, new headers) must not find the
    old library.
    """
    source = hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:8]
    command = hashlib.sha1(f"{torch.__version__}\n{_build_command(flags, ldflags)}".encode()).hexdigest()[:12]
    return f"{STEM}_{source}_{command}"


def _missing_tool() -> str | None:
    """Why a build cannot start (no compiler, no ninja), or ``None``."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler found ({compiler!r} is not on PATH)"
    try:
        from torch.utils.cpp_extension import is_ninja_available
    except ImportError:  # pragma: no cover - every supported torch has it
        return "torch.utils.cpp_extension is not available"
    if not is_ninja_available():
        return "the 'ninja' build tool is not installed (pip install ninja)"
    return None


def _loaded() -> bool:
    """Whether this process has the operators already (loaded by an earlier status, or by hand)."""
    return hasattr(torch.ops.lightning_baoc, "adamw_step")


def load_kernels() -> KernelStatus:
    """Build (first use of this source and build command) or load the kernels; their status.

    Where the compiler has no OpenMP (Apple's clang), the same kernels are built without it, for one thread.

    Example:
        >>> load_kernels().detail  # doctest: +SKIP
        'loaded from the cache'
    """
    if _loaded():
        return KernelStatus(True, "already loaded")
    missing = _missing_tool()
    if missing is not None:
        return KernelStatus(False, missing)
    flags = compile_flags()
    first = _build(flags, ["-fopenmp"])
    if isinstance(first, KernelStatus):
        return first
    # a compiler without OpenMP (Apple's clang): the same kernels, on one thread
    serial = [f for f in flags if f != "-fopenmp"]
    second = _build(serial, [])
    if isinstance(second, KernelStatus):
        return KernelStatus(True, f"{second.detail}, without OpenMP: one thread ({first})", second.build_seconds,
                            said=second.said)
    return KernelStatus(False, f"the build failed: {first}")


#: A build lock older than this (seconds) was left by a process that stopped while it held it: a build
#: takes tens of seconds, and torch waits for the lock to go without a limit.
STALE_LOCK_SECONDS = 300.0


def _build_directory(name: str) -> Path | None:
    """Where torch builds and caches the extension ``name`` (``None`` where this torch does not say)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # private: how torch names its cache

        return Path(_get_build_directory(name, verbose=False))
    except (ImportError, TypeError, OSError):
        return None


def _wait_for_build_lock(directory: Path | None, poll: float = 0.5) -> None:
    """Wait while another process builds in ``directory`` (its ``lock`` file), as torch would, but not
    forever: a lock that stays past :data:`STALE_LOCK_SECONDS` of age was left by a process that stopped
    while building (killed, interrupted), and is removed with a warning that names it."""
    if directory is None:
        return
    lock = directory / "lock"
    said = False
    start = time.perf_counter()
    last = start
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except OSError:  # no lock: nobody is building
            if said:
                log.warning("lightning_baoc: waited %.0f s for another process's build of the CPU kernels; loading them",
                            time.perf_counter() - start)
            return
        if age > STALE_LOCK_SECONDS:
            lock.unlink(missing_ok=True)
            warnings.warn(
                f"lightning_baoc: removed a stale lock of the CPU kernels' build ({lock}, {age:.0f} s old), left by "
                f"a process that stopped while it held it; loading (or building) them now.",
                RuntimeWarning,
                stacklevel=5,
            )
            return
        if not said:
            said = True
            # a pause before the first step, as a build is: said at the build's level
            log.warning("lightning_baoc: waiting for another process's build of the CPU kernels (%s); delete the lock "
                        "if no other process is building", lock)
        elif time.perf_counter() - last >= PROGRESS_SECONDS:
            last = time.perf_counter()
            log.warning("lightning_baoc: still waiting for another process's build of the CPU kernels: %.0f s so far ...",
                        last - start)
        time.sleep(poll)


#: Seconds between two progress lines of a build (a build takes 10 s to over a minute: a line every 10 s
#: says it is not stuck without flooding the log).
PROGRESS_SECONDS = 10.0
#: What the build is, in the messages.
BUILT = "the compiled CPU optimizer step"
#: Which step runs once the kernels are there, in the messages.
RUNS = "the optimizer steps CPU parameters with the compiled kernels"


class _BuildProgress:
    """Says that a build runs while it blocks this thread: a warning when it starts (``fresh``: nothing
    cached), one from a helper thread every :data:`PROGRESS_SECONDS` while it runs.

    A thread, not torch's ``verbose=True``: torch's verbose output is ninja's and the compiler's command
    lines on stdout (dozens of long lines, not the logging a user can filter or a test can capture),
    and says nothing about how long it has been running. Where something was cached but torch rebuilds
    anyway (ninja finds it out of date: an object file removed, a cache written by an older version of this
    package), the first progress line says so; where the cached library does not load and is rebuilt,
    :meth:`rebuilding` says so at once.
    """

    def __init__(self, directory: Path | None, fresh: bool, every: float | None = None) -> None:
        self.directory = directory
        self.fresh = fresh
        self.every = PROGRESS_SECONDS if every is None else every
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = 0.0
        self._said = False

    def __enter__(self) -> _BuildProgress:
        self._start = time.perf_counter()
        if self.fresh:
            log.warning("lightning_baoc: building %s (first use on this machine: 10 s to a minute or more, once; "
                        "later runs load it from the cache in %s) ...", BUILT, self.directory or "torch's extensions directory")
        self._thread = threading.Thread(target=self._tick, name="lightning_baoc-build-progress", daemon=True)
        self._thread.start()
        return self

    def rebuilding(self, why: str) -> None:
        """Say now that the cached build is rebuilt, and why; the progress lines that follow say "still"."""
        self._said = True
        log.warning("lightning_baoc: rebuilding %s: %s ...", BUILT, why)

    def _tick(self) -> None:
        while not self._done.wait(self.every):
            elapsed = time.perf_counter() - self._start
            if self.fresh or self._said:
                log.warning("lightning_baoc: still building %s: %.0f s so far ...", BUILT, elapsed)
            else:
                log.warning("lightning_baoc: rebuilding %s (its cache in %s is out of date): %.0f s so far ...", BUILT,
                            self.directory, elapsed)
            self._said = True

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


def _shared_source(directory: Path | None) -> Path:
    """The kernels' source at a path every checkout of it shares: a copy in its build directory.

    torch's ``build.ninja`` records the path of the source it compiles. The directory is named by the
    source's content (:func:`_build_name`), so two checkouts of the same source (a working tree and a
    fresh clone) share it; built from each checkout's own path, each load rewrote ``build.ninja`` with its
    path and recompiled the other's object file. Built from the copy, the path is the same for all. The
    copy is written only when it is missing or differs (atomically: a concurrent process reads a whole
    file), so its modification time stays older than the object built from it. A missing copy is created
    only where no other process has created it meanwhile (a hard link, which fails on an existing name):
    processes that start at once would otherwise each write it, one after another's compile has begun, and
    the object would be older than its source for the next load.
    """
    if directory is None:
        return SOURCE
    target = directory / SOURCE.name
    code = SOURCE.read_bytes()
    try:
        if target.is_file() and target.read_bytes() == code:
            return target
        directory.mkdir(parents=True, exist_ok=True)
        part = directory / f".{SOURCE.name}.{os.getpid()}.part"
        part.write_bytes(code)
        try:
            os.link(part, target)
        except FileExistsError:  # another process's copy (kept), or one that differs (replaced)
            if target.read_bytes() != code:
                os.replace(part, target)
        except OSError:  # no hard links on this file system
            os.replace(part, target)
        finally:
            part.unlink(missing_ok=True)
        return target
    except OSError:  # not writable: torch's own error comes from the build, with its fix
        return SOURCE


def _libraries(directory: Path | None) -> dict[Path, float]:
    """The built libraries in ``directory`` and their modification times."""
    if directory is None:
        return {}
    try:
        return {so: so.stat().st_mtime for so in directory.glob("*.so")}
    except OSError:
        return {}


#: The note a build directory keeps of a library built afresh that does not load (its :func:`_identity`): later
#: processes report it without rebuilding it again (a rebuild takes up to a minute or more, to the same end).
FAILED_NOTE = "load-failed"


def _identity(path: Path) -> str | None:
    """Which file ``path`` is (size, modification time, inode), to tell a rebuilt library from the one before."""
    try:
        info = path.stat()
    except OSError:
        return None
    return f"{info.st_size} {info.st_mtime_ns} {info.st_ino}"


def _library_that_failed(err: OSError, directory: Path | None) -> Path | None:
    """The library in ``directory`` that ``err`` says did not load, or ``None`` (another failure: the directory
    cannot be created or written). torch's loader names the library's resolved path: "Could not load this
    library: <path>"; the library may be missing (removed by another process) and still be the one named."""
    if directory is None:
        return None
    text = str(err)
    for library in {*directory.glob("*.so"), directory / f"{directory.name}.so"}:
        if str(library) in text or os.path.realpath(library) in text:
            return library
    return None


def _cut_short(library: Path) -> str | None:
    """Why ``library`` is cut short (an ELF file whose segments or section table reach past its end), or ``None``.

    The loader maps such a library without reading it whole and the process dies of a bus error when it
    touches what is missing, before Python sees an error: a library cut short by a killed link or a full disk
    must be found before it is loaded. A file shorter than its ELF header, or not ELF (macOS), is left to the
    loader, which reports it.
    """
    try:
        size = library.stat().st_size
        with library.open("rb") as file:
            head = file.read(64)
            if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in (1, 2) or head[5] not in (1, 2):
                return None
            wide, order = head[4] == 2, "<" if head[5] == 1 else ">"
            if wide and len(head) < 64:
                return None
            # e_phoff, e_shoff; then e_phentsize, e_phnum, e_shentsize, e_shnum (the ELF header, 32- or 64-bit)
            phoff, shoff = struct.unpack_from(order + ("QQ" if wide else "II"), head, 32 if wide else 28)
            phentsize, phnum, shentsize, shnum = struct.unpack_from(order + "HHHH", head, 54 if wide else 42)
            need = shoff + shentsize * shnum
            file.seek(phoff)
            table = file.read(phentsize * phnum)
    except (OSError, struct.error):
        return None
    need = max(need, phoff + len(table))
    for i in range(len(table) // max(phentsize, 1)):
        kind, = struct.unpack_from(order + "I", table, i * phentsize)
        if kind == 1:  # PT_LOAD: mapped from the file
            offset, filesz = (struct.unpack_from(order + "QxxxxxxxxxxxxxxxxQ", table, i * phentsize + 8) if wide
                              else struct.unpack_from(order + "IxxxxxxxxI", table, i * phentsize + 4))
            need = max(need, offset + filesz)
    if len(table) < phentsize * phnum or size < need:
        return f"{size} of its {need} bytes"
    return None


def _load_error(err: BaseException) -> str:
    """The loader's own reason for a library that does not load (torch's error wraps it: its cause)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return str(err)


def _remove_build(directory: Path, library: Path, broken: str | None) -> None:
    """Remove ``library`` and the object files it was linked from, so that torch builds them again, unless
    another process has rebuilt it meanwhile (``broken``: the file that failed, :func:`_identity`).

    Removed under the build's lock, taken as torch takes it (the lock file, created exclusively), so that no
    process's build runs meanwhile. The objects go too: the link ran from them, and a broken object that ninja
    finds up to date would fail every later link.
    """
    lock = directory / "lock"
    while True:
        _wait_for_build_lock(directory)
        try:
            handle = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:  # another process took it between the wait and here: wait for it again
            continue
    try:
        if _identity(library) == broken:
            for output in (library, *directory.glob("*.o")):
                output.unlink(missing_ok=True)
            (directory / FAILED_NOTE).unlink(missing_ok=True)
    finally:
        os.close(handle)
        lock.unlink(missing_ok=True)


def _forget_build(name: str) -> None:
    """Make torch's next ``load`` of ``name`` in this process run its build step again.

    torch skips the build of a name it has built once in a process (its versioner, a private registry): the
    rebuild of a library that did not load would load nothing. Where this torch has no such registry,
    nothing is forgotten and a rebuild that does not happen is reported as a library that does not load.
    """
    from torch.utils import cpp_extension

    entries = getattr(getattr(cpp_extension, "JIT_EXTENSION_VERSIONER", None), "entries", None)
    if isinstance(entries, dict):
        entries.pop(name, None)


def _does_not_load(directory: Path, library: Path, err: OSError) -> KernelStatus:
    """The status of a library built afresh that does not load: its path and the loader's reason, noted in
    its directory (:data:`FAILED_NOTE`) so that later processes do not rebuild it again."""
    identity = _identity(library)
    try:
        if identity is not None:
            (directory / FAILED_NOTE).write_text(identity)
    except OSError:  # a full disk: later processes rebuild it once more, which is all the note saves
        pass
    return KernelStatus(
        False, f"their library {library}, built afresh, does not load: {_load_error(err)}", 0.0,
        f"Fix that reason (a full disk; a cache on a disk mounted without exec: set TORCH_EXTENSIONS_DIR to "
        f"another directory; a compiler whose C++ runtime is newer than the process's: set CXX), then delete "
        f"{directory} to build them again",
    )


def _built_afresh(library: Path, before: dict[Path, float], directory: Path) -> bool:
    """Whether ``library`` was built since ``before`` (by this process or one it waited for), or built afresh
    by an earlier process and noted as not loading: building it again would give the same library."""
    try:
        if library not in before or library.stat().st_mtime != before[library]:
            return True
        note = directory / FAILED_NOTE
        return note.is_file() and note.read_text() == _identity(library)
    except OSError:
        return False


def _rebuild(progress: _BuildProgress, directory: Path, library: Path, why: str) -> None:
    """Say that the cached ``library`` is rebuilt and why, and remove it so that torch's next load builds it:
    ninja finds a library up to date whatever its content."""
    progress.rebuilding(f"its library in the cache ({library}) {why}")
    _remove_build(directory, library, _identity(library))
    _forget_build(directory.name)


def _try_load(arguments: dict[str, Any], directory: Path | None) -> tuple[Path, OSError] | None:
    """torch's ``load`` of the kernels (a build where ninja finds them out of date, then the load): ``None``
    once loaded, else the library that does not load and the error. Raises what ``load`` raises for anything
    else (the directory cannot be written, the compiler fails)."""
    from torch.utils.cpp_extension import load

    try:
        # copies: torch appends its own linker flags to the list it is given, and a second load with the
        # same list would run another command (rebuilding, in another directory of its versioner's)
        load(**{key: list(value) if isinstance(value, list) else value for key, value in arguments.items()})
    except OSError as err:
        library = _library_that_failed(err, directory)
        if library is None:  # not the library: the directory, reported by the caller
            raise
        return library, err
    return None


def _load_repairing(
    arguments: dict[str, Any], directory: Path | None, before: dict[Path, float], progress: _BuildProgress
) -> KernelStatus | None:
    """Load the kernels (:func:`_try_load`), a library in the cache that is cut short or does not load rebuilt
    once: ``None`` once they are loaded, else the status of a library built afresh that does not load."""
    cut = None
    if directory is not None and not (directory / "lock").exists():  # locked: being built, torch's load waits
        cached = directory / f"{arguments['name']}.so"
        cut = _cut_short(cached)
        if cut is not None:
            _rebuild(progress, directory, cached, f"is cut short ({cut})")
    failure = _try_load(arguments, directory)
    if failure is None:
        return None
    library, err = failure
    if directory is not None and cut is None and not _built_afresh(library, before, directory):
        _rebuild(progress, directory, library, f"does not load ({_load_error(err)})")
        failure = _try_load(arguments, directory)
        if failure is None:
            return None
        library, err = failure
    return _does_not_load(library.parent, library, err)


def _build(flags: list[str], ldflags: list[str]) -> KernelStatus | str:
    """Build or load the kernels with ``flags``: their status, or the compiler's first error.

    A build is said at warning level (when it starts, while it runs, and when it is done, with the step
    that runs: :class:`_BuildProgress`); a load from the cache is said by
    :func:`lightning_baoc.kernels.use_compiled`, at info. A library in the cache that is cut short or does
    not load is rebuilt once (:func:`_load_repairing`); one built afresh that does not load is reported with
    its path and the loader's reason, and not rebuilt again by later processes (:func:`_does_not_load`).
    """
    name = _build_name(flags, ldflags)
    directory = _build_directory(name)
    before = _libraries(directory)
    _wait_for_build_lock(directory)
    start = time.perf_counter()
    try:
        source = _shared_source(directory)
        arguments = dict(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=ldflags,
                         is_python_module=False, verbose=False)
        with _BuildProgress(directory, fresh=not before) as progress:
            failed = _load_repairing(arguments, directory, before, progress)
        if failed is not None:
            return failed
    except OSError as err:  # the build directory: not a directory, not writable, the disk full
        where = os.environ.get("TORCH_EXTENSIONS_DIR")
        return KernelStatus(False, f"their build directory cannot be written ({err})", 0.0,
                            f"Set TORCH_EXTENSIONS_DIR to a writable directory (now {where!r})" if where
                            else "Set TORCH_EXTENSIONS_DIR to a writable directory")
    except Exception as err:  # a compiler error, a linker error: the eager step still works
        return _first_error(str(err)) or type(err).__name__
    seconds = time.perf_counter() - start
    after = _libraries(directory)
    built = not before or bool(set(after) - set(before)) or any(after.get(so, 0.0) > t for so, t in before.items())
    if not built:
        return KernelStatus(True, "loaded from the cache")
    log.warning("lightning_baoc: built %s in %.1f s; %s (cached in %s for later runs)", BUILT, seconds, RUNS,
                directory or "torch's extensions directory")
    return KernelStatus(True, f"built in {seconds:.1f} s", seconds, said=True)


def _first_error(text: str) -> str:
    """The compiler's first error line in a failed build's output (else its last line)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and "ninja" not in line.lower()]
    return (errors or lines or [""])[0][:300]


__all__ = ["BUILT", "PROGRESS_SECONDS", "RUNS", "SOURCE", "STALE_LOCK_SECONDS", "KernelStatus", "compile_flags",
           "load_kernels"]
