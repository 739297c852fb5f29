"""Compiled CPU kernels of the optimizer step, built on first use and cached.

The eager step of every format (:mod:`lightning_baoc.formats`) is a sequence of ATen operations:
about ten passes over memory per step and a few hundred operator calls per 128K elements. The
kernels in ``cpu_step.cpp`` do each format's whole step in one pass per 1024-element super-block
(decode, AdamW in fp32, encode), over all the tensors of a call at once, threaded with
``at::parallel_for``. They are built with :func:`torch.utils.cpp_extension.load` the first time an
optimizer needs them (measured: 10.7 s on an idle 2-core machine, 79.5 s on a loaded one; once per
machine, torch version and source version, whichever checkout of the source loads them: they are built from
a copy of the source in the cache, :func:`_shared_source`) and loaded from the cache afterwards (under a second).

What a user sees: a build is a pause before the first step, so it is said at warning level (the
``lightning_baoc.kernels`` logger; Python's logging prints warnings to stderr even where nothing is
configured): one line when it starts, one every :data:`PROGRESS_SECONDS` while it runs, and one when
it is done that says which step runs. A load from the cache takes no noticeable time and is said once,
at info level: a warning on every run's start would teach users to skip warnings.

Which path runs is chosen per optimizer (``BlockwiseAdamW(kernels=...)``, default from the
environment variable ``LIGHTNING_BAOC_KERNELS``, else ``"auto"``):

- ``"auto"``: the compiled kernels where they build, else the eager step, with one warning that
  says why (no C++ compiler, no ``ninja``, a build error);
- ``"compiled"``: the compiled kernels, or an error that says why they are not available;
- ``"eager"``: the eager step (the reference), never building anything.

Both paths give the same results to fp32 rounding (``tests/kernels/test_cpu_step.py``); the kernels
serve parameters on the CPU (CUDA parameters take the eager step).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

#: The environment variable that sets the default kernel policy.
KERNELS_ENV = "LIGHTNING_BAOC_KERNELS"
#: The policies ``BlockwiseAdamW(kernels=...)`` accepts.
POLICIES = ("auto", "compiled", "eager")
SOURCE = Path(__file__).with_name("cpu_step.cpp")

# Momentum and second-moment kinds, as the kernel numbers them (cpu_step.cpp: MKind, VKind).
M_NONE, M_FP32, M_BF16, M_INT8 = 0, 1, 2, 3
V_FP32, V_BF16, V_UINT8, V_FACTORED = 0, 1, 2, 3
#: The update rules of ``momentum_step`` (SGD and Lion over one momentum buffer).
RULE_SGD, RULE_LION = 1, 2


@dataclass(frozen=True)
class KernelStatus:
    """Whether the compiled CPU kernels are loaded, and how (or why not)."""

    available: bool
    detail: str  # "built in 41.2 s", "loaded from the cache", or the reason they are not available
    build_seconds: float = 0.0
    fix: str = "Install a C++ compiler and ninja"  # what makes them available, where they are not


_STATUS: KernelStatus | None = None
_ANNOUNCED: set[str] = set()


def resolve_policy(kernels: str | None) -> str:
    """The kernel policy for ``kernels`` (``None``: the environment variable, else ``"auto"``)."""
    value = kernels if kernels is not None else os.environ.get(KERNELS_ENV, "auto")
    if value not in POLICIES:
        source = "kernels" if kernels is not None else KERNELS_ENV
        raise ValueError(f"Invalid {source}: {value!r}; expected one of {', '.join(POLICIES)}")
    return value


def compile_flags() -> list[str]:
    """Compiler flags of the kernels: optimized, no contraction into fused multiply-adds beyond the
    ones written (results must match the eager step), vector instructions the CPU has."""
    flags = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp"]
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512") and sys.platform.startswith("linux"):
        flags += ["-mavx2", "-mfma", "-mf16c"]
    if capability == "AVX512" and sys.platform.startswith("linux"):
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mprefer-vector-width=512"]
    return flags


def _build_name(flags: list[str]) -> str:
    digest = hashlib.sha1()
    digest.update(SOURCE.read_bytes())
    digest.update(" ".join(flags).encode())
    digest.update(torch.__version__.encode())
    return f"lightning_baoc_cpu_step_{digest.hexdigest()[:12]}"


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


def cpu_kernels() -> KernelStatus:
    """Build (first use on this machine) or load the CPU kernels, once per process."""
    global _STATUS
    if _STATUS is None:
        _STATUS = _load()
    return _STATUS


def _loaded() -> bool:
    """Whether this process has the operators already (loaded by an earlier status, or by hand)."""
    return hasattr(torch.ops.lightning_baoc, "adamw_step")


def _load() -> KernelStatus:
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
        return KernelStatus(True, f"{second.detail}, without OpenMP: one thread ({first})", second.build_seconds)
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
    anyway (its ``build.ninja`` changed: a cache written before the shared source copy, :func:`_shared_source`),
    the first progress line says so.
    """

    def __init__(self, directory: Path | None, fresh: bool, every: float | None = None) -> None:
        self.directory = directory
        self.fresh = fresh
        self.every = PROGRESS_SECONDS if every is None else every
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._start = 0.0

    def __enter__(self) -> _BuildProgress:
        self._start = time.perf_counter()
        if self.fresh:
            log.warning("lightning_baoc: building %s (first use on this machine: 10 s to a minute or more, once; "
                        "later runs load it from the cache in %s) ...", BUILT, self.directory or "torch's extensions directory")
        self._thread = threading.Thread(target=self._tick, name="lightning_baoc-build-progress", daemon=True)
        self._thread.start()
        return self

    def _tick(self) -> None:
        said = False
        while not self._done.wait(self.every):
            elapsed = time.perf_counter() - self._start
            if self.fresh or said:
                log.warning("lightning_baoc: still building %s: %.0f s so far ...", BUILT, elapsed)
            else:
                log.warning("lightning_baoc: rebuilding %s (its cache in %s is out of date): %.0f s so far ...", BUILT,
                            self.directory, elapsed)
            said = True

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
    file), so its modification time stays older than the object built from it.
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
        os.replace(part, target)
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


