"""The controller's partition (``lightning_baoc.control.blocks.Blocks``), alone: parameters matched by
identity, what is refused, and parameters that join the optimizer after the blocks were built."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from lightning_baoc import BlockwiseAdamW, BlockwiseSGD
from lightning_baoc.config.settings import BAOCConfig
from lightning_baoc.control.blocks import Blocks


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def _blocks(**settings: object) -> Blocks:
    return Blocks(BAOCConfig(memory_budget=0.5, **settings))


def test_blocks_hold_the_optimizers_names_matched_by_identity() -> None:
    model = _model()
    # the optimizer names the parameters "0".."3" in its own order: the second layer first
    params = list(model[2].parameters()) + list(model[0].parameters())
    opt = BlockwiseAdamW(params)
    blocks = _blocks()
    blocks.build(opt, model)
    assert blocks.params == {"0": ["2", "3"], "2": ["0", "1"]}
    assert blocks.model_names == {"2": "0.weight", "3": "0.bias", "0": "2.weight", "1": "2.bias"}
    assert blocks.model_params() == {"0": ["0.weight", "0.bias"], "2": ["2.weight", "2.bias"]}
    assert blocks.names() == ["2", "3", "0", "1"] and blocks.size == 4


def test_the_setting_blocks_shapes_the_partition() -> None:
    model = _model()
    opt = BlockwiseAdamW(model.parameters())
    blocks = _blocks(blocks={"all": ["*"]})
    blocks.build(opt, model)
    assert blocks.params == {"all": ["0", "1", "2", "3"]}


def test_foreign_unregistered_and_frozen_only_optimizers_are_refused_naming_the_fix() -> None:
    model = _model()
    with pytest.raises(ValueError, match=r"1 parameter\(s\) that are not parameters of the model"):
        _blocks().build(BlockwiseAdamW(list(model.parameters()) + [nn.Parameter(torch.zeros(3))]), model)
    opt = BlockwiseAdamW(model[0].parameters())
    opt.param_groups[0]["params"].append(model[2].weight)
    with pytest.raises(ValueError, match=r"1 parameter\(s\) were put into optimizer.param_groups without add_param_group"):
        _blocks().build(opt, model)
    for p in model.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="holds no trainable parameter of the model"):
        _blocks().build(BlockwiseAdamW(model.parameters()), model)


def test_a_group_without_momentum_holds_no_state_and_stays_out_of_the_blocks() -> None:
    model = _model()
    opt = BlockwiseSGD([{"params": model[0].parameters(), "momentum": 0.9}, {"params": model[2].parameters()}], lr=0.1)
    blocks = _blocks()
    blocks.build(opt, model)
    assert list(blocks.params) == ["0"]


def test_parameters_joining_after_the_build_are_noticed_once() -> None:
    model = _model()
    model[2].weight.requires_grad_(False)
    opt = BlockwiseAdamW(model[0].parameters())
    opt.add_param_group({"params": [model[2].weight]})  # held, frozen: in no block
    blocks = _blocks()
    blocks.build(opt, model)
    assert blocks.names() == ["0", "1"] and not blocks.new_parameters(opt)
    model[2].weight.requires_grad_(True)  # unfrozen: it belongs in a block now
    assert blocks.new_parameters(opt)
    blocks.build(opt, model)
    assert blocks.params == {"0": ["0", "1"], "2": ["2"]} and not blocks.new_parameters(opt)
    opt.add_param_group({"params": [model[2].bias]})  # a group added
    assert blocks.new_parameters(opt)


def test_a_frozen_parameter_with_state_stays_in_its_block() -> None:
    model = _model()
    opt = BlockwiseAdamW(model.parameters())
    blocks = _blocks()
    blocks.build(opt, model)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    model[0].weight.requires_grad_(False)  # frozen after it stepped: its state still takes memory
    blocks.build(opt, model)
    assert blocks.params["0"] == ["0", "1"]
    blocks.forget()
    fresh = BlockwiseAdamW(model.parameters())  # no state: the frozen weight leaves the blocks
    blocks.build(fresh, model)
    assert blocks.params["0"] == ["1"]
