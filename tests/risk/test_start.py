"""The risk the start allocation minimizes (``lightning_baoc.risk.start``): the prior, a mapping's
preference, a record's measured risks, and the messages that name who was given ``initial``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lightning_baoc.risk import prior_risk
from lightning_baoc.risk.start import INITIAL_PREFERENCE, start_risk

SHAPES = {"a": [(64, 64)], "b": [(64, 64), (64,)]}
KINDS = {"a": "other", "b": "attention"}
OFFERED = ["fp32", "int8", "bf16"]


def test_without_initial_the_prior() -> None:
    assert start_risk(SHAPES, KINDS, OFFERED) == prior_risk(SHAPES, KINDS, OFFERED)


def test_a_mapping_prefers_its_formats_and_a_record_replaces_the_prior(tmp_path: Path) -> None:
    prior = prior_risk(SHAPES, KINDS, OFFERED)
    risk = start_risk(SHAPES, KINDS, OFFERED, initial={"a": "int8"})
    assert risk["a"] == {"fp32": INITIAL_PREFERENCE, "int8": 0.0, "bf16": prior["a"]["bf16"] + INITIAL_PREFERENCE}
    assert risk["b"] == prior["b"]
    path = tmp_path / "baoc_allocation.json"
    path.write_text(json.dumps({"blocks": [{"name": "b", "risk": {"fp32": 0.0, "int8": 0.3, "nomomentum": 0.1}}]}))
    risk = start_risk(SHAPES, KINDS, OFFERED, initial=path)
    assert risk["a"] == prior["a"]
    assert risk["b"] == {"fp32": 0.0, "int8": 0.3, "bf16": prior["b"]["bf16"] + INITIAL_PREFERENCE}


def test_errors_name_who_was_given_initial(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"BAOC\(initial=\.\.\.\): \['c'\] are not blocks of this model"):
        start_risk(SHAPES, KINDS, OFFERED, initial={"c": "int8"})
    with pytest.raises(ValueError, match=r"plan\(initial=\.\.\.\): block 'a' asks for 'offload', a format not offered"):
        start_risk(SHAPES, KINDS, OFFERED, initial={"a": "offload"}, owner="plan")
    path = tmp_path / "x.json"
    path.write_text("[]")
    with pytest.raises(ValueError, match=r"not a baoc_allocation.json \(no 'blocks' list\)"):
        start_risk(SHAPES, KINDS, OFFERED, initial=path)
    with pytest.raises(ValueError, match="cannot read the allocation record"):
        start_risk(SHAPES, KINDS, OFFERED, initial=tmp_path / "missing.json")


