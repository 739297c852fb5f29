"""Partition a model's trainable parameters into blocks: the unit that gets one state format.

A block is a named list of parameter names (as in ``model.named_parameters()``). Three
granularities, and named glob patterns from a config that are matched first:

- ``"module"`` (default): one block per module that owns parameters directly, weight and bias
  together; the block is named after the module (``"h.0.attn.qkv"``), the root module's own
  parameters after :data:`ROOT_BLOCK`.
- ``"layer"``: every child of a ``ModuleList``/``Sequential``/``ModuleDict`` whose
  parameter-owning children are two or more modules of one class (the repeated layers, e.g. the
  transformer blocks) becomes one block with all its parameters; the rest stays per module.
- ``"param"``: one block per parameter tensor, named after the parameter.

Frozen parameters (``requires_grad=False``) belong to no block: they have no optimizer state.
:func:`partition_report` says which were left out; :func:`partition` logs it.

Ordering is deterministic: blocks come in the order of their first parameter in
``model.named_parameters()``, and parameters inside a block in that same order. Shared (tied)
parameters appear once, under their first name, as ``named_parameters()`` lists them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Collection, Mapping, Sequence, Union

from torch import nn

from lightning_baoc.optim.sharding import whole_numel

log = logging.getLogger(__name__)

#: Block name of the parameters that the root module owns directly (they have no module prefix).
ROOT_BLOCK = "<root>"

#: The granularities :func:`partition` accepts.
GRANULARITIES = ("module", "layer", "param")

#: A config's named patterns: block name -> one glob or a list of globs over parameter names.
Patterns = Mapping[str, Union[str, Sequence[str]]]

_REPEAT_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(frozen=True)
class PartitionReport:
    """What :func:`partition_report` found.

    Attributes:
        blocks: block name -> parameter names, in model order.
        frozen: names of the parameters left out because ``requires_grad`` is ``False``.
        numel: block name -> number of trainable elements in the block.
        granularity: the granularity the blocks not claimed by a pattern were formed with.
        pattern_blocks: names of the blocks that come from ``patterns``.
    """

    blocks: dict[str, list[str]]
    frozen: list[str] = field(default_factory=list)
    numel: dict[str, int] = field(default_factory=dict)
    granularity: str = "module"
    pattern_blocks: list[str] = field(default_factory=list)


def partition(
    model: nn.Module,
    granularity: str = "module",
    patterns: Patterns | None = None,
    keep: Collection[str] = (),
) -> dict[str, list[str]]:
    """Split the trainable parameters of ``model`` into named blocks.

    Args:
        model: the model whose ``named_parameters()`` are partitioned.
        granularity: how parameters not claimed by ``patterns`` are grouped: ``"module"``,
            ``"layer"`` or ``"param"`` (default: ``"module"``).
        patterns: optional named glob patterns (``fnmatch``, case-sensitive) over parameter names,
            block name -> glob or list of globs; matched before ``granularity`` (default: ``None``).
        keep: names of parameters partitioned even if frozen now: ones that already hold
            optimizer state, whose bytes must stay counted (default: none).

    Returns:
        Block name -> parameter names, blocks ordered by their first parameter in the model.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or ``patterns`` is not a mapping of strings.
        ValueError: unknown ``granularity``; a pattern that matches no trainable parameter; a
            parameter claimed by two pattern blocks; a pattern block name that clashes with a
            block of ``granularity``; a trainable zero-size parameter; no trainable parameters.

    Example:
        >>> import torch.nn as nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> partition(model)
        {'0': ['0.weight', '0.bias'], '2': ['2.weight', '2.bias']}
        >>> partition(model, "param")["2.bias"]
        ['2.bias']
        >>> partition(model, patterns={"biases": "*.bias"})
        {'0': ['0.weight'], 'biases': ['0.bias', '2.bias'], '2': ['2.weight']}
    """
    report = partition_report(model, granularity, patterns, keep)
    if report.frozen:
        log.info(
            "partition: %d frozen parameter(s) left out of the blocks (requires_grad=False): %s",
            len(report.frozen),
            ", ".join(report.frozen[:10]) + (", ..." if len(report.frozen) > 10 else ""),
        )
    return report.blocks


def partition_report(
    model: nn.Module,
    granularity: str = "module",
    patterns: Patterns | None = None,
    keep: Collection[str] = (),
) -> PartitionReport:
    """Like :func:`partition`, and also report the frozen parameters and the block sizes.

    Example:
        >>> import torch.nn as nn
        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
        >>> _ = model[0].weight.requires_grad_(False)
        >>> report = partition_report(model)
        >>> report.blocks, report.frozen, report.numel
        ({'1': ['1.weight', '1.bias']}, ['0.weight'], {'1': 20})
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}; pass the model itself")
    if not isinstance(granularity, str) or granularity not in GRANULARITIES:
        raise ValueError(f"Unknown granularity={granularity!r}; allowed: {list(GRANULARITIES)}")
    globs = _check_patterns(patterns)

    named = list(model.named_parameters())
    trainable: list[tuple[str, nn.Parameter]] = []
    frozen: list[str] = []
    for name, p in named:
        if not (p.requires_grad or name in keep):
            frozen.append(name)
            continue
        if whole_numel(p) == 0:  # a part of a parameter (a piece) may hold none of it here
            raise ValueError(
                f"Parameter {name!r} has zero elements (shape {tuple(p.shape)}): it cannot hold optimizer "
                "state; remove it from the model or set requires_grad=False on it"
            )
        trainable.append((name, p))
    if not trainable:
        raise ValueError(
            f"model {type(model).__name__} has no trainable parameters ({len(frozen)} frozen); "
            "there is nothing to partition: unfreeze some parameters (requires_grad=True)"
        )

    # Patterns first: each trainable parameter goes to at most one pattern block.
    owner = _pattern_owners(globs, [n for n, _ in trainable], frozen)
    layer_roots = _repeated_layers(model) if granularity == "layer" else []
    key_of: dict[str, str] = {}
    for name, _ in trainable:
        if name in owner:
            continue
        key_of[name] = _granular_block(name, granularity, layer_roots)
    clashes = sorted(set(key_of.values()) & set(globs))
    if clashes:
        raise ValueError(
            f"patterns name block(s) {clashes} that granularity={granularity!r} also forms from other "
            "parameters; rename the pattern block(s) or widen the pattern to take all of them"
        )
    owner.update(key_of)

    blocks: dict[str, list[str]] = {}
    numel: dict[str, int] = {}
    for name, p in trainable:  # model order: dicts keep insertion order
        b = owner[name]
        blocks.setdefault(b, []).append(name)
        numel[b] = numel.get(b, 0) + whole_numel(p)
    return PartitionReport(
        blocks=blocks,
        frozen=frozen,
        numel=numel,
        granularity=granularity,
        pattern_blocks=[b for b in blocks if b in globs],
    )


