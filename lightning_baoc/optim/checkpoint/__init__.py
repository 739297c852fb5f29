"""The blockwise optimizers' checkpoints, in one place: what a state dict holds, how it is checked, and
how an optimizer's state becomes one and back.

- :mod:`.layout`: the single-process state dict (entries, checksums, :func:`seal_state_dict`), files
  (:func:`load_checkpoint`), the plain exports (:func:`export_adamw_state_dict`) and :class:`CheckpointError`;
- :mod:`.distributed`: the layout of a sharded optimizer's state dict for ``torch.distributed.checkpoint``
  (:func:`saved_formats`);
- :mod:`.validate`: a whole state dict validated against a :class:`~.validate.LoadTarget` before anything
  changes (:func:`~.validate.plan_load`);
- :mod:`.codec`: the optimizer's part turning its records and pools into a state dict, a copy's state, and
  back (:class:`~.codec.CheckpointCodec`).

The package imports the optimizer's lower parts (records and pools, the step's rounding keys, sharding) and
never the optimizer: what a load is checked against comes in as a :class:`~.validate.LoadTarget`, the
group's hyperparameters as ``hyper_of``.
"""

from __future__ import annotations

from lightning_baoc.optim.checkpoint.distributed import saved_formats
from lightning_baoc.optim.checkpoint.layout import (
    CheckpointError,
    export_adamw_state_dict,
    load_checkpoint,
    seal_state_dict,
)

__all__ = ["CheckpointError", "export_adamw_state_dict", "load_checkpoint", "saved_formats", "seal_state_dict"]
