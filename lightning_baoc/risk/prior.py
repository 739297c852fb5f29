"""The documented risk prior: what each format is expected to cost a block before any state or
gradient is seen (planning a model, or a block whose parameters never stepped yet).

``risk[b][f]`` is the format's whole-model prior :data:`PRIOR_RISK`, weighted by the block's kind
(:func:`block_kind`: embeddings and heads are sensitive to state precision) and by its share of the
model's elements (:func:`prior_risk`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from torch import nn

from lightning_baoc.formats import DEFAULT_MIN_8BIT_NUMEL, formats_of, numel_of, resolve_in
from lightning_baoc.formats.base import as_shape
from lightning_baoc.sampling.blocks import ROOT_BLOCK

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

#: :data:`PRIOR_RISK` of every update rule. SGD's and Lion's momentum formats, from the ViT table of
#: ``benchmarks/sgd_lion.py`` (accuracy against the same optimizer with an fp32 buffer, realistic
#: recipe): a bf16 buffer within noise; an int8 buffer -0.0025 (SGD) and -0.010 (Lion); no buffer
#: -0.076 for SGD (plain SGD is a different optimizer) and +0.001 for Lion (sign descent), which is
#: still priced above int8: one task is not a law.
PRIOR_RISKS: Mapping[str, Mapping[str, float]] = {
    "adamw": PRIOR_RISK,
    "sgd": {"fp32": 0.0, "bf16": 0.005, "int8": 0.02, "none": 0.15},
    "lion": {"fp32": 0.0, "bf16": 0.005, "int8": 0.02, "none": 0.05},
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
    rule: str = "adamw",
) -> dict[str, dict[str, float]]:
    """The documented prior: risk[b][f] = sum over b's tensors of
    ``PRIOR_RISK[f'] x weight(kind of b, f') x numel / numel of the model``, where ``f'`` is the
    format the tensor really gets (fallbacks) and the weight is :data:`PRIOR_KIND_WEIGHT`, times
    :data:`PRIOR_ATTENTION_NO_MOMENTUM` for momentum-free formats on attention. ``rule`` picks the
    optimizer's formats and their priors (:data:`PRIOR_RISKS`; default: AdamW's).

    Example:
        >>> prior_risk({"fc": [(64, 64)]}, {"fc": "other"}, ["fp32", "int8"])
        {'fc': {'fp32': 0.0, 'int8': 0.022}}
    """
    registry, priors = formats_of(rule), PRIOR_RISKS[rule]
    names = list(registry) if formats is None else list(formats)
    total = sum(numel_of(s) for shapes in blocks.values() for s in shapes) or 1
    out: dict[str, dict[str, float]] = {}
    for block, shapes in blocks.items():
        kind = kinds.get(block, "other")
        row = {}
        for f in names:
            risk = 0.0
            for s in shapes:
                real = resolve_in(registry, f, as_shape(s), min_8bit_numel)
                weight = PRIOR_KIND_WEIGHT.get(kind, 1.0)
                if kind == "attention" and not registry[real].has_momentum:
                    weight *= PRIOR_ATTENTION_NO_MOMENTUM
                risk += priors[real] * weight * numel_of(s) / total
            row[f] = risk
        out[block] = row
    return out


__all__ = ["PRIOR_ATTENTION_NO_MOMENTUM", "PRIOR_KIND_WEIGHT", "PRIOR_RISK", "PRIOR_RISKS", "block_kind", "prior_risk"]
