"""Plan optimizer-state memory for a large model without allocating it: ``lightning-baoc plan``.

The model is built on the ``meta`` device (shapes only, no memory): a preset (a LLaMA-7B-shaped
decoder, a ViT-B/16, a tiny decoder for tests) or any ``package.module:factory``. Its parameters are
partitioned into blocks (:func:`lightning_baoc.blocks.partition`), and the plan reports the
parameter count, the fp32 AdamW state (8 bytes per parameter), every uniform format's exact bytes
(fallbacks for 1-D and small tensors included, as the optimizer allocates them), and allocations
from :func:`lightning_baoc.solve` at the budgets given.

Risk comes from a statistics file saved by a real run (JSON ``{"blocks": [{"name": ..., "risk":
{format: value}}]}``, the shape of ``baoc_allocation.json``'s blocks) or, without one, from the
documented prior :data:`PRIOR_RISK` (see :func:`prior_risk`). Step time comes from a calibration of
the local device (``calibrate=True``) or the prior :data:`~lightning_baoc.calibration.PRIOR_STEP_COST`.
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .blocks import ROOT_BLOCK, partition
from .budget import absolute_time_with_prior_error, format_bytes, format_decimal_bytes, is_absolute_time
from .calibration import (
    check_mask,
    offload_saves_memory,
)
from .costs import AllocationProblem
from .formats import DEFAULT_MIN_8BIT_NUMEL, FORMATS, format_state_bytes, numel_of, resolve_format
from .solver import Allocation, BudgetInfeasibleError

# ---------------------------------------------------------------------------- presets


@dataclass(frozen=True)
class DecoderConfig:
    """A LLaMA-style decoder: RMSNorm, bias-free projections, SwiGLU MLP, untied head."""

    vocab: int = 32000
    dim: int = 4096
    layers: int = 32
    heads: int = 32
    mlp: int = 11008


class DecoderLayer(nn.Module):
    """Pre-norm attention and SwiGLU MLP (module names as in LLaMA checkpoints)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.input_layernorm = nn.RMSNorm(cfg.dim)
        self.self_attn = nn.ModuleDict(
            {name: nn.Linear(cfg.dim, cfg.dim, bias=False) for name in ("q_proj", "k_proj", "v_proj", "o_proj")}
        )
        self.post_attention_layernorm = nn.RMSNorm(cfg.dim)
        self.mlp = nn.ModuleDict(
            {
                "gate_proj": nn.Linear(cfg.dim, cfg.mlp, bias=False),
                "up_proj": nn.Linear(cfg.dim, cfg.mlp, bias=False),
                "down_proj": nn.Linear(cfg.mlp, cfg.dim, bias=False),
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.input_layernorm(x)
        q, k, v = (self.self_attn[n](h).view(b, t, self.heads, -1).transpose(1, 2) for n in ("q_proj", "k_proj", "v_proj"))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.self_attn["o_proj"](a)
        h = self.post_attention_layernorm(x)
        return x + self.mlp["down_proj"](F.silu(self.mlp["gate_proj"](h)) * self.mlp["up_proj"](h))


class Decoder(nn.Module):
    """A LLaMA-shaped causal language model (no rotary embedding: the planner needs shapes)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


class ViTBlock(nn.Module):
    """Pre-norm transformer encoder block (timm's names: norm1, attn.qkv, attn.proj, mlp.fc1/fc2)."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.ModuleDict({"qkv": nn.Linear(dim, 3 * dim), "proj": nn.Linear(dim, dim)})
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.ModuleDict({"fc1": nn.Linear(dim, hidden), "fc2": nn.Linear(hidden, dim)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.attn["qkv"](self.norm1(x)).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.attn["proj"](a)
        return x + self.mlp["fc2"](F.gelu(self.mlp["fc1"](self.norm2(x))))


class ViT(nn.Module):
    """ViT-B/16 shapes by default: 224x224 images, 16x16 patches, 12 x 768, 1000 classes (86.6M)."""

    def __init__(self, image: int = 224, patch: int = 16, dim: int = 768, depth: int = 12, heads: int = 12,
                 hidden: int = 3072, classes: int = 1000) -> None:
        super().__init__()
        tokens = (image // patch) ** 2 + 1
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, tokens, dim))
        self.blocks = nn.ModuleList(ViTBlock(dim, heads, hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


#: name -> (factory, one-line description). Factories build on the current default device.
PRESETS: Mapping[str, tuple[Callable[[], nn.Module], str]] = {
    "llama-7b": (lambda: Decoder(DecoderConfig()), "LLaMA-7B-shaped decoder: 32 x 4096, MLP 11008, vocab 32000 (6.74B)"),
    "vit-b16": (lambda: ViT(), "ViT-B/16: 224px, 12 x 768, MLP 3072, 1000 classes (86.6M)"),
    "tiny": (
        lambda: Decoder(DecoderConfig(vocab=512, dim=64, layers=2, heads=4, mlp=176)),
        "tiny decoder for tests: 2 x 64, MLP 176, vocab 512",
    ),
}


def build_model(spec: str, device: str | torch.device = "meta") -> nn.Module:
    """Build a preset or ``package.module:factory`` (called with no arguments) on ``device``.

    Example:
        >>> sum(p.numel() for p in build_model("llama-7b").parameters())
        6738415616
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model must be a preset {sorted(PRESETS)} or 'package.module:factory', got {spec!r}")
    if spec in PRESETS:
        factory = PRESETS[spec][0]
    elif ":" in spec:
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise ValueError(f"cannot import {module_name!r} from model={spec!r}: {err}") from None
        factory = module
        for part in attr.split("."):
            if not hasattr(factory, part):
                raise ValueError(f"{module_name!r} has no attribute {attr!r} (model={spec!r})")
            factory = getattr(factory, part)
        if not callable(factory):
            raise ValueError(f"model={spec!r} names {type(factory).__name__}, not a callable factory")
    else:
        raise ValueError(
            f"Unknown model {spec!r}; allowed: a preset {sorted(PRESETS)} or 'package.module:factory'"
        )
    with torch.device(device):
        model = factory()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={spec!r} built {type(model).__name__}, expected a torch.nn.Module")
    return model


# ---------------------------------------------------------------------------- risk prior

#: Prior risk of each format over a whole model (expected relative harm if every parameter used
#: it), for planning without statistics. Ordered by measured harm: int8 costs
#: ~2% perplexity at high learning rates; dropping momentum is worse, and no momentum with an
#: 8-bit v is a hazard (+30% perplexity on attention); offload is fp32 math (no risk, only time).
PRIOR_RISK: Mapping[str, float] = {
    "fp32": 0.0,
    "offload": 0.0,
    "bf16_momentum": 0.005,
    "bf16": 0.015,
    "int8": 0.022,
    "int8_factored": 0.04,
    "nomomentum": 0.06,
    "factored": 0.10,
    "nomomentum_int8": 0.30,
}

#: Prior weight of a block by kind: embeddings and heads are sensitive to state precision (the
#: reason for 8-bit Adam's "stable embedding"); attention is weighted up too.
PRIOR_KIND_WEIGHT: Mapping[str, float] = {"embedding": 2.0, "head": 2.0, "attention": 1.5, "norm": 1.0, "other": 1.0}

#: Extra weight of momentum-free formats on attention (on a character GPT, no momentum with an int8 v
#: on the attention layers raised perplexity by 30%).
PRIOR_ATTENTION_NO_MOMENTUM = 2.0

_ATTENTION_WORDS = ("attn", "attention", "q_proj", "k_proj", "v_proj", "o_proj", "qkv", "query", "key", "value")
_HEAD_WORDS = ("lm_head", "head", "classifier", "output", "fc_out")
_NORM_TYPES = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)


def block_kind(model: nn.Module, block: str) -> str:
    """``"embedding"``, ``"head"``, ``"attention"``, ``"norm"`` or ``"other"``, from names and types."""
    if block == ROOT_BLOCK:
        return "embedding"  # parameters the root owns: cls tokens, position embeddings
    try:
        module = model.get_submodule(block)
    except AttributeError:
        module = None
    words = block.lower().replace("-", "_").split(".")
    last = words[-1]
    if isinstance(module, nn.Embedding) or "embed" in last or "embedding" in last or last in ("wte", "wpe"):
        return "embedding"
    if isinstance(module, _NORM_TYPES) or "norm" in last or last.startswith("ln"):
        return "norm"
    if last in _HEAD_WORDS:
        return "head"
    if any(w in word for word in words for w in _ATTENTION_WORDS):
        return "attention"
    return "other"


def prior_risk(
    blocks: Mapping[str, Sequence[Sequence[int]]],
    kinds: Mapping[str, str],
    formats: Sequence[str] | None = None,
    min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL,
) -> dict[str, dict[str, float]]:
    """The documented prior: risk[b][f] = sum over b's tensors of
    ``PRIOR_RISK[f'] x weight(kind of b, f') x numel / numel of the model``, where ``f'`` is the
    format the tensor really gets (fallbacks) and the weight is :data:`PRIOR_KIND_WEIGHT`, times
    :data:`PRIOR_ATTENTION_NO_MOMENTUM` for momentum-free formats on attention.

    Example:
        >>> prior_risk({"fc": [(64, 64)]}, {"fc": "other"}, ["fp32", "int8"])
        {'fc': {'fp32': 0.0, 'int8': 0.022}}
    """
    names = list(FORMATS) if formats is None else list(formats)
    total = sum(numel_of(s) for shapes in blocks.values() for s in shapes) or 1
    out: dict[str, dict[str, float]] = {}
    for block, shapes in blocks.items():
        kind = kinds.get(block, "other")
        row = {}
        for f in names:
            risk = 0.0
            for s in shapes:
                real = resolve_format(f, tuple(s), min_8bit_numel)
                weight = PRIOR_KIND_WEIGHT.get(kind, 1.0)
                if kind == "attention" and not FORMATS[real].has_momentum:
                    weight *= PRIOR_ATTENTION_NO_MOMENTUM
                risk += PRIOR_RISK[real] * weight * numel_of(s) / total
            row[f] = risk
        out[block] = row
    return out


def load_statistics(path: str | os.PathLike[str], blocks: Sequence[str]) -> tuple[dict[str, dict[str, float]], list[str]]:
    """Per-format risks from a statistics file; returns (risk of the blocks found, blocks missing).

    The file is JSON ``{"blocks": [{"name": ..., "risk": {format: value}}, ...]}``. Blocks of the
    file that the model does not have are an error (a different model or granularity).
    """
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read statistics file {os.fspath(path)!r}: {err}") from None
    if not isinstance(data, Mapping) or not isinstance(data.get("blocks"), list):
        raise ValueError(
            f"statistics file {os.fspath(path)!r} must hold {{\"blocks\": [{{\"name\": ..., \"risk\": "
            f"{{format: value}}}}, ...]}}"
        )
    known = set(blocks)
    risk: dict[str, dict[str, float]] = {}
    for i, entry in enumerate(data["blocks"]):
        if not isinstance(entry, Mapping) or "name" not in entry or "risk" not in entry:
            raise ValueError(f"statistics blocks[{i}] needs 'name' and 'risk', got {entry!r}")
        name, values = entry["name"], entry["risk"]
        if name not in known:
            raise ValueError(
                f"statistics block {name!r} is not a block of this model (blocks like "
                f"{list(blocks)[:3]}); was the file saved with another model or granularity?"
            )
        if not isinstance(values, Mapping):
            raise ValueError(
                f"statistics block {name!r} has risk {values!r}: planning needs a risk per format "
                f"({{format: value}}), not the risk of one chosen format"
            )
        for f in values:
            if f not in FORMATS:
                raise ValueError(f"statistics block {name!r} names unknown format {f!r}; allowed: {list(FORMATS)}")
        risk[name] = {f: float(v) for f, v in values.items()}
    missing = [b for b in blocks if b not in risk]
    return risk, missing


# ---------------------------------------------------------------------------- the plan


@dataclass
class FormatFigure:
    """One uniform format over the whole model."""

    name: str
    device_bytes: int
    host_bytes: int
    fallback_params: int  # parameters that really get another format (1-D, small tensors)


@dataclass
class PlannedAllocation:
    """An allocation at one budget, or why there is none."""

    budget: str
    allocation: Allocation | None = None
    error: str | None = None
    params_by_format: dict[str, int] = field(default_factory=dict)
    min_memory: float | None = None  # where infeasible: the smallest feasible memory budget, bytes


@dataclass
class Plan:
    """What :func:`plan` found; :func:`render` prints it, :meth:`to_dict` is JSON-ready."""

    model: str
    device: str
    granularity: str
    params: int
    tensors: int
    blocks: dict[str, list[tuple[int, ...]]]
    fp32_bytes: int
    formats: list[FormatFigure]
    masked: dict[str, str]
    risk_source: str
    time_source: str | None
    time_budget: str | None
    allocations: list[PlannedAllocation]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "device": self.device,
            "granularity": self.granularity,
            "params": self.params,
            "tensors": self.tensors,
            "blocks": len(self.blocks),
            "fp32_adamw_state_bytes": self.fp32_bytes,
            "formats": {
                f.name: {"device_bytes": f.device_bytes, "host_bytes": f.host_bytes, "fallback_params": f.fallback_params}
                for f in self.formats
            },
            "masked": dict(self.masked),
            "risk_source": self.risk_source,
            "time_source": self.time_source,
            "time_budget": self.time_budget,
            "allocations": [
                {
                    "budget": a.budget,
                    "error": a.error,
                    "params_by_format": a.params_by_format,
                    **({"allocation": a.allocation.to_dict()} if a.allocation is not None else {}),
                }
                for a in self.allocations
            ],
        }


def plan(
    model: str | nn.Module,
    budgets: Sequence[float | int | str] = (),
    *,
    time_budget: float | str | None = None,
    device: str = "cuda",
    granularity: str = "module",
    statistics: str | os.PathLike[str] | None = None,
    mask: Sequence[str] | None = None,
    max_boundaries: int | None = None,
    calibrate_time: bool = False,
    cache_dir: str | os.PathLike[str] | None = None,
    min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL,
    method: str = "auto",
) -> Plan:
    """Plan the optimizer-state memory of ``model`` on ``device``.

    Args:
        model: a preset name, ``"package.module:factory"``, or a module (any device).
        budgets: memory budgets to allocate at (fractions like ``0.35`` or sizes like ``"6GB"``).
        time_budget: optional time budget: a multiple of the fp32 step (``1.10``), or an absolute
            time (``"12ms"``) with ``calibrate_time=True`` (the prior costs have no unit).
        device: the training device planned for; decides the hardware mask and whether ``offload``
            saves device memory (default: ``"cuda"``).
        granularity: block granularity of :func:`~lightning_baoc.blocks.partition` (default:
            ``"module"``).
        statistics: a statistics file with per-format risks (default: the prior).
        mask: formats to exclude besides the hardware mask (default: none).
        max_boundaries: boundary selection: the format changes at most this many times along the
            blocks (default: no limit).
        calibrate_time: time costs from a calibration of ``device`` here (cached) instead of the
            prior (default: False).
        cache_dir: calibration cache directory (default: the user cache directory).
        min_8bit_numel: the optimizer's small-tensor threshold (default: 4096).
        method: the solver's method (default: ``"auto"``).

    Raises:
        ValueError: a bad model, budget or mask, or an absolute ``time_budget`` without
            ``calibrate_time`` (the message names both fixes).

    Example:
        >>> p = plan("tiny", [0.5], device="cpu")
        >>> p.params, p.fp32_bytes == 8 * p.params
        (166208, True)
    """
    if time_budget is not None and not calibrate_time and is_absolute_time(time_budget):
        raise absolute_time_with_prior_error(
            time_budget, "time_budget", "calibrate_time=True (--calibrate) to measure the step in seconds on the device."
        )
    name = model if isinstance(model, str) else type(model).__name__
    module = build_model(model) if isinstance(model, str) else model
    user_mask = check_mask(mask) if mask else {}
    names = dict(module.named_parameters())
    groups = partition(module, granularity)
    blocks = {b: [tuple(names[p].shape) for p in params] for b, params in groups.items()}
    # the problem the training controller and ``check`` build: offload only with a time budget
    problem = AllocationProblem(
        blocks,
        device,
        timed=time_budget is not None,
        costs="calibrate" if calibrate_time else "prior",
        min_8bit_numel=min_8bit_numel,
        mask=user_mask,
        cache_dir=cache_dir,
    )
    masked = problem.withheld
    params = sum(numel_of(s) for shapes in blocks.values() for s in shapes)
    tensors = sum(len(shapes) for shapes in blocks.values())
    fp32_bytes = sum(format_state_bytes("fp32", s, min_8bit_numel) for shapes in blocks.values() for s in shapes)

    off_device = offload_saves_memory(device)
    figures = []
    for f in FORMATS:
        total = sum(format_state_bytes(f, s, min_8bit_numel) for shapes in blocks.values() for s in shapes)
        fallback = sum(
            numel_of(s) for shapes in blocks.values() for s in shapes if resolve_format(f, s, min_8bit_numel) != f
        )
        on_host = f == "offload" and off_device
        figures.append(FormatFigure(f, 0 if on_host else total, total if on_host else 0, fallback))

    allocations: list[PlannedAllocation] = []
    risk_source = "prior (PRIOR_RISK x kind weight x size share)"
    time_source: str | None = None
    if budgets:
        kinds = {b: block_kind(module, b) for b in blocks}
        risk = prior_risk(blocks, kinds, min_8bit_numel=min_8bit_numel)
        if statistics is not None:
            measured, missing = load_statistics(statistics, list(blocks))
            for b, row in measured.items():
                risk[b] = {f: row[f] for f in row}
            risk_source = f"statistics file ({len(measured)} blocks" + (
                f"; prior for {len(missing)} missing)" if missing else ")"
            )
        for budget in budgets:
            entry = PlannedAllocation(str(budget))
            try:
                alloc = problem.solve(risk, budget, time_budget, method=method, max_boundaries=max_boundaries)
            except BudgetInfeasibleError as err:
                entry.error, entry.min_memory = str(err), err.min_memory
            else:
                entry.allocation = alloc
                by_format: dict[str, int] = {}
                for b, f in alloc.formats.items():
                    by_format[f] = by_format.get(f, 0) + sum(numel_of(s) for s in blocks[b])
                entry.params_by_format = by_format
            allocations.append(entry)
        time_source = problem.time_source
    return Plan(
        model=name,
        device=str(device),
        granularity=granularity,
        params=params,
        tensors=tensors,
        blocks=blocks,
        fp32_bytes=fp32_bytes,
        formats=figures,
        masked=masked,
        risk_source=risk_source,
        time_source=time_source,
        time_budget=None if time_budget is None else str(time_budget),
        allocations=allocations,
    )


def _bytes(n: float) -> str:
    return f"{format_decimal_bytes(n)} ({format_bytes(n)})"


def render(p: Plan, console: Any = None) -> None:
    """Print a plan as rich tables (to ``console``, default: stdout)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    head = Table(title=f"lightning-baoc plan: {p.model} on {p.device}", show_header=False)
    head.add_column("", style="bold")
    head.add_column("")
    head.add_row("parameters", f"{p.params:,} ({p.params / 1e9:.3g}B)" if p.params >= 1e8 else f"{p.params:,}")
    head.add_row("tensors / blocks", f"{p.tensors:,} / {len(p.blocks):,} ({p.granularity} granularity)")
    head.add_row("fp32 AdamW state", f"{_bytes(p.fp32_bytes)} = 8 bytes x {p.params:,} parameters")
    console.print(head)

    table = Table(title="Uniform formats (exact bytes as allocated, fallbacks included)")
    for col in ("format", "device bytes", "of fp32", "bytes/param", "note"):
        table.add_column(col, justify="right" if col not in ("format", "note") else "left")
    for f in p.formats:
        notes = []
        if f.host_bytes:
            notes.append(f"+ {_bytes(f.host_bytes)} in host memory")
        if f.fallback_params:
            notes.append(f"{f.fallback_params:,} params fall back (1-D or < 8-bit threshold)")
        if f.name in p.masked:
            notes.append("masked (see below)")
        table.add_row(
            f.name,
            _bytes(f.device_bytes),
            f"{f.device_bytes / p.fp32_bytes:.3f}" if p.fp32_bytes else "-",
            f"{f.device_bytes / p.params:.3f}" if p.params else "-",
            "; ".join(notes),
        )
    console.print(table)

    if p.allocations:
        title = f"Allocations (risk: {p.risk_source}"
        title += f"; time: {p.time_source}, budget {p.time_budget}x)" if p.time_source else ")"
        alloc_table = Table(title=title)
        for col in ("budget", "state memory", "of fp32", "step time", "risk", "parameters by format", "solver"):
            alloc_table.add_column(col, justify="left" if col in ("parameters by format", "budget") else "right")
        for entry in p.allocations:
            a = entry.allocation
            if a is None:
                alloc_table.add_row(entry.budget, "infeasible", "", "", "", entry.error or "", "")
                continue
            shares = sorted(entry.params_by_format.items(), key=lambda kv: -kv[1])
            mix = ", ".join(f"{f} {n / p.params:.0%}" if n >= 0.005 * p.params else f"{f} <1%" for f, n in shares)
            step = f"{a.time / a.fp32_time:.3f}x" if (a.time is not None and a.fp32_time) else "-"
            solver = "optimal" if a.optimal else f"gap <= {a.gap:.1e}"
            alloc_table.add_row(
                entry.budget, _bytes(a.memory), f"{a.memory / p.fp32_bytes:.3f}", step, f"{a.risk:.4g}", mix, solver
            )
        console.print(alloc_table)
    if p.masked:
        console.print("Masked: " + "; ".join(f"{k}: {v}" for k, v in p.masked.items()))


__all__ = [
    "PRESETS",
    "PRIOR_ATTENTION_NO_MOMENTUM",
    "PRIOR_KIND_WEIGHT",
    "PRIOR_RISK",
    "Decoder",
    "DecoderConfig",
    "Plan",
    "ViT",
    "block_kind",
    "build_model",
    "load_statistics",
    "plan",
    "prior_risk",
    "render",
]
