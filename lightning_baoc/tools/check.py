"""The pre-training validation checklist: ``lightning-baoc check``.

Before a long run, check a config against the model and the device it will train on, without
training anything: the model is built on the ``meta`` device (shapes only). Each check passes or
fails, and every failure says how to fix it:

1. **formats served**: the formats the config allows (``baoc.formats``) that the device
   cannot serve (:func:`~lightning_baoc.costs.calibration.hardware_mask`: ``offload`` on a CPU or MPS,
   bf16 on CUDA devices without native bf16).
2. **blocks**: the model partitions into blocks with ``baoc.granularity`` and ``baoc.blocks`` (every
   pattern matches).
3. **memory budget**: some allocation of the allowed formats meets the budgets on this model
   (the same exact solver as the callback's check at install); a failure names the smallest
   feasible budget. The line reports the state on the device in every phase of the run (start,
   warm-up, conversion, steady: :meth:`~lightning_baoc.costs.AllocationProblem.phases`) and fails
   when one exceeds its limit (:mod:`lightning_baoc.tools.budget_check`).
4. **sampler overhead**: an estimate of the gradient sampler's cost from ``sample_every`` and the
   elements it samples per block against the model's size (:func:`sampler_overhead`), against the 3% the
   sampler is designed for, and the bytes of its buffers. The elements are the run's: ``max_elements``, or
   fewer where BAOC's instruments (the sampler's buffers and the shadow moments) would hold more than
   ``instrument_share`` allows (:func:`~lightning_baoc.costs.problem.run_instruments`); the memory-budget line
   gives the instruments' bytes, the sampler's buffers and the shadow moments together.
5. **warm-up**: enough gradient samples for the statistics, and shorter than the run
   (``trainer.max_steps``).
6. **risk thresholds**: ``max_block_risk`` above 0; ``hysteresis`` in the range that lets
   re-evaluations migrate without flapping.
7. **re-evaluation trigger**: ``mode`` agrees with the name of ``monitor`` (accuracy goes up, a loss
   goes down).

Exit code 0 when every check passes, 1 when one fails, 2 on bad input (a config that does not load,
a model that cannot be built).

Example:
    lightning-baoc check --config configs/vision.yaml --device cpu
    lightning-baoc check --config configs/language.yaml baoc.memory_budget=0.2 --model mypkg.models:build
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_baoc.config.budget import format_bytes
from lightning_baoc.config.files import Config, load_config
from lightning_baoc.costs import baseline_state_bytes
from lightning_baoc.costs.calibration import hardware_mask
from lightning_baoc.costs.instruments import InstrumentSizes, sampler_bytes
from lightning_baoc.costs.problem import run_instruments
from lightning_baoc.formats import RULE_FORMATS, RULE_NAMES, formats_of
from lightning_baoc.sampling.blocks import partition_report
from lightning_baoc.tools.budget_check import check_budget, weight_dtypes
from lightning_baoc.tools.models import EXAMPLES, build_component, default_device, example_folder, resolve_model
from lightning_baoc.tools.result import CheckResult

#: The sampler's design budget: its cost per training step, as a fraction of the step
#: (``benchmarks/sampler_overhead.py``: sampling at every step costs about 3% on a 1.2M-parameter GPT).
MAX_SAMPLER_OVERHEAD = 0.03

#: Measured anchor of :func:`sampler_overhead` (README, "Gradient sampler overhead"): a 1.2M-parameter
#: character GPT in 40 blocks, sampled every 10 steps (plus the step after) with
#: ``max_elements=4096``, reads 9.3% of its gradient elements per sample and 1.86% per step on
#: average, at a direct cost of 0.66% of the training step. The estimate scales that cost with the
#: share of the gradient read per step.
OVERHEAD_PER_GRADIENT_SHARE = 0.0066 / (2 / 10 * 0.0931)

#: Fewest ring samples a warm-up should collect: the signal-to-noise ratio and the cosine are means
#: over the ring, whose standard error falls like 1/sqrt(samples); 8 keeps it near a third.
MIN_WARMUP_SAMPLES = 8

#: Hysteresis range that lets re-evaluations migrate without flapping: 0 migrates on any noise in
#: the statistics; above 0.5 a migration needs the total risk to halve, which re-evaluations
#: with the same formats essentially never see.
HYSTERESIS_RANGE = (0.01, 0.5)

_UP_WORDS = ("acc", "f1", "auc", "precision", "recall", "map", "iou", "psnr", "ssim", "bleu", "rouge", "score")
_DOWN_WORDS = ("loss", "ppl", "perplexity", "error", "err", "mse", "mae", "rmse", "denoise", "fid", "wer", "cer")


@dataclass
class SamplerEstimate:
    """What :func:`sampler_overhead` estimates.

    Attributes:
        elements_per_sample: gradient elements read per sampling step (all blocks).
        share_per_sample: the same, as a share of the model's gradient elements.
        samples_per_step: sampling steps per optimizer step during warm-up (and after it).
        overhead: estimated cost as a fraction of a training step, during warm-up.
        overhead_after: the same after warm-up (``sparse_sampling`` times sparser).
    """

    elements_per_sample: int
    share_per_sample: float
    samples_per_step: float
    samples_per_step_after: float
    overhead: float
    overhead_after: float


def sampler_overhead(
    block_numel: dict[str, int], sample_every: int, max_elements: int, capacity: int, sparse_sampling: int = 1
) -> SamplerEstimate:
    """Estimate the gradient sampler's cost on a model from its block sizes.

    The sampler reads ``min(numel, max_elements)`` elements of every block per sampling step, at
    steps ``0, s, 2s, ...`` and the step after each (``s = sample_every``; just every step when
    ``s = 1``). Its cost is taken proportional to the share of the gradient it reads per
    optimizer step, scaled by the measured anchor :data:`OVERHEAD_PER_GRADIENT_SHARE` (a
    first-order model: the step's forward and backward grow with the parameter count, the
    sampling does not). ``max_elements`` is what the run samples per block (the setting, or fewer where
    the instruments' allowance lowers it: :func:`~lightning_baoc.costs.problem.run_instruments`).

    Example:
        >>> est = sampler_overhead({"a": 100_000, "b": 100_000}, sample_every=10, max_elements=4096, capacity=32)
        >>> est.elements_per_sample, round(est.share_per_sample, 4), est.samples_per_step
        (8192, 0.041, 0.2)
    """
    numel = sum(block_numel.values())
    if numel <= 0:
        raise ValueError("the model has no trainable elements: nothing to sample")
    elements = sum(min(n, max_elements) for n in block_numel.values())
    share = elements / numel
    per_step = 1.0 if sample_every == 1 else 2.0 / sample_every
    per_step_after = per_step / max(1, sparse_sampling)
    return SamplerEstimate(
        elements_per_sample=elements,
        share_per_sample=share,
        samples_per_step=per_step,
        samples_per_step_after=per_step_after,
        overhead=OVERHEAD_PER_GRADIENT_SHARE * per_step * share,
        overhead_after=OVERHEAD_PER_GRADIENT_SHARE * per_step_after * share,
    )


# ---------------------------------------------------------------------------- the checks


def _direction(monitor: str) -> str | None:
    words = re.split(r"[^a-z0-9]+", monitor.lower())
    joined = "_".join(words)
    if any(w in joined for w in _DOWN_WORDS):
        return "min"
    if any(w in joined for w in _UP_WORDS):
        return "max"
    return None


def run_checks(
    config: Config, model: nn.Module, device: str | torch.device = "cpu", optimizer: str = "adamw"
) -> list[CheckResult]:
    """Run the checklist of a config on a model (any device; ``meta`` is enough) for ``device``.

    Args:
        config: a loaded :class:`~lightning_baoc.config.files.Config`.
        model: the model (only parameter names, shapes and ``requires_grad`` are read).
        device: the training device (decides the hardware mask) (default: ``"cpu"``).
        optimizer: the optimizer the module returns, ``"adamw"``, ``"sgd"`` or ``"lion"``: its formats
            are the ones allowed, and a fractional budget is of its fp32 state (default: ``"adamw"``).

    Returns:
        One :class:`CheckResult` per check, in the order of the module docstring.

    Example:
        >>> from lightning_baoc.config.files import parse_config
        >>> cfg = parse_config({"baoc": {"memory_budget": 0.3, "formats": ["fp32", "int8", "offload"]}})
        >>> [r.status for r in run_checks(cfg, nn.Linear(256, 256, device="meta"), "cpu")][:1]
        ['FAIL']
    """
    device = str(device)
    if optimizer not in RULE_FORMATS:
        raise ValueError(f"Invalid optimizer: {optimizer!r}; allowed: {list(RULE_FORMATS)}")
    served_result, served, mask = _check_served(config, device, optimizer)
    results = [served_result]
    blocks_result, report = _check_blocks(config, model)
    results.append(blocks_result)
    if report is not None and served:
        results.append(check_budget(config, model, report.blocks, served, mask, device, optimizer))
    elif report is not None:
        results.append(
            CheckResult("memory budget", False, "no allowed format is served on this device", "see 'formats served'")
        )
    if report is not None:
        results.append(_check_sampler(config, report.numel, _instruments(config, model, report.blocks, device, optimizer)))
    results.append(_check_warmup(config))
    results.append(_check_risk(config))
    results.append(_check_trigger(config))
    return results


def _check_served(config: Config, device: str, rule: str) -> tuple[CheckResult, list[str], dict[str, str]]:
    """1. formats served: the allowed formats the device cannot serve; the served ones and the mask."""
    b = config.baoc
    mask = hardware_mask(device)
    own = formats_of(rule)
    requested = list(b.formats) if b.formats is not None else list(own)
    foreign = [f for f in requested if f not in own]
    if foreign:
        result = CheckResult(
            "formats served", False,
            f"baoc.formats names {foreign}, which are not formats of {RULE_NAMES[rule]} ({list(own)})",
            f"allow {RULE_NAMES[rule]}'s formats only, or check for the optimizer they belong to (--optimizer)",
        )  # fmt: skip
        return result, [], mask
    unserved = [f for f in requested if f in mask]
    served = [f for f in requested if f not in mask]
    if b.formats is None:
        note = "; ".join(f"{f} skipped ({why})" for f, why in mask.items())
        detail = f"all formats the device serves on {device}: {served}" + (f"; {note}" if note else "")
        return CheckResult("formats served", True, detail), served, mask
    if not unserved:
        return CheckResult("formats served", True, f"{device} serves every allowed format: {served}"), served, mask
    reasons = "; ".join(f"{f}: {mask[f]}" for f in unserved)
    keep = f"[{', '.join(served)}]" if served else "formats it serves"
    result = CheckResult(
        "formats served",
        False,
        f"baoc.formats asks for {unserved}, which {device} cannot serve ({reasons})",
        f"remove {', '.join(repr(f) for f in unserved)} from baoc.formats (e.g. formats: {keep}), "
        f"or train on a device that serves {'it' if len(unserved) == 1 else 'them'}",
    )
    return result, served, mask


def _check_blocks(config: Config, model: nn.Module) -> tuple[CheckResult, Any]:
    """2. blocks: the model partitions with ``baoc.granularity`` and ``baoc.blocks``; the partition report
    (``None`` if not)."""
    b = config.baoc
    try:
        report = partition_report(model, b.granularity, b.blocks)
    except (TypeError, ValueError) as err:
        fix = "fix baoc.blocks (globs over model.named_parameters() names)"
        return CheckResult("blocks", False, str(err), fix), None
    numel = sum(report.numel.values())
    named = f", {len(report.pattern_blocks)} from patterns ({', '.join(report.pattern_blocks)})" if report.pattern_blocks else ""
    frozen = f"; {len(report.frozen)} frozen parameter(s) left out" if report.frozen else ""
    detail = (
        f"{len(report.blocks)} blocks ({b.granularity} granularity{named}) over {numel:,} trainable "
        f"parameters{frozen}"
    )
    return CheckResult("blocks", True, detail), report


@dataclass(frozen=True)
class _Instruments:
    """BAOC's instruments as the run sizes them: the sampler's elements per block, the bytes of its buffers,
    and the bytes of the instruments (its buffers and the shadow moments) together."""

    sizes: InstrumentSizes
    sampler_bytes: int


def _instruments(config: Config, model: nn.Module, blocks: dict[str, list[str]], device: str, rule: str) -> _Instruments:
    """The instruments of a run of ``config`` on ``model`` (the controller's sizing, from the state the weights'
    dtypes give the baseline)."""
    b = config.baoc
    params = dict(model.named_parameters())
    shapes = {name: [tuple(params[n].shape) for n in names] for name, names in blocks.items()}
    baseline = baseline_state_bytes(shapes, weight_dtypes(config, params, blocks), rule)
    sizes = run_instruments(shapes, baseline, device, b.capacity, b.max_elements, b.instrument_share)
    accelerator = torch.device(device).type != "cpu"
    return _Instruments(sizes, sampler_bytes(shapes, b.capacity, sizes.max_elements, accelerator))


def _check_sampler(config: Config, block_numel: dict[str, int], instruments: _Instruments) -> CheckResult:
    """4. sampler overhead: the estimated cost against :data:`MAX_SAMPLER_OVERHEAD`, at the elements the run samples."""
    s = config.baoc
    sizes = instruments.sizes
    est = sampler_overhead(block_numel, s.sample_every, sizes.max_elements, s.capacity, s.sparse_sampling)
    lowered = (
        f"; baoc.max_elements={s.max_elements} lowered to {sizes.max_elements} per block, so that BAOC's instruments "
        f"stay within baoc.instrument_share" if sizes.max_elements < s.max_elements else ""
    )
    detail = (
        f"reads {est.elements_per_sample:,} gradient elements per sample ({est.share_per_sample:.1%} of the "
        f"gradient{lowered}), {est.samples_per_step:.2g} samples per step in warm-up: about {est.overhead:.2%} of a "
        f"training step (after warm-up {est.overhead_after:.2%}); sampler buffers "
        f"{format_bytes(instruments.sampler_bytes)}, of the instruments' {format_bytes(sizes.estimate_bytes)} "
        f"(see memory budget)"
    )
    if est.overhead <= MAX_SAMPLER_OVERHEAD:
        return CheckResult("sampler overhead", True, detail)
    # overhead ~ (2 / sample_every) * share: the sample_every that brings it within budget
    need = math.ceil(2 * OVERHEAD_PER_GRADIENT_SHARE * est.share_per_sample / MAX_SAMPLER_OVERHEAD)
    fix = (
        f"set baoc.sample_every >= {max(need, s.sample_every + 1)} (keep baoc.warmup_steps >= "
        f"{MIN_WARMUP_SAMPLES} x sample_every)"
    )
    elements = _max_elements_within_budget(block_numel, s, sizes.max_elements)
    if elements is not None:
        fix += f", or baoc.max_elements <= {elements}"
    return CheckResult(
        "sampler overhead", False, detail + f", over the {MAX_SAMPLER_OVERHEAD:.0%} the sampler is designed for", fix
    )


def _max_elements_within_budget(block_numel: dict[str, int], s: Any, sampled: int) -> int | None:
    """The largest ``max_elements`` up to ``sampled`` (the elements sampled now) whose estimated overhead is
    within budget (``None``: none is). A setting at most that samples at most that many (the instruments'
    allowance only lowers it)."""

    def cost(m: int) -> float:
        return sampler_overhead(block_numel, s.sample_every, m, s.capacity, s.sparse_sampling).overhead

    lo, hi = 1, sampled  # cost grows with max_elements
    if cost(lo) > MAX_SAMPLER_OVERHEAD:
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) <= MAX_SAMPLER_OVERHEAD else (lo, mid - 1)
    return lo


def _check_warmup(config: Config) -> CheckResult:
    b = config.baoc
    every = b.sample_every
    samples = (b.warmup_steps - 1) // every + 1
    max_steps = config.trainer.get("max_steps")
    if isinstance(max_steps, int) and max_steps > 0 and b.warmup_steps >= max_steps:
        return CheckResult(
            "warm-up",
            False,
            f"baoc.warmup_steps={b.warmup_steps} >= trainer.max_steps={max_steps}: warm-up never ends and the "
            f"optimizer states stay in the start allocation (from the prior risk, not measured)",
            f"set baoc.warmup_steps to about a fifth of the run (e.g. {max(every + 2, max_steps // 5)})",
        )
    detail = f"{b.warmup_steps} steps in the start allocation, {samples} gradient samples (every {every} steps)"
    if samples < MIN_WARMUP_SAMPLES:
        return CheckResult(
            "warm-up",
            False,
            detail + f": fewer than {MIN_WARMUP_SAMPLES}, the statistics would be noisy",
            f"set baoc.warmup_steps >= {MIN_WARMUP_SAMPLES * every} or baoc.sample_every <= "
            f"{max(1, b.warmup_steps // MIN_WARMUP_SAMPLES)}",
        )
    if samples > b.capacity:
        detail += f"; the ring keeps the last {b.capacity}"
    if isinstance(max_steps, int) and max_steps > 0:
        detail += f"; {b.warmup_steps / max_steps:.0%} of trainer.max_steps={max_steps}"
    return CheckResult("warm-up", True, detail)


def _check_risk(config: Config) -> CheckResult:
    b = config.baoc
    if b.max_block_risk is not None and b.max_block_risk <= 0:
        return CheckResult(
            "risk thresholds",
            False,
            "baoc.max_block_risk=0 admits only the formats of zero risk (fp32, offload), so a "
            "budget below fp32 can only be met by lifting the cap",
            "set baoc.max_block_risk to null (no cap) or a positive cap, e.g. 0.05",
        )
    cap = "no per-block cap" if b.max_block_risk is None else f"per-block risk cap {b.max_block_risk:g}"
    triggers = b.reevaluate_every_n_epochs is not None or b.monitor is not None
    if not triggers:
        return CheckResult(
            "risk thresholds", True, f"{cap}; hysteresis {b.hysteresis:g} unused (no re-evaluation trigger)"
        )
    low, high = HYSTERESIS_RANGE
    if not low <= b.hysteresis <= high:
        why = (
            "every re-evaluation would migrate on noise in the statistics (allocations flap)"
            if b.hysteresis < low
            else "a re-evaluation would migrate only if the total risk dropped by that much: practically never"
        )
        return CheckResult(
            "risk thresholds",
            False,
            f"{cap}; baoc.hysteresis={b.hysteresis:g}: {why}",
            f"set baoc.hysteresis in [{low}, {high}] (default 0.1)",
        )
    return CheckResult("risk thresholds", True, f"{cap}; hysteresis {b.hysteresis:g}")


def _check_trigger(config: Config) -> CheckResult:
    t = config.baoc
    parts = []
    if t.reevaluate_every_n_epochs is not None:
        parts.append(f"every {t.reevaluate_every_n_epochs} epoch(s)")
    if t.monitor is not None:
        expected = _direction(t.monitor)
        if expected is not None and expected != t.mode:
            return CheckResult(
                "re-evaluation trigger",
                False,
                f"baoc.monitor={t.monitor!r} reads like a metric that improves "
                f"{'upwards' if expected == 'max' else 'downwards'}, but mode={t.mode!r}: improvements would "
                f"count as a plateau",
                f"set baoc.mode: {expected}",
            )
        parts.append(f"plateau of {t.monitor!r} ({t.mode}, patience {t.patience}, min_delta {t.min_delta:g})")
    if not parts:
        return CheckResult("re-evaluation trigger", True, "none: the allocation is decided once, at warm-up end")
    return CheckResult("re-evaluation trigger", True, "; ".join(parts))


def render(results: Sequence[CheckResult], console: Any = None, title: str = "lightning-baoc check") -> None:
    """Print the checklist as a rich table (to ``console``, default: stdout)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = console or Console()
    table = Table(title=Text(title), show_lines=True)
    table.add_column("check", style="bold")
    table.add_column("result")
    table.add_column("found")
    table.add_column("fix")
    for r in results:
        # Text, not markup: details hold brackets ("formats: [fp32, int8]")
        status = Text(r.status, style="green" if r.passed else "bold red")
        table.add_row(Text(r.name), status, Text(r.detail), Text(r.fix))
    console.print(table)
    failed = [r.name for r in results if not r.passed]
    summary = f"{len(results) - len(failed)} passed, {len(failed)} failed" + (f": {', '.join(failed)}" if failed else "")
    console.print(Text(summary))


# ---------------------------------------------------------------------------- the subcommand


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``lightning-baoc check``."""
    parser.add_argument("--config", required=True, metavar="FILE", help="a YAML config with a baoc section (configs/*.yaml)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="OmegaConf dotlist overrides, e.g. baoc.memory_budget=0.25",
    )
    parser.add_argument(
        "--model",
        metavar="PRESET|PACKAGE.MODULE:FACTORY",
        help="the model (default: the config's model section); built on the meta device",
    )
    parser.add_argument(
        "--optimizer",
        choices=list(RULE_FORMATS),
        default="adamw",
        help="the optimizer the module's configure_optimizers returns (default: adamw): its formats are the ones "
        "allowed, and a fractional baoc.memory_budget is of its fp32 state (AdamW 8 bytes per parameter, SGD's and "
        "Lion's momentum 4)",
    )
    parser.add_argument(
        "--device",
        help="the training device checked for, e.g. cpu, cuda (default: the config's trainer.accelerator, else cuda if present, else cpu)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``lightning-baoc check``; 0 when every check passes, 1 when one fails.

    Bad input (``ValueError``/``TypeError``: a config that does not load, a model that cannot be
    built) propagates; the command line turns it into exit code 2.
    """
    from rich.console import Console
    from rich.text import Text

    config = load_config(args.config, args.overrides)
    # before the model is built: once imported, it is importable
    folder = example_folder(config.model.class_path, args.config) if args.model is None and config.model else None
    model, name = resolve_model(config, args.model, config_path=args.config)
    console = Console(width=max(Console().width, 140))
    if folder is not None:  # the templates' models: said, since the Python path alone would not find them
        console.print(Text(f"{name}: not importable from the Python path; imported from {folder} (the {EXAMPLES}/ folder "
                           f"beside the config's folder)"))
    device = args.device or default_device(config)
    results = run_checks(config, model, device, args.optimizer)
    who = "" if args.optimizer == "adamw" else f" with {RULE_NAMES[args.optimizer]}"
    render(results, console, title=f"lightning-baoc check: {args.config}, {name}{who} on {device}")
    return 0 if all(r.passed for r in results) else 1


__all__ = [
    "CheckResult",
    "HYSTERESIS_RANGE",
    "MAX_SAMPLER_OVERHEAD",
    "MIN_WARMUP_SAMPLES",
    "OVERHEAD_PER_GRADIENT_SHARE",
    "SamplerEstimate",
    "build_component",
    "default_device",
    "render",
    "resolve_model",
    "run",
    "run_checks",
    "sampler_overhead",
]
