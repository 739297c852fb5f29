"""BlockwiseAdamW: AdamW with a state format per parameter; BlockwiseSGD and BlockwiseLion: SGD and
Lion with a momentum format per parameter.

- :mod:`.optimizer`: the shared machinery (:class:`BlockwiseOptimizer`) and :class:`BlockwiseAdamW`;
- :mod:`.sgd_lion`: :class:`BlockwiseSGD` and :class:`BlockwiseLion`;
- :mod:`.aliases`: BlockwiseAdamW's and BlockwiseSGD's classes named like a user's optimizer class;
- the parts an optimizer holds, over one records table: :mod:`.pools` (parameter records, per-format
  contiguous state pools, accounting, conversions), :mod:`.stepping` (the step, by format and device),
  :mod:`.masters` (master-weight corrections), :mod:`.gradient_release` (each parameter stepped in
  backward), :mod:`.persist` (state dicts, atomic validated loads, copies and pickling);
- :mod:`.checkpoint`: the state-dict layout, checksums, plain-AdamW export, :class:`CheckpointError`;
- :mod:`.distributed`: the layout of a sharded optimizer's state dict for ``torch.distributed.checkpoint``;
- :mod:`.validate`: a whole state dict validated before anything changes;
- :mod:`.args`: ``torch.optim.AdamW``'s constructor arguments, checked as torch does;
- :mod:`.graph_step`: the GPU's step captured in a CUDA graph; :mod:`.amp`: AMP's scaler feeding the step;
- :mod:`.offload_schedule`: the ``offload`` states' interleaved update (:class:`OffloadSchedule` its settings);
- :mod:`.deepspeed`: the optimizers as DeepSpeed ZeRO's client (:func:`zero_client`).
"""

from __future__ import annotations

from typing import Any

from lightning_baoc.optim.aliases import optimizer_alias, resolve_alias
from lightning_baoc.optim.checkpoint import CheckpointError, export_adamw_state_dict, load_checkpoint, seal_state_dict
from lightning_baoc.optim.deepspeed import zero_client
from lightning_baoc.optim.distributed import saved_formats
from lightning_baoc.optim.offload_schedule import OffloadSchedule
from lightning_baoc.optim.optimizer import BlockwiseAdamW, BlockwiseOptimizer
from lightning_baoc.optim.sgd_lion import BlockwiseLion, BlockwiseSGD


def __getattr__(attr: str) -> Any:
    """Resolve ``_BlockwiseAs<name>`` (``_BlockwiseSGDAs<name>``) aliases on demand (PEP 562): pickles name them here."""
    return resolve_alias(attr)


__all__ = [
    "BlockwiseAdamW",
    "BlockwiseLion",
    "BlockwiseOptimizer",
    "BlockwiseSGD",
    "CheckpointError",
    "OffloadSchedule",
    "export_adamw_state_dict",
    "load_checkpoint",
    "optimizer_alias",
    "saved_formats",
    "seal_state_dict",
    "zero_client",
]
