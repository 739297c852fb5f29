"""The placements part alone (``lightning_baoc/optim/placement.py``), and the optimizer asking it.

- By default a tensor is read off itself: its own shape, offset 0, no shared edges or rows.
- Given placements (DeepSpeed's fragments: views made by the caller) decide a view's format on the whole
  parameter's shape, place its record, order its conversions, and travel with a copy.
- The optimizer is one class whichever placements it holds: no class is made for fragments.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_baoc import BlockwiseAdamW, BlockwiseSGD
from lightning_baoc.optim.placement import FragmentPlacements, Placement, Placements


def _fragment(numel: int = 100, offset: int = 0) -> nn.Parameter:
    """A view of ``numel`` elements into a flat tensor, as DeepSpeed's client makes one."""
    flat = torch.randn(offset + numel, generator=torch.Generator().manual_seed(0))
    return nn.Parameter(flat[offset:])


def test_a_tensor_is_read_off_itself_by_default() -> None:
    w = nn.Parameter(torch.zeros(3, 4))
    placements = Placements()
    assert placements.of(w) == Placement((3, 4))
    assert placements.decided_shape(w) == (3, 4) and placements.ordering_shape(w) == (3, 4)


def test_given_placements_decide_the_format_on_the_whole_parameter() -> None:
    view = _fragment()
    opt = BlockwiseAdamW([("w", view)], state_format="int8", placements=FragmentPlacements({view: Placement((64, 64))}))
    plain = BlockwiseAdamW([("w", nn.Parameter(view.detach().clone()))], state_format="int8")
    # 100 elements stay out of the 8-bit formats (min_8bit_numel 4096); the whole 64 x 64 parameter does not
    assert opt.target_format(view) == "int8" and plain.target_format(plain.named_params["w"]) == "fp32"
    assert opt._pools.placements.ordering_shape(view) == (64, 64)  # noqa: SLF001 - conversions ordered by the whole
    view.grad = torch.ones_like(view)
    opt.step()
    assert opt.formats() == {"w": "int8"} and opt.state_bytes() > 0
    assert type(opt) is BlockwiseAdamW  # one class, whatever its placements


def test_given_placements_place_the_records() -> None:
    view = _fragment(offset=1024)
    opt = BlockwiseAdamW([("w", view)], placements=FragmentPlacements({view: Placement((4, 281), shard_offset=1024)}))
    assert opt._records[view].shard_offset == 1024  # noqa: SLF001 - the record placed as given
    assert opt._records[view].frame is None and opt._records[view].row_shards is None  # noqa: SLF001


def test_placements_travel_with_a_copy() -> None:
    view = _fragment()
    opt = BlockwiseSGD([("w", view)], lr=0.1, momentum=0.9, state_format="int8",
                       placements=FragmentPlacements({view: Placement((64, 64))}))
    copied = copy.deepcopy(opt)
    (twin,) = copied.named_params.values()
    assert twin is not view and copied.target_format(twin) == "int8"
    assert copied._pools.placements is copied._placements  # noqa: SLF001 - the parts rebuilt over the copy's


def test_placements_of_another_type_are_refused_by_name() -> None:
    with pytest.raises(TypeError, match="placements"):
        BlockwiseAdamW([nn.Parameter(torch.zeros(4))], placements={"w": (64, 64)})  # type: ignore[arg-type]
