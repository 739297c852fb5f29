"""partition: granularities, patterns, frozen parameters, ordering and the errors on bad input."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from lightning_baoc import partition
from lightning_baoc.sampling.blocks import ROOT_BLOCK, partition_report


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)


class Layer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = Attention(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))


class TinyGPT(nn.Module):
    def __init__(self, d: int = 8, n_layer: int = 2, vocab: int = 11) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(Layer(d) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.scale = nn.Parameter(torch.ones(1))  # owned by the root module


def flat(blocks: dict[str, list[str]]) -> list[str]:
    return [n for names in blocks.values() for n in names]


def test_module_granularity_keeps_weight_and_bias_together() -> None:
    model = TinyGPT()
    blocks = partition(model)
    assert blocks["h.0.attn.qkv"] == ["h.0.attn.qkv.weight", "h.0.attn.qkv.bias"]
    assert blocks["h.1.mlp.2"] == ["h.1.mlp.2.weight", "h.1.mlp.2.bias"]
    assert blocks["head"] == ["head.weight"]
    assert blocks[ROOT_BLOCK] == ["scale"]
    # every trainable parameter exactly once, in the model's order
    assert flat(blocks) == [n for n, _ in model.named_parameters()]
    # named_parameters() lists a module's own parameters before its children's
    assert list(blocks)[:4] == [ROOT_BLOCK, "wte", "h.0.ln", "h.0.attn.qkv"]


def test_layer_granularity_gives_one_block_per_repeated_layer() -> None:
    model = TinyGPT(n_layer=3)
    blocks = partition(model, "layer")
    assert list(blocks) == [ROOT_BLOCK, "wte", "h.0", "h.1", "h.2", "ln_f", "head"]
    assert blocks["h.1"] == [n for n, _ in model.h[1].named_parameters(prefix="h.1")]
    assert flat(blocks) == [n for n, _ in model.named_parameters()]


def test_layer_granularity_on_a_sequential_with_activations() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    # the parameter-owning children are all Linear: each is a layer (the same as per module)
    assert partition(model, "layer") == partition(model, "module")
    mixed = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    assert list(partition(mixed, "layer")) == ["0", "1", "2"]


def test_layer_granularity_takes_the_outermost_repetition() -> None:
    stage = lambda: nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))  # noqa: E731
    model = nn.Sequential(stage(), stage(), stage())
    assert list(partition(model, "layer")) == ["0", "1", "2"]
    assert partition(model, "layer")["1"] == ["1.0.weight", "1.0.bias", "1.1.weight", "1.1.bias"]


def test_param_granularity_is_one_block_per_tensor() -> None:
    model = TinyGPT()
    blocks = partition(model, "param")
    assert all(blocks[n] == [n] for n, _ in model.named_parameters())
    assert len(blocks) == len(list(model.parameters()))


def test_patterns_are_matched_first_and_the_rest_goes_by_granularity() -> None:
    model = TinyGPT()
    blocks = partition(model, "layer", patterns={"attention": "h.*.attn.*", "norms": ["*.ln.*", "ln_f.*"]})
    assert blocks["attention"] == [
        "h.0.attn.qkv.weight",
        "h.0.attn.qkv.bias",
        "h.0.attn.proj.weight",
        "h.0.attn.proj.bias",
        "h.1.attn.qkv.weight",
        "h.1.attn.qkv.bias",
        "h.1.attn.proj.weight",
        "h.1.attn.proj.bias",
    ]
    norms = ["h.0.ln.weight", "h.0.ln.bias", "h.1.ln.weight", "h.1.ln.bias", "ln_f.weight", "ln_f.bias"]
    assert blocks["norms"] == norms
    assert blocks["h.0"] == ["h.0.mlp.0.weight", "h.0.mlp.0.bias", "h.0.mlp.2.weight", "h.0.mlp.2.bias"]
    # blocks are ordered by their first parameter in the model
    assert list(blocks) == [ROOT_BLOCK, "wte", "norms", "attention", "h.0", "h.1", "head"]
    assert sorted(flat(blocks)) == sorted(n for n, _ in model.named_parameters())


def test_frozen_parameters_are_left_out_and_reported(caplog: pytest.LogCaptureFixture) -> None:
    model = TinyGPT()
    model.wte.weight.requires_grad_(False)
    model.h[0].ln.bias.requires_grad_(False)
    with caplog.at_level(logging.INFO, logger="lightning_baoc.sampling.blocks"):
        blocks = partition(model)
    assert "wte" not in blocks
    assert blocks["h.0.ln"] == ["h.0.ln.weight"]
    assert "2 frozen parameter(s)" in caplog.text and "wte.weight" in caplog.text
    report = partition_report(model)
    assert report.frozen == ["wte.weight", "h.0.ln.bias"]
    assert report.blocks == blocks
    assert report.numel["h.0.attn.qkv"] == 8 * 24 + 24
    assert sum(report.numel.values()) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_tied_parameters_appear_once() -> None:
    model = TinyGPT()
    model.head.weight = model.wte.weight
    blocks = partition(model)
    assert "head" not in blocks  # named_parameters() lists the shared tensor under its first name
    assert blocks["wte"] == ["wte.weight"]


def test_partition_is_deterministic() -> None:
    assert partition(TinyGPT(), "layer", {"a": "h.*.mlp.*"}) == partition(TinyGPT(), "layer", {"a": "h.*.mlp.*"})


# ----------------------------------------------------------------------------- errors


def test_unknown_granularity_names_the_value_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"granularity='block'.*\['module', 'layer', 'param'\]"):
        partition(TinyGPT(), "block")


def test_pattern_matching_nothing_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"patterns\['mlp'\].*matches no parameter"):
        partition(TinyGPT(), patterns={"mlp": "transformer.*.mlp.*"})


def test_pattern_matching_only_frozen_parameters_is_an_error() -> None:
    model = TinyGPT()
    model.wte.weight.requires_grad_(False)
    with pytest.raises(ValueError, match=r"patterns\['emb'\].*only frozen parameters \(wte.weight\)"):
        partition(model, patterns={"emb": "wte.*"})


def test_parameter_claimed_by_two_patterns_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"'h.0.attn.qkv.bias' is claimed by two pattern blocks, 'attn' and 'bias'"):
        partition(TinyGPT(), patterns={"attn": "h.*.attn.*", "bias": "*.bias"})


def test_pattern_block_name_clashing_with_a_granularity_block_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"block\(s\) \['head'\]"):
        partition(TinyGPT(), patterns={"head": "wte.*"})


def test_bad_pattern_values_are_errors() -> None:
    with pytest.raises(TypeError, match="patterns must be a mapping"):
        partition(TinyGPT(), patterns=["h.*"])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"patterns\['x'\] must be a glob"):
        partition(TinyGPT(), patterns={"x": []})
    with pytest.raises(ValueError, match="every glob must be a non-empty str"):
        partition(TinyGPT(), patterns={"x": ["h.*", 3]})  # type: ignore[list-item]


def test_zero_size_parameter_is_an_error() -> None:
    model = TinyGPT()
    model.empty = nn.Parameter(torch.empty(0, 4))
    with pytest.raises(ValueError, match=r"'empty' has zero elements \(shape \(0, 4\)\)"):
        partition(model)
    model.empty.requires_grad_(False)  # a frozen one is simply left out
    assert "empty" not in flat(partition(model))


def test_model_without_trainable_parameters_is_an_error() -> None:
    model = TinyGPT().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        partition(model)
    with pytest.raises(ValueError, match="no trainable parameters"):
        partition(nn.ReLU())


def test_non_module_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        partition([nn.Linear(2, 2)])  # type: ignore[arg-type]


