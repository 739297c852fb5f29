"""The old path of the gradient sampler, kept so that existing imports work.

The sampler now lives in the package :mod:`lightning_baoc.sampling` (see its docstring for how it
samples and where to call it); this module gives every name it gave before the split, public and
private, from where each now lives.

Example:
    >>> from lightning_baoc.sampler import GradientSampler, draw_indices
    >>> from lightning_baoc.sampling import GradientSampler as Sampler
    >>> GradientSampler is Sampler
    True
"""

from __future__ import annotations

import torch  # noqa: F401  (a global of the old module; the examples of ``__test__`` use it)

# ``x as x``: re-exported names (the old module's globals), not used here.
from . import statistics as S  # noqa: F401
from .blocks import partition as partition
from .sampling.gather import _FP32_MAX as _FP32_MAX
from .sampling.gather import _gather as _gather
from .sampling.gather import _merge as _merge
from .sampling.layout import _Block as _Block
from .sampling.layout import _check_blocks as _check_blocks
from .sampling.layout import _check_int as _check_int
from .sampling.layout import _Segment as _Segment
from .sampling.layout import draw_indices
from .sampling.reduce import _worker_loop as _worker_loop
from .sampling.sampler import DEFAULT_CAPACITY as DEFAULT_CAPACITY
from .sampling.sampler import DEFAULT_MAX_ELEMENTS as DEFAULT_MAX_ELEMENTS
from .sampling.sampler import DEFAULT_MAX_ROWS as DEFAULT_MAX_ROWS
from .sampling.sampler import DEFAULT_SAMPLE_EVERY as DEFAULT_SAMPLE_EVERY
from .sampling.sampler import STAGING_SLOTS as STAGING_SLOTS
from .sampling.sampler import STATE_VERSION as STATE_VERSION
from .sampling.sampler import BlockHistory as BlockHistory
from .sampling.sampler import GradientSampler

# ``doctest.testmod`` of this module runs the examples of the names it re-exports, as before.
__test__ = {"GradientSampler": GradientSampler, "draw_indices": draw_indices}
