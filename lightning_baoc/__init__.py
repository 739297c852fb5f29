"""lightning_baoc: budget-aware, block-wise optimizer-state formats for PyTorch Lightning.

The public names below are imported on first use (PEP 562), so importing a core module
(``lightning_baoc.solver``, ``lightning_baoc.optim``, ...) never loads Lightning: only the
integrations (:class:`BAOC`, :class:`BAOCStrategy`) do.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "FORMATS": "lightning_baoc.formats",
    "BlockwiseAdamW": "lightning_baoc.optim",
    "BlockwiseSGD": "lightning_baoc.optim",
    "BlockwiseLion": "lightning_baoc.optim",
    "MOMENTUM_FORMATS": "lightning_baoc.formats",
    "partition": "lightning_baoc.sampling.blocks",
    "GradientSampler": "lightning_baoc.sampling",
    "solve": "lightning_baoc.solver",
    "Allocation": "lightning_baoc.solver",
    "BudgetInfeasibleError": "lightning_baoc.solver",
    "parse_memory_budget": "lightning_baoc.config.budget",
    "parse_time_budget": "lightning_baoc.config.budget",
    "select_boundaries": "lightning_baoc.solver",
    "BAOC": "lightning_baoc.integrations.callback",
    "BAOCStrategy": "lightning_baoc.integrations.fabric",
    "GradientRelease": "lightning_baoc.integrations.release",
    "BAOCSummary": "lightning_baoc.control.summary",
    "training_memory": "lightning_baoc.costs.memory",
    "TrainingMemory": "lightning_baoc.costs.memory",
    "BAOCSection": "lightning_baoc.config.files",
    "Config": "lightning_baoc.config.files",
    "ConfigError": "lightning_baoc.config.files",
    "json_schema": "lightning_baoc.config.files",
    "load_config": "lightning_baoc.config.files",
    "parse_config": "lightning_baoc.config.files",
    "CheckpointError": "lightning_baoc.optim",
    "export_adamw_state_dict": "lightning_baoc.optim",
    "load_checkpoint": "lightning_baoc.optim",
    "saved_formats": "lightning_baoc.optim",
    "BAOCConfig": "lightning_baoc.config.settings",
    "SettingError": "lightning_baoc.config.settings",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_baoc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # what type checkers and documentation tools see
    from lightning_baoc.config.budget import parse_memory_budget, parse_time_budget  # noqa: F401
    from lightning_baoc.config.files import BAOCSection, Config, ConfigError, json_schema, load_config, parse_config  # noqa: F401
    from lightning_baoc.config.settings import BAOCConfig, SettingError  # noqa: F401
    from lightning_baoc.control.summary import BAOCSummary  # noqa: F401
    from lightning_baoc.costs.memory import TrainingMemory, training_memory  # noqa: F401
    from lightning_baoc.formats import FORMATS, MOMENTUM_FORMATS  # noqa: F401
    from lightning_baoc.integrations.callback import BAOC  # noqa: F401
    from lightning_baoc.integrations.fabric import BAOCStrategy  # noqa: F401
    from lightning_baoc.integrations.release import GradientRelease  # noqa: F401
    from lightning_baoc.optim import (  # noqa: F401
        BlockwiseAdamW,
        BlockwiseLion,
        BlockwiseSGD,
        CheckpointError,
        export_adamw_state_dict,
        load_checkpoint,
        saved_formats,
    )
    from lightning_baoc.sampling import GradientSampler  # noqa: F401
    from lightning_baoc.sampling.blocks import partition  # noqa: F401
    from lightning_baoc.solver import Allocation, BudgetInfeasibleError, select_boundaries, solve  # noqa: F401
