"""The metadata of a distributed checkpoint (``torch.distributed.checkpoint``), read before its load.

Lightning's ``ModelParallelStrategy`` and Fabric's load a sharded optimizer state into a template of
the optimizer's current formats and restore the rest (BAOC's state among it) afterwards; the callback
and ``BAOCStrategy`` therefore read BAOC's state from the checkpoint's ``meta.pt`` first, and check
that the sharded states were saved by as many shards as this run holds (:func:`check_saved_shards`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_baoc.optim import BlockwiseOptimizer, CheckpointError
from lightning_baoc.optim.checkpoint.distributed import REFUSAL_KEYS
from lightning_baoc.optim.sharding import is_sharded, shard_count


def distributed_metadata(path: Any, who: str) -> dict[str, Any]:
    """The metadata ``meta.pt`` of the distributed checkpoint directory ``path`` (everything but the
    model and the optimizers); ``who`` names the caller in the error for another kind of checkpoint."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    meta = Path(path) / _METADATA_FILENAME
    if not meta.is_file():
        raise RuntimeError(
            f"{who} cannot resume from {str(path)!r}: it is not a distributed checkpoint directory (no "
            f"{_METADATA_FILENAME}); resume from one saved with save_distributed_checkpoint=True"
        )
    return torch.load(meta, map_location="cpu", weights_only=False)


def check_saved_shards(path: Any, optimizers: Any, who: str) -> None:
    """Refuse, before ``torch.distributed.checkpoint`` reads a tensor, a checkpoint whose sharded optimizer
    states were saved by another number of shards than ``optimizers`` hold now (another world size).

    DCP itself fails inside its loader (``Size mismatch between saved torch.Size([2, 128]) and current ...``,
    raised as a ``CheckpointException``, which ``except Exception`` does not catch), naming neither BAOC nor
    the fix. A sharded state's per-rank checksum is saved as a ``(shards, 1)`` DTensor: its first size is
    the saving run's shard count (:mod:`lightning_baoc.optim.checkpoint.distributed`). Also lays the optimizers' dicts out
    as the checkpoint's (with or without the keys that make a plain AdamW refuse them: ``to_distributed``)."""
    import torch.distributed.checkpoint as dcp

    blockwise = [opt for opt in optimizers if isinstance(opt, BlockwiseOptimizer)]
    now = {shard_count(p) for opt in blockwise for g in opt.param_groups for p in g["params"] if is_sharded(p)}
    if not now:
        return
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    # the template DCP fills holds the plain AdamW keys that make a plain AdamW refuse the dict where the saved
    # states hold them (an earlier release saved none: a template with them would miss keys)
    saved_entries = [k[: -len(".format")] for k in metadata if ".state." in k and k.endswith(".format")]
    if saved_entries:
        refusal_keys = any(f"{k}.{REFUSAL_KEYS[0]}" in metadata for k in saved_entries)
        for opt in blockwise:
            opt._codec.refusal_keys = refusal_keys  # noqa: SLF001 - the layout of the optimizer's own dict
    saved = {int(m.size[0]) for k, m in metadata.items()
             if ".state." in k and k.endswith(".checksum") and len(getattr(m, "size", ())) == 2}
    if saved and saved != now:
        raise CheckpointError(
            f"{who} cannot resume {str(path)!r}: its sharded optimizer states were saved by "
            f"{'/'.join(map(str, sorted(saved)))} shards, and this run shards them {'/'.join(map(str, sorted(now)))} "
            f"ways (another world size). A sharded optimizer state resumes on the world size that saved it; for "
            f"another, save optimizer.to_adamw_state_dict() (on every rank of the saving run) and load that, "
            f"which loads into any world size."
        )


__all__ = ["check_saved_shards", "distributed_metadata"]
