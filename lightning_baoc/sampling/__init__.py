"""GradientSampler: per-block gradient samples, handed off the hot path, reduced in the background.

Every ``sample_every`` steps (and, when that is more than 1, on the step right after, for the
lag-1 cosine), :meth:`GradientSampler.sample` takes from each block

- a fixed random subsample of at most ``max_elements`` gradient elements (indices drawn once per
  block from a ``torch.Generator`` seeded with ``seed``, so the cost and the memory do not grow
  with the model), and
- the norms of the rows (first dimension) of each of the block's matrices, at most ``max_rows``
  rows per tensor (for taller ones every ``s``-th row from a random offset: a strided view, so no
  copy, that still spans the whole tensor, e.g. the q, k and v parts of a fused projection),

with gathers into one preallocated staging buffer and, for gradients on an accelerator, one
non-blocking copy into pinned host memory. A background thread takes the staging buffer from a
queue, checks it for non-finite values, reduces the row norms to one coefficient of variation per
block and the pair of consecutive steps to one cosine per block, and writes the sample into a ring
buffer holding the last ``capacity`` sampling steps.
:meth:`GradientSampler.statistics` reduces the ring buffer with the pure functions of
:mod:`lightning_baoc.sampling.statistics`.

Where to call it: once per optimizer step, where the gradients are final. In Lightning that is
``on_before_optimizer_step``: gradients there are accumulated over the whole accumulation window,
all-reduced under DDP (so every rank samples the same synchronized gradient and computes the same
statistics; rank 0 can decide alone), unscaled under fp16 AMP, and not yet clipped. In
``on_after_backward`` they are per micro-batch and carry the loss scale: if you sample there,
sample once per window and pass ``grad_scale`` (the statistics are invariant to a scale that is
constant over the ring buffer, not to one that changes inside it).

The package, module by module:

- :mod:`~lightning_baoc.sampling.sampler`: :class:`GradientSampler` (hot path, ring buffer,
  statistics, state dict, the worker thread's loop), :class:`BlockHistory` and the defaults;
- :mod:`~lightning_baoc.sampling.layout`: :func:`draw_indices`, the blocks' segments and their
  places in the staging buffer, the argument checks;
- :mod:`~lightning_baoc.sampling.gather`: the hot path's gathers into the staging buffer;
- :mod:`~lightning_baoc.sampling.state`: the sampler's checkpoint (``state_dict``, ``load_state_dict``);
- :mod:`~lightning_baoc.sampling.reduce`: the worker thread's reductions (validity, cosines,
  anisotropy).
"""

from __future__ import annotations

from lightning_baoc.sampling.layout import draw_indices
from lightning_baoc.sampling.sampler import (
    DEFAULT_CAPACITY,
    DEFAULT_MAX_ELEMENTS,
    DEFAULT_MAX_ROWS,
    DEFAULT_SAMPLE_EVERY,
    STAGING_SLOTS,
    STATE_VERSION,
    BlockHistory,
    GradientSampler,
)

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_MAX_ELEMENTS",
    "DEFAULT_MAX_ROWS",
    "DEFAULT_SAMPLE_EVERY",
    "STAGING_SLOTS",
    "STATE_VERSION",
    "BlockHistory",
    "GradientSampler",
    "draw_indices",
]
