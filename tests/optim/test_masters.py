"""The master-weight part alone (``lightning_baoc/optim/masters.py``: :class:`MasterWeights`), over a records
table and param groups made here.

- A request is validated whole before anything changes (an unknown kind; a correction for an fp32
  parameter, its own master), then held corrections convert at once: ``none -> ecc16`` starts from zero,
  ``ecc16 -> ecc8`` requantizes the master, ``-> none`` drops it; ``on_replace`` is called
  before each correction tensor is replaced.
- A group's ``weight_correction`` is its parameters' default; ``master_weights`` and ``nbytes`` read what
  is held.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_baoc.formats.correction import reconstruct, split
from lightning_baoc.optim.masters import MasterWeights
from lightning_baoc.optim.pools import Record


def _table() -> tuple[nn.Parameter, nn.Parameter, dict[torch.Tensor, Record], list[dict]]:
    gen = torch.Generator().manual_seed(0)
    w16 = nn.Parameter(torch.randn(24, 40, generator=gen).to(torch.bfloat16))
    w32 = nn.Parameter(torch.randn(24, generator=gen))
    records = {w16: Record(name="w16", group=0), w32: Record(name="w32", group=1)}
    groups = [{"params": [w16]}, {"params": [w32], "weight_correction": "none"}]
    return w16, w32, records, groups


def test_a_request_is_validated_before_anything_changes() -> None:
    w16, w32, records, groups = _table()
    masters = MasterWeights(records)
    with pytest.raises(ValueError, match="'w32' is torch.float32: it is its own master weight"):
        masters.request({"w16": "ecc8", "w32": "ecc8"}, {"w16": [w16], "w32": [w32]}, groups)
    with pytest.raises(ValueError, match="ecc12"):
        masters.request({"w16": "ecc12"}, {"w16": [w16]}, groups)
    assert all(rec.correction_requested is None and rec.master_correction is None for rec in records.values())
    assert masters.request({"w32": "none"}, {"w32": [w32]}, groups) == {}  # fp32: "none" is what it holds


def test_corrections_convert_at_once_and_keep_the_master() -> None:
    w16, _, records, groups = _table()
    replaced: list[int] = []
    masters = MasterWeights(records, lambda: replaced.append(1))
    assert masters.request({"w16": "ecc16"}, {"w16": [w16]}, groups) == {"w16": ("none", "ecc16")}
    held = records[w16].master_correction
    assert held is not None and held.dtype == torch.int16 and int(held.count_nonzero()) == 0
    # a master between the bf16 weights, held by the weight and its ecc16 correction
    master = w16.detach().float() + torch.rand(w16.shape, generator=torch.Generator().manual_seed(1)) * 1e-3
    weight, correction = split(master, torch.bfloat16, "ecc16")
    with torch.no_grad():
        w16.copy_(weight)
    held.copy_(correction)
    assert masters.request({"w16": "ecc8"}, {"w16": [w16]}, groups) == {"w16": ("ecc16", "ecc8")}
    assert records[w16].master_correction.dtype == torch.int8 and len(replaced) == 2
    # requantized: the master the weight and its ecc16 correction held, split again with ecc8
    assert torch.equal(masters.master_weights()["w16"], reconstruct(*split(reconstruct(weight, correction), torch.bfloat16, "ecc8")))
    assert masters.held() == {"w16": "ecc8"} and masters.nbytes() == w16.numel() == masters.nbytes("cpu")
    assert masters.request({"w16": "none"}, {"w16": [w16]}, groups) == {"w16": ("ecc8", "none")}
    assert records[w16].master_correction is None and masters.held() == {} and masters.nbytes() == 0


def test_the_groups_default_applies_until_a_request() -> None:
    w16, w32, records, groups = _table()
    masters = MasterWeights(records)
    assert masters.sync(groups) == {}  # nothing asked, nothing held
    groups[0]["weight_correction"] = "ecc8"
    assert masters.target(w16, groups) == "ecc8" and masters.target(w32, groups) == "none"
    assert masters.sync(groups, only=[w32]) == {}  # only the parameters named
    assert masters.sync(groups) == {"w16": ("none", "ecc8")}
    records[w16].master_correction.fill_(3)
    assert torch.equal(masters.master_weights()["w16"], reconstruct(w16.detach(), records[w16].master_correction))
    assert torch.equal(masters.master_weights()["w32"], w32.detach())
