"""BlockwiseAdamW: AdamW with a state format per parameter; BlockwiseSGD and BlockwiseLion: SGD and
Lion with a momentum format per parameter.

- :mod:`.optimizer`: the shared machinery (:class:`BlockwiseOptimizer`) and :class:`BlockwiseAdamW`;
- :mod:`.sgd_lion`: :class:`BlockwiseSGD` and :class:`BlockwiseLion`;
- the parts an optimizer holds, over one records table: :mod:`.pools` (parameter records, per-format
  contiguous state pools, accounting, conversions), :mod:`.stepping` (the step, by format and device),
  :mod:`.masters` (master-weight corrections), :mod:`.gradient_release` (each parameter stepped in
  backward), :mod:`.placement` (where its tensors lie in their parameters: whole, FSDP2's shards,
  DeepSpeed's fragments);
- :mod:`.checkpoint`: the optimizer's checkpoints: the state-dict layout, checksums and plain exports
  (:class:`CheckpointError`), the distributed layout, the validation before a load, and the codec that
  turns the records and pools into a state dict, a copy's state, and back;
- :mod:`.args`: ``torch.optim.AdamW``'s constructor arguments, checked as torch does;
- :mod:`.graph_step`: the GPU's step captured in a CUDA graph; :mod:`.amp`: AMP's scaler feeding the step;
- :mod:`.offload_schedule`: the ``offload`` states' interleaved update (:class:`OffloadSchedule` its settings);
- :mod:`.deepspeed`: the optimizers as DeepSpeed ZeRO's client (:func:`zero_client`);
- :mod:`.swap`: a user's torch optimizer taken over by a blockwise one, LR schedulers rebound.
"""

from __future__ import annotations

from lightning_baoc.optim.checkpoint import CheckpointError, export_adamw_state_dict, load_checkpoint, saved_formats
from lightning_baoc.optim.deepspeed import zero_client
from lightning_baoc.optim.offload_schedule import OffloadSchedule
from lightning_baoc.optim.optimizer import BlockwiseAdamW, BlockwiseOptimizer
from lightning_baoc.optim.sgd_lion import BlockwiseLion, BlockwiseSGD

__all__ = [
    "BlockwiseAdamW",
    "BlockwiseLion",
    "BlockwiseOptimizer",
    "BlockwiseSGD",
    "CheckpointError",
    "OffloadSchedule",
    "export_adamw_state_dict",
    "load_checkpoint",
    "saved_formats",
    "zero_client",
]