def _pattern_owners(globs: Mapping[str, tuple[str, ...]], trainable: list[str], frozen: list[str]) -> dict[str, str]:
    """Parameter name -> its pattern block; every pattern must match a trainable parameter and no
    parameter may match two blocks (the errors name the pattern and the fix)."""
    owner: dict[str, str] = {}
    for block, block_globs in globs.items():
        hits = [n for n in trainable if any(fnmatchcase(n, g) for g in block_globs)]
        if not hits:
            frozen_hits = [n for n in frozen if any(fnmatchcase(n, g) for g in block_globs)]
            why = f"only frozen parameters ({', '.join(frozen_hits[:5])})" if frozen_hits else "no parameter"
            raise ValueError(
                f"patterns[{block!r}] = {list(block_globs)!r} matches {why}; patterns are fnmatch globs "
                f"over trainable parameter names such as {trainable[:3]}: fix or remove it"
            )
        for n in hits:
            if n in owner:
                raise ValueError(
                    f"Parameter {n!r} is claimed by two pattern blocks, {owner[n]!r} and {block!r}; "
                    "a parameter belongs to one block: make the patterns disjoint"
                )
            owner[n] = block
    return owner


def _check_patterns(patterns: Patterns | None) -> dict[str, tuple[str, ...]]:
    """Normalize ``patterns`` to block name -> tuple of globs; errors name the bad entry."""
    if patterns is None:
        return {}
    if not isinstance(patterns, Mapping):
        raise TypeError(
            f"patterns must be a mapping of block name -> glob or list of globs, got {type(patterns).__name__}; "
            "e.g. patterns={'attn': 'h.*.attn.*'}"
        )
    out: dict[str, tuple[str, ...]] = {}
    for block, value in patterns.items():
        if not isinstance(block, str) or not block:
            raise TypeError(f"patterns keys must be non-empty block names (str), got {block!r}")
        globs = (value,) if isinstance(value, str) else value
        if isinstance(globs, (bytes, Mapping)) or not isinstance(globs, Sequence) or not globs:
            raise ValueError(
                f"patterns[{block!r}] must be a glob (str) or a non-empty list of globs, got {value!r}"
            )
        for g in globs:
            if not isinstance(g, str) or not g:
                raise ValueError(f"patterns[{block!r}] has {g!r}; every glob must be a non-empty str")
        out[block] = tuple(globs)
    return out


def _repeated_layers(model: nn.Module) -> list[str]:
    """Qualified names of the repeated layers: children of a container of same-class modules.

    Only the outermost repetition counts (a repeated layer that itself holds repeated sub-layers is
    one block), and only children that hold trainable parameters are compared, so activations
    without parameters inside a ``Sequential`` do not break the repetition.
    """
    roots: list[str] = []
    for qual, module in model.named_modules():
        if not isinstance(module, _REPEAT_CONTAINERS):
            continue
        if any(qual == r or qual.startswith(r + ".") for r in roots):
            continue
        kids = [
            (name, child)
            for name, child in module.named_children()
            if any(p.requires_grad and p.numel() > 0 for p in child.parameters())
        ]
        if len(kids) >= 2 and len({type(child) for _, child in kids}) == 1:
            prefix = f"{qual}." if qual else ""
            roots.extend(prefix + name for name, _ in kids)
    return roots


def _granular_block(name: str, granularity: str, layer_roots: Sequence[str]) -> str:
    """Block name of parameter ``name`` under ``granularity`` (patterns aside)."""
    if granularity == "param":
        return name
    if granularity == "layer":
        for root in layer_roots:
            if name.startswith(root + "."):
                return root
    module, _, _ = name.rpartition(".")
    return module or ROOT_BLOCK
