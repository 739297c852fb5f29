"""Shared by the tests of the controller's parts (``tests/control/``): the parts a part is built from."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_baoc.config.settings import BAOCConfig
from lightning_baoc.control.blocks import Blocks
from lightning_baoc.control.instrumentation import Instrumentation
from lightning_baoc.control.tables import BlockTables


def instrumented(model: nn.Module, opt: Any, **settings: Any) -> Instrumentation:
    """The blocks, tables and instruments (sampler and shadow started) of ``model`` under ``opt``, as
    ``BAOCController.install`` builds them: ``memory_budget=0.5``, the prior's costs, then ``settings``.
    The config, blocks and tables are the instrumentation's ``config``, ``blocks`` and ``tables``."""
    config = BAOCConfig(**{"memory_budget": 0.5, "calibration": "prior", **settings})
    blocks = Blocks(config)
    blocks.build(opt, model)
    tables = BlockTables(config, blocks)
    tables.refresh(opt)
    inst = Instrumentation(config, blocks, tables)
    inst.restart_sampler(model)
    inst.restart_shadow(opt)
    return inst


def backward(model: nn.Module, step: int, width: int = 16) -> None:
    """A backward pass of ``model`` on a batch of 8 seeded by ``step``."""
    g = torch.Generator().manual_seed(step)
    model(torch.randn(8, width, generator=g)).pow(2).mean().backward()
