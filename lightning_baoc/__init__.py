"""lightning_baoc: budget-aware, block-wise optimizer-state formats for PyTorch Lightning."""

from lightning_baoc.formats import FORMATS
from lightning_baoc.optim import BlockwiseAdamW
from lightning_baoc.blocks import partition
from lightning_baoc.sampler import GradientSampler
from lightning_baoc.solver import Allocation, BudgetInfeasibleError, parse_memory_budget, parse_time_budget, select_boundaries, solve

# public names of the other modules are added below, one import line each
__all__ = ["FORMATS", "BlockwiseAdamW", "partition", "GradientSampler"]
__all__ += ["solve", "Allocation", "BudgetInfeasibleError", "parse_memory_budget", "parse_time_budget", "select_boundaries"]
from lightning_baoc.callback import BAOC
from lightning_baoc.fabric import BAOCStrategy
__all__ += ["BAOC", "BAOCStrategy"]
from lightning_baoc.config import BAOCSection, Config, ConfigError, json_schema, load_config, parse_config
__all__ += ["BAOCSection", "Config", "ConfigError", "json_schema", "load_config", "parse_config"]
from lightning_baoc.optim_state import CheckpointError, export_adamw_state_dict, load_checkpoint
__all__ += ["CheckpointError", "export_adamw_state_dict", "load_checkpoint"]
from lightning_baoc.settings import BAOCConfig, SettingError
__all__ += ["BAOCConfig", "SettingError"]
