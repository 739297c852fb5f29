"""What each state format costs on a device: step time (calibrated), memory, and a hardware mask.

- :func:`calibrate` times ``BlockwiseAdamW.step()`` per format on a small synthetic set of
  tensors on the actual device and reports seconds per element. Results are cached as JSON, one
  file per device (model name, thread count) and torch version, in the user cache directory
  (``$LIGHTNING_BAOC_CACHE_DIR``, else ``$XDG_CACHE_HOME/lightning_baoc``, else
  ``~/.cache/lightning_baoc``) or a directory you pass.
- :func:`time_table` and :func:`memory_table` turn a model's blocks (parameter shapes) into the
  ``time`` and ``memory`` tables of :func:`lightning_baoc.solve`, with the fallbacks every format
  applies to 1-D and small tensors.
- :func:`hardware_mask` names the formats a device cannot serve well, with the reason. On a CPU
  (and on unified-memory devices) host memory *is* the device's memory: ``offload`` saves nothing
  there, so it is masked; and :func:`memory_table` counts its bytes in full on such devices, so
  even unmasked it never makes a budget look met (``tests/costs/test_calibration.py``).
- :func:`withheld_formats` is the one rule of what the solver is not offered: the hardware mask,
  and ``offload`` on an accelerator when no time budget prices its slower step. The training
  controller, ``lightning-baoc check`` and ``lightning-baoc plan`` all apply it.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from lightning_baoc.formats import DEFAULT_MIN_8BIT_NUMEL, FORMATS, format_state_bytes, formats_of, numel_of, resolve_in
from lightning_baoc.formats.base import as_shape
from lightning_baoc.formats.correction import check_correction
from lightning_baoc.kernels import step_path
from lightning_baoc.optim import BlockwiseAdamW, BlockwiseLion, BlockwiseSGD
from lightning_baoc.solver import check_mask as _check_mask

Shape = Sequence[int]
#: block name -> the shapes of its parameters
BlockShapes = Mapping[str, Sequence[Shape]]

#: Bump when the measurement changes, so stale cache files are not reused (2: the compiled CPU
#: kernels changed every format's cost).
CALIBRATION_VERSION = 2

#: Rough per-element step cost of each format relative to fp32 AdamW, for planning a device that
#: is not at hand (``--time-budget`` without ``--calibrate``). All but ``offload`` are from
#: :func:`calibrate` on a 2-core Xeon CPU with torch 2.13 (three runs, rounded); ``offload``
#: is a guess for a GPU with PCIe transfers and the update on the host (Deep Optimizer States,
#: arXiv 2410.21316, measure several times slower than a GPU step). Calibrate on the real device
#: for real budgets.
PRIOR_STEP_COST: Mapping[str, float] = {
    "fp32": 1.0,
    "bf16_momentum": 1.0,
    "bf16": 1.2,
    "nomomentum": 0.9,
    "int8": 2.4,
    "int8_factored": 1.9,
    "nomomentum_int8": 1.4,
    "factored": 0.7,
    "offload": 20.0,
}

#: :data:`PRIOR_STEP_COST` of every update rule: the momentum formats of BlockwiseSGD and
#: BlockwiseLion relative to their fp32 buffer, from :func:`calibrate` (``rule="sgd"``,
#: ``rule="lion"``, 4M elements, 1 thread) on a 2-core AMD EPYC CPU with torch 2.13 (rounded; at 2
#: threads on a loaded machine bf16 and int8 measured 1.15 and ``none`` 0.18).
PRIOR_STEP_COSTS: Mapping[str, Mapping[str, float]] = {
    "adamw": PRIOR_STEP_COST,
    "sgd": {"fp32": 1.0, "bf16": 1.7, "int8": 1.7, "none": 0.7},
    "lion": {"fp32": 1.0, "bf16": 1.9, "int8": 2.1, "none": 0.8},
}


#: Per-element step cost a master-weight correction adds to a 16-bit weight's step, in the units of
#: :data:`PRIOR_STEP_COST` (fp32 AdamW's step of an fp32 element = 1): rebuilding the fp32 master from
#: the weight and its correction and splitting it again. From :func:`measure_correction_seconds` on a
#: 2-core AMD EPYC CPU with torch 2.13, 1 thread, the compiled step (three runs: ecc8 3.51-3.62, ecc16
#: 3.03-3.11, rounded), relative to the ``fp32`` format's step measured beside it. On a GPU the Triton
#: step rebuilds the masters in its pass over memory and the correction costs far less (measured on an
#: H200: ``int8`` over bf16 weights 5.9 ms, with ``ecc8`` 6.2 ms): calibrate there.
PRIOR_CORRECTION_COST: Mapping[str, float] = {"none": 0.0, "ecc8": 3.5, "ecc16": 3.1}


def check_mask(mask: Mapping[str, str] | Iterable[str] | None) -> dict[str, str]:
    """Validate a user mask against the format registry: names -> reasons.

    Raises:
        ValueError: an unknown format name; the message lists the allowed ones.

    Example:
        >>> check_mask(["offload"])
        {'offload': 'masked'}
    """
    out = _check_mask(mask)
    for name in out:
        if name not in FORMATS:  # pragma: no cover - KNOWN_FORMATS mirrors FORMATS (tested)
            raise ValueError(f"Unknown format {name!r} in mask; allowed: {list(FORMATS)}")
    return out


def _as_device(device: str | torch.device) -> torch.device:
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"Invalid device={device!r}: {err}; expected e.g. 'cpu', 'cuda', 'cuda:1'") from None


def hardware_mask(device: str | torch.device) -> dict[str, str]:
    """Formats the device cannot serve well -> the reason they are excluded.

    - CPU: ``offload`` (host memory is the device's memory: it saves nothing).
    - MPS: ``offload`` (unified memory: the same).
    - CUDA without native bf16 (compute capability below 8.0): ``bf16_momentum`` and ``bf16``.
      When no CUDA device is present (planning for one elsewhere), nothing can be checked and
      nothing is masked.

    Example:
        >>> hardware_mask("cpu")
        {'offload': "training on the CPU: host memory is the device's memory, so offload saves nothing"}
    """
    dev = _as_device(device)
    if dev.type == "cpu":
        return {"offload": "training on the CPU: host memory is the device's memory, so offload saves nothing"}
    if dev.type == "mps":
        return {"offload": "MPS shares one memory with the host (unified memory), so offload saves nothing"}
    if dev.type == "meta":
        raise ValueError("device='meta' holds no data and trains nothing; pass the training device, e.g. 'cuda'")
    if dev.type == "cuda" and torch.cuda.is_available():
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"device={device!r}: only {torch.cuda.device_count()} CUDA device(s) present")
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) < (8, 0):
            reason = (
                f"{torch.cuda.get_device_name(index)} (compute capability {major}.{minor}) has no "
                f"native bf16: bf16 states would be emulated and slow"
            )
            return {"bf16_momentum": reason, "bf16": reason}
    return {}


def offload_saves_memory(device: str | torch.device) -> bool:
    """Whether ``offload`` states live outside the device's memory (only on discrete accelerators)."""
    return _as_device(device).type not in ("cpu", "mps", "meta")


#: Why ``offload`` is withheld on an accelerator when no time budget is set.
OFFLOAD_NEEDS_TIME_BUDGET = (
    "offload trades step time for memory: it costs no device memory and no risk, so without a time "
    "budget it would win every block (a synchronous host update of the whole model every step); "
    "give a time budget to consider it"
)


def withheld_formats(
    device: str | torch.device, time_budget: bool, menu: Iterable[str] | None = None, rule: str = "adamw"
) -> dict[str, str]:
    """The formats the solver must not be offered, and why: the one rule shared by the training
    controller, ``lightning-baoc check`` and ``lightning-baoc plan``.

    - the device's :func:`hardware_mask`;
    - ``offload`` where it saves device memory (an accelerator) and no time budget is set: it
      costs 0 device bytes and 0 risk there, so only a time budget, which prices its slower
      step, can keep it from taking every block.

    Args:
        device: the training device.
        time_budget: whether a time budget is set.
        menu: the formats asked for (default: ``None``: all of the rule's formats); only formats
            of the menu are reported.
        rule: the optimizer's update rule, whose formats the menu names (default: ``"adamw"``;
            ``"sgd"``, ``"lion"``: :data:`~lightning_baoc.formats.MOMENTUM_FORMATS`).

    Example:
        >>> withheld_formats("cuda", time_budget=False, menu=["fp32", "int8", "offload"])["offload"][:31]
        'offload trades step time for me'
        >>> "offload" in withheld_formats("cuda", time_budget=True)
        False
    """
    wanted = list(formats_of(rule)) if menu is None else [_check_name(f, rule) for f in menu]
    out = dict(hardware_mask(device))
    if "offload" not in out and not time_budget and offload_saves_memory(device):
        out["offload"] = OFFLOAD_NEEDS_TIME_BUDGET
    return {f: why for f, why in out.items() if f in wanted}


def memory_table(
    blocks: BlockShapes,
    device: str | torch.device,
    formats: Iterable[str] | None = None,
    min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL,
    rule: str = "adamw",
) -> dict[str, dict[str, int]]:
    """Device bytes of optimizer state per block and format (fallbacks applied per tensor), for the
    formats of the update rule ``rule`` (default: AdamW's).

    ``offload`` costs 0 device bytes on a discrete accelerator and its full 8 bytes per element
    where host memory is the device's memory (CPU, MPS).

    Example:
        >>> memory_table({"fc": [(64, 64), (64,)]}, "cpu", ["fp32", "int8", "offload"])
        {'fc': {'fp32': 33280, 'int8': 9224, 'offload': 33280}}
    """
    names = list(formats_of(rule)) if formats is None else [_check_name(f, rule) for f in formats]
    off_device = offload_saves_memory(device)
    return {
        block: {f: sum(device_state_bytes(f, s, off_device, min_8bit_numel, rule) for s in shapes) for f in names}
        for block, shapes in blocks.items()
    }


def device_state_bytes(
    name: str, shape: Sequence[int], off_device: bool, min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL, rule: str = "adamw"
) -> int:
    """Device bytes of one tensor's state in format ``name`` (its fallbacks applied): the rule of
    :func:`memory_table`, per tensor. ``off_device`` is :func:`offload_saves_memory` of the device.

    Example:
        >>> device_state_bytes("offload", (64, 64), off_device=True), device_state_bytes("int8", (64,), False)
        (0, 512)
    """
    if formats_of(rule)[_check_name(name, rule)].offloaded and off_device:
        return 0
    return format_state_bytes(name, as_shape(shape), min_8bit_numel, rule)


def _check_name(name: str, rule: str = "adamw") -> str:
    registry = formats_of(rule)
    if name not in registry:
        whose = "" if rule == "adamw" else f" of the {rule} rule" + (" (an AdamW format)" if name in FORMATS else "")
        raise ValueError(f"Unknown format {name!r}{whose}; allowed: {list(registry)}")
    return name


@dataclass(frozen=True)
class Calibration:
    """Measured optimizer-step cost of each format on one device.

    Attributes:
        device: the device measured (``"cpu"``, ``"cuda:0"``).
        device_name: its model name (CPU model, GPU name).
        torch_version: ``torch.__version__`` at measurement.
        threads: ``torch.get_num_threads()`` at measurement (CPU step time depends on it).
        seconds_per_element: format -> seconds of one step per parameter element.
        numel: elements in the synthetic tensor set.
        steps: timed steps per format (the fastest is kept).
        version: :data:`CALIBRATION_VERSION` of the measurement.
        created: when it was measured.
        rule: the update rule whose formats were timed (``"adamw"``, ``"sgd"``, ``"lion"``).
        correction_seconds_per_element: correction (``"ecc8"``, ``"ecc16"``) -> seconds of one step per
            element it adds to the step of a bf16 weight (0 for ``"none"``).
    """

    device: str
    device_name: str
    torch_version: str
    threads: int
    seconds_per_element: dict[str, float]
    numel: int
    steps: int
    version: int = CALIBRATION_VERSION
    created: str = field(default="", compare=False)
    rule: str = "adamw"
    #: correction -> seconds per element a master-weight correction adds to a 16-bit weight's step
    #: (:func:`measure_correction_seconds`; measured when asked for)
    correction_seconds_per_element: dict[str, float] = field(default_factory=dict)

    def relative(self) -> dict[str, float]:
        """Format -> step cost per element relative to ``fp32``."""
        base = self.seconds_per_element.get("fp32")
        if not base:
            raise ValueError("this calibration has no 'fp32' entry to be relative to")
        return {f: v / base for f, v in self.seconds_per_element.items()}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Calibration:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


def default_cache_dir() -> Path:
    """The user cache directory of calibrations (see the module docstring)."""
    env = os.environ.get("LIGHTNING_BAOC_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "lightning_baoc"


def device_name(device: str | torch.device) -> str:
    """A readable model name of the device (CPU model from /proc/cpuinfo where available)."""
    dev = _as_device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev.index if dev.index is not None else torch.cuda.current_device())
    if dev.type == "cpu":
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as fh:
                for line in fh:
                    if line.startswith("model name"):
                        return line.split(":", 1)[1].strip()
        except OSError:
            pass
        return platform.processor() or platform.machine() or "cpu"
    return dev.type


def cache_path(
    device: str | torch.device, cache_dir: str | os.PathLike[str] | None = None, rule: str = "adamw"
) -> Path:
    """The JSON file a calibration of ``device`` is cached in (per device model, threads, torch, on
    the CPU the step that runs: the compiled kernels or the eager step, and the update rule)."""
    dev = _as_device(device)
    threads = torch.get_num_threads() if dev.type == "cpu" else 0
    path = f"-{step_path(dev)}" if dev.type == "cpu" else ""
    key = f"{dev.type}-{device_name(dev)}-t{threads}{path}-torch{torch.__version__}-v{CALIBRATION_VERSION}"
    if rule != "adamw":
        formats_of(rule)  # an unknown rule is refused
        key = f"{rule}-{key}"
    slug = re.sub(r"[^A-Za-z0-9.+-]+", "_", key).strip("_")
    base = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return base / f"calibration-{slug}.json"


_SYNTHETIC_ROWS = 256


def _synthetic_cols(numel: int) -> int:
    return max(32, numel // (4 * _SYNTHETIC_ROWS))


def _synchronize(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def measure_step_seconds(
    formats: Iterable[str], device: str | torch.device = "cpu", numel: int = 1 << 20, steps: int = 5, warmup: int = 2,
    rule: str = "adamw",
) -> dict[str, float]:
    """Seconds of one optimizer step over the synthetic set, per format (fastest of ``steps``):
    ``BlockwiseAdamW``, or with ``rule="sgd"`` / ``"lion"`` ``BlockwiseSGD`` (momentum 0.9) /
    ``BlockwiseLion``.

    The synthetic set is four 2-D tensors of 256 rows (every format holds them as is: no 1-D or
    small-tensor fallback) with fixed random gradients, one optimizer per format. Steps are timed
    round-robin over the formats, so a change of machine load hits every format alike.
    """
    names = [_check_name(f, rule) for f in formats]
    make = {
        "adamw": lambda params, fmt: BlockwiseAdamW(params, lr=1e-3, state_format=fmt),
        "sgd": lambda params, fmt: BlockwiseSGD(params, lr=1e-3, momentum=0.9, state_format=fmt),
        "lion": lambda params, fmt: BlockwiseLion(params, lr=1e-4, state_format=fmt),
    }[rule]
    dev = _as_device(device)
    optimizers = {fmt: make(_synthetic_params(dev, numel, torch.float32), fmt) for fmt in names}
    return _fastest_steps(optimizers, dev, warmup, steps)


def _synthetic_params(dev: torch.device, numel: int, dtype: torch.dtype) -> list[tuple[str, torch.nn.Parameter]]:
    """The synthetic set: four 2-D tensors of 256 rows in ``dtype``, with fixed random gradients."""
    rows, cols = _SYNTHETIC_ROWS, _synthetic_cols(numel)
    gen = torch.Generator().manual_seed(0)
    params = []
    for i in range(4):
        p = torch.nn.Parameter(torch.randn(rows, cols, generator=gen).to(dev, dtype))
        p.grad = (torch.randn(rows, cols, generator=gen) * 1e-3).to(dev, dtype)
        params.append((f"w{i}", p))
    return params


def _fastest_steps(optimizers: Mapping[str, Any], dev: torch.device, warmup: int, steps: int) -> dict[str, float]:
    """Each optimizer's fastest step of ``steps``, timed round-robin after ``warmup`` steps each, so a
    change of machine load hits every one alike (noise only ever adds time)."""
    for opt in optimizers.values():
        for _ in range(warmup):
            opt.step()
    times: dict[str, list[float]] = {key: [] for key in optimizers}
    for _ in range(steps):
        for key, opt in optimizers.items():
            _synchronize(dev)
            start = time.perf_counter()
            opt.step()
            _synchronize(dev)
            times[key].append(time.perf_counter() - start)
    return {key: min(t) for key, t in times.items()}


def measure_correction_seconds(
    corrections: Iterable[str], device: str | torch.device = "cpu", numel: int = 1 << 20, steps: int = 5,
    warmup: int = 2,
) -> dict[str, float]:
    """Seconds a master-weight correction adds to one optimizer step over the synthetic set, per
    correction: ``BlockwiseAdamW`` in ``int8`` over bf16 weights, with the correction and without,
    timed round-robin (the fastest of ``steps`` each); the difference, never below 0.

    Example:
        >>> measure_correction_seconds(["ecc8"], numel=1 << 16)  # doctest: +SKIP
        {'ecc8': 0.0011}
    """
    for c in corrections:
        check_correction(c)
    wanted = [c for c in dict.fromkeys(corrections) if c != "none"]
    dev = _as_device(device)
    optimizers = {
        c: BlockwiseAdamW(_synthetic_params(dev, numel, torch.bfloat16), lr=1e-3, state_format="int8", weight_correction=c)
        for c in ["none", *wanted]
    }
    times = _fastest_steps(optimizers, dev, warmup, steps)
    return {"none": 0.0, **{c: max(0.0, times[c] - times["none"]) for c in wanted}}


def _cached(path: Path, rule: str) -> Calibration | None:
    """The calibration cached at ``path`` for ``rule``, or ``None`` (none, corrupt or foreign: measured
    again and overwritten)."""
    if not path.exists():
        return None
    try:
        cached = Calibration.from_dict(json.loads(path.read_text(encoding="utf-8")))
    except (ValueError, TypeError, KeyError):
        return None
    return cached if cached.rule == rule else None


def calibrate(
    device: str | torch.device = "cpu",
    formats: Iterable[str] | None = None,
    *,
    numel: int = 1 << 20,
    steps: int = 7,
    cache_dir: str | os.PathLike[str] | None = None,
    refresh: bool = False,
    rule: str = "adamw",
    corrections: Iterable[str] = (),
) -> Calibration:
    """Seconds per element of one optimizer step for each format on ``device``, cached.

    A cached calibration for this device, thread count and torch version is reused unless
    ``refresh``; formats it lacks are measured and added.

    Args:
        device: the training device (default: ``"cpu"``).
        formats: formats to measure (default: all of the rule's formats, minus those
            :func:`hardware_mask` excludes on this device).
        numel: elements of the synthetic tensor set (default: 2**20: ~0.1-1 s per format on a CPU).
        steps: timed steps per format, round-robin; the fastest is kept (default: 7).
        cache_dir: where to cache (default: the user cache directory).
        refresh: measure again even if cached (default: False).
        rule: the optimizer's update rule (default: ``"adamw"``; ``"sgd"``, ``"lion"``: the
            momentum formats of BlockwiseSGD and BlockwiseLion, cached apart).
        corrections: master-weight corrections whose step cost to measure too (``"ecc8"``,
            ``"ecc16"``: :func:`measure_correction_seconds`; cached beside the formats').

    Returns:
        The :class:`Calibration`.

    Example:
        >>> cal = calibrate("cpu", ["fp32", "int8"], numel=1 << 16)  # doctest: +SKIP
        >>> cal.relative()["int8"]  # doctest: +SKIP
        2.9
    """
    dev = _as_device(device)
    _check_calibration(dev, numel, steps)
    wanted = (
        [f for f in formats_of(rule) if f not in hardware_mask(dev)]
        if formats is None
        else [_check_name(f, rule) for f in formats]
    )
    for c in corrections:
        check_correction(c)
    path = cache_path(dev, cache_dir, rule)
    cached = None if refresh else _cached(path, rule)
    known = dict(cached.seconds_per_element) if cached is not None else {}
    known_corrections = dict(cached.correction_seconds_per_element) if cached is not None else {"none": 0.0}
    missing = [f for f in wanted if f not in known]
    missing_corrections = [c for c in dict.fromkeys(corrections) if c not in known_corrections]
    elements = 4 * _SYNTHETIC_ROWS * _synthetic_cols(numel)
    if missing:
        for f, seconds in measure_step_seconds(missing, dev, numel, steps, rule=rule).items():
            known[f] = seconds / elements
    if missing_corrections:
        for c, seconds in measure_correction_seconds(missing_corrections, dev, numel, steps).items():
            known_corrections[c] = seconds / elements
    missing = missing + missing_corrections
    result = Calibration(
        device=str(dev),
        device_name=device_name(dev),
        torch_version=torch.__version__,
        threads=torch.get_num_threads(),
        seconds_per_element=known,
        numel=numel if cached is None else cached.numel,
        steps=steps if cached is None else cached.steps,
        created=time.strftime("%Y-%m-%dT%H:%M:%S") if (missing or cached is None) else cached.created,
        rule=rule,
        correction_seconds_per_element=known_corrections,
    )
    if missing or cached is None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result.to_dict(), indent=2, sort_keys=True), encoding="utf-8")
        tmp.replace(path)  # atomic: a concurrent reader never sees half a file
    return result


def _check_calibration(dev: torch.device, numel: object, steps: object) -> None:
    """The arguments :func:`calibrate` refuses, each named."""
    if dev.type == "meta":
        raise ValueError("device='meta' cannot be timed; pass the training device, e.g. 'cpu' or 'cuda'")
    if not isinstance(numel, int) or numel < 4096:
        raise ValueError(f"numel must be an int >= 4096 (8-bit formats need that many), got {numel!r}")
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1, got {steps!r}")


def time_table(
    blocks: BlockShapes,
    costs: Calibration | Mapping[str, float],
    formats: Iterable[str] | None = None,
    min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL,
    rule: str = "adamw",
) -> dict[str, dict[str, float]]:
    """Step time per block and format: elements x the per-element cost of the format each tensor
    really gets (fallbacks applied), for the formats of the update rule ``rule``.

    Args:
        blocks: block name -> parameter shapes.
        costs: a :class:`Calibration`, or format -> cost per element (any unit, e.g.
            :data:`PRIOR_STEP_COST`; time budgets are relative to fp32 anyway).
        formats: the formats to tabulate (default: those ``costs`` covers).
        min_8bit_numel: the optimizer's small-tensor threshold (default: 4096).
        rule: the optimizer's update rule (default: ``"adamw"``).

    Example:
        >>> time_table({"fc": [(64, 64), (64,)]}, {"fp32": 1.0, "int8": 3.0})
        {'fc': {'fp32': 4160.0, 'int8': 12352.0}}
    """
    per = dict(costs.seconds_per_element if isinstance(costs, Calibration) else costs)
    names = list(per) if formats is None else [_check_name(f, rule) for f in formats]
    registry = formats_of(rule)
    out: dict[str, dict[str, float]] = {}
    for block, shapes in blocks.items():
        row: dict[str, float] = {}
        for f in names:
            total = 0.0
            for s in shapes:
                real = resolve_in(registry, f, as_shape(s), min_8bit_numel)
                if real not in per:
                    raise ValueError(
                        f"no step cost for format {real!r} (what {f!r} becomes for shape {tuple(s)}); "
                        f"costs cover {sorted(per)}: calibrate it too"
                    )
                total += numel_of(s) * per[real]
            row[f] = total
        out[block] = row
    return out


__all__ = [
    "CALIBRATION_VERSION",
    "Calibration",
    "PRIOR_STEP_COST",
    "PRIOR_CORRECTION_COST",
    "PRIOR_STEP_COSTS",
    "cache_path",
    "calibrate",
    "check_mask",
    "default_cache_dir",
    "device_name",
    "device_state_bytes",
    "hardware_mask",
    "measure_correction_seconds",
    "measure_step_seconds",
    "memory_table",
    "offload_saves_memory",
    "time_table",
    "withheld_formats",
]
