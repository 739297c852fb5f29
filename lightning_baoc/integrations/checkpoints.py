"""The metadata of a distributed checkpoint (``torch.distributed.checkpoint``), read before its load.

Lightning's ``ModelParallelStrategy`` and Fabric's load a sharded optimizer state into a template of
the optimizer's current formats and restore the rest (BAOC's state among it) afterwards; the callback
and ``BAOCStrategy`` therefore read BAOC's state from the checkpoint's ``meta.pt`` first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


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


__all__ = ["distributed_metadata"]