def _build(flags: list[str], ldflags: list[str]) -> KernelStatus | str:
    """Build or load the kernels with ``flags``: their status, or the compiler's first error.

    A build is said at warning level (when it starts, while it runs, and when it is done, with the step
    that runs: :class:`_BuildProgress`); a load from the cache is said by :func:`use_compiled`, at info.
    """
    from torch.utils.cpp_extension import load

    name = _build_name(flags)
    directory = _build_directory(name)
    before = _libraries(directory)
    _wait_for_build_lock(directory)
    start = time.perf_counter()
    try:
        source = _shared_source(directory)
        with _BuildProgress(directory, fresh=not before):
            load(name=name, sources=[str(source)], extra_cflags=flags, extra_ldflags=ldflags, is_python_module=False,
                 verbose=False)
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
    _ANNOUNCED.add("compiled")  # this line says which step runs: use_compiled need not say it again
    log.warning("lightning_baoc: built %s in %.1f s; %s (cached in %s for later runs)", BUILT, seconds, RUNS,
                directory or "torch's extensions directory")
    return KernelStatus(True, f"built in {seconds:.1f} s", seconds)


def _first_error(text: str) -> str:
    """The compiler's first error line in a failed build's output (else its last line)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() and "ninja" not in line.lower()]
    return (errors or lines or [""])[0][:300]


def use_compiled(policy: str, announce: bool = True) -> bool:
    """Whether the step runs the compiled kernels under ``policy``; says once which path runs.

    Raises:
        RuntimeError: under ``"compiled"`` when the kernels are not available (with the reason).
    """
    if policy == "eager":
        return False
    status = cpu_kernels()
    return _choose(policy, status.available, status.detail, "compiled" if status.available else "eager", announce,
                   "compiled CPU step kernels", status.fix,
                   "same results, several times slower on the CPU", "compiled CPU kernels")


def _choose(
    policy: str, available: bool, detail: str, key: str, announce: bool, kernels: str, install: str, eager_is: str,
    refused: str,
) -> bool:
    """Whether ``kernels`` run under ``policy`` (not ``"eager"``): said once in the log where they do,
    refused under ``"compiled"`` (naming ``refused``) and warned once under ``"auto"`` where they do
    not (``detail``: why)."""
    if available:
        if announce and key not in _ANNOUNCED:  # a build said it at warning level (_build); a cache load is quick
            _ANNOUNCED.add(key)
            log.info("lightning_baoc: %s in use (%s)", kernels, detail)
        return True
    if policy == "compiled":
        raise RuntimeError(
            f"BlockwiseAdamW(kernels='compiled'): the {refused} are not available: {detail}. {install}, or "
            f"use kernels='auto' or 'eager'."
        )
    if announce and key not in _ANNOUNCED:
        _ANNOUNCED.add(key)
        warnings.warn(
            f"lightning_baoc: the {kernels} are not available ({detail}); the eager step runs instead "
            f"({eager_is}). {install}, or pass kernels='eager' (or set {KERNELS_ENV}=eager) to silence this "
            f"warning.",
            RuntimeWarning,
            stacklevel=4,
        )
    return False


def step_path(device: torch.device, policy: str | None = None) -> str:
    """``"compiled"`` or ``"eager"``: the step the formats with kernels take on ``device`` under
    ``policy`` (default: the environment's), without announcing it."""
    if device.type != "cpu":
        return "eager"
    resolved = resolve_policy(policy)
    return "compiled" if resolved != "eager" and cpu_kernels().available else "eager"


#: The (momentum, second moment) kinds the Triton step serves (:mod:`.triton_step`): every format with
#: a kernel but the fp32 pair, which torch's fused kernel serves (the Triton step takes it for 16-bit
#: parameters only).
TRITON_SERVED = frozenset({(M_NONE, V_FP32), (M_NONE, V_UINT8), (M_BF16, V_FP32), (M_BF16, V_BF16), (M_INT8, V_UINT8),
                           (M_NONE, V_FACTORED), (M_INT8, V_FACTORED)})
#: The device types whose parameters take the Triton step (:mod:`.triton_step`); the tests add
#: ``"cpu"`` to run it through Triton's interpreter.
TRITON_DEVICES = {"cuda"}


def use_triton(policy: str, device: torch.device) -> bool:
    """Whether the step of the formats with kernels on ``device`` runs the Triton kernels under
    ``policy`` (:mod:`.triton_step`); says once which path runs.

    Raises:
        RuntimeError: under ``"compiled"`` when Triton does not import (with the reason).
    """
    if policy == "eager" or device.type not in TRITON_DEVICES:
        return False
    from lightning_baoc.kernels import triton_step

    available, detail = triton_step.triton_status()
    return _choose(policy, available, detail, f"triton-{available}", True, "Triton step kernels",
                   "Install triton (it ships with torch's CUDA builds on Linux)",
                   f"on {device.type}: same results, bound by kernel launches", f"Triton kernels of the {device.type} step")


def ops() -> Any:
    """The loaded operators (``adamw_step``, ``momentum_step``); call after :func:`use_compiled`."""
    return torch.ops.lightning_baoc


__all__ = [
    "KERNELS_ENV", "POLICIES", "PROGRESS_SECONDS", "TRITON_DEVICES", "TRITON_SERVED", "KernelStatus", "compile_flags", "cpu_kernels", "ops", "resolve_policy",
    "step_path", "use_compiled", "use_triton",
]
