"""The checkpoint codec alone (``lightning_baoc/optim/checkpoint/codec.py``: :class:`CheckpointCodec`), over records,
names, pools and a step made here, with param groups as plain dicts and the validation given as a function.

- Its state dict names every entry and group member by parameter name, counts and requests included, and
  loads back through a validation that hands it a :class:`LoadPlan`: formats, views and counts as saved,
  the bytes recounted.
- A refused load (the validation raises) leaves the records, names and pools as they were, parameters
  adopted from the dict's names taken back out.
- A copy's state holds compact copies and no views; restored over the copied records it rebuilds the
  pools, keeping the peak and the names warned.
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import pytest
import torch
from torch import Tensor, nn

from lightning_baoc.formats import FORMATS, StepHyper
from lightning_baoc.optim.checkpoint import CheckpointError
from lightning_baoc.optim.checkpoint.codec import CheckpointCodec
from lightning_baoc.optim.checkpoint.validate import LoadedState, LoadPlan
from lightning_baoc.optim.pools import Record, StatePools
from lightning_baoc.optim.stepping import StepDispatcher, StepSettings


def _hyper_of(group: Mapping[str, Any], noise_key: int = 0) -> StepHyper:
    return StepHyper(lr=group["lr"], beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, noise_key=noise_key,
                     kernels="eager")


def _codec(params: list[nn.Parameter], formats: list[str]) -> tuple[CheckpointCodec, dict[str, Tensor], list[dict]]:
    records = {p: Record(name=f"w{i}", group=0) for i, p in enumerate(params)}
    names = {rec.name: p for p, rec in records.items()}
    groups = [{"params": list(params), "lr": 1e-3, "state_format": "fp32"}]
    stepper = StepDispatcher(records, FORMATS, StepSettings(0, True, "eager", "TestOptimizer"))
    pools = StatePools(records, FORMATS, stepper.forget_plans)
    pools.rebuild(dict(zip(params, formats)), lambda p: _hyper_of(groups[0]))
    codec = CheckpointCodec(records, names, pools, stepper, FORMATS, "adamw", "TestOptimizer", 0)
    return codec, names, groups



def _params() -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(shape, generator=gen)) for shape in [(40, 64), (9,)]]


def _fill(codec: CheckpointCodec) -> None:
    gen = torch.Generator().manual_seed(1)
    for rec in codec.records.values():
        for t in rec.views.values():
            t.copy_(torch.randint(0, 100, t.shape, generator=gen).to(t.dtype))
        rec.step, rec.m_step = 5, 3
    next(iter(codec.records.values())).requested = "int8"


def _plan_of(codec: CheckpointCodec) -> Any:
    """A validation that takes the dict as it is (the codec's own), by name."""
    def validate(sd: Mapping[str, Any]) -> LoadPlan:
        if sd["baoc"].get("refuse"):
            raise CheckpointError("refused")
        entries = {codec.names[name]: LoadedState(e["format"], dict(e["tensors"]), e["steps"], e["m_step"])
                   for name, e in sd["state"].items()}
        return LoadPlan(groups=[{"lr": g["lr"]} for g in sd["param_groups"]], entries=entries,
                        requested={p: sd["baoc"]["requested"].get(name) for name, p in codec.names.items()},
                        nonfinite={})
    return validate


def test_a_state_dict_names_everything_and_loads_back() -> None:
    params = _params()
    codec, names, groups = _codec(params, ["int8", "fp32"])
    _fill(codec)
    sd = codec.state_dict(groups)
    assert set(sd["state"]) == {"w0", "w1"} and sd["param_groups"][0]["params"] == ["w0", "w1"]
    assert sd["state"]["w0"]["format"] == "int8" and sd["state"]["w0"]["steps"] == 5
    assert sd["baoc"]["requested"] == {"w0": "int8"}
    saved = {rec.name: {k: t.clone() for k, t in rec.views.items()} for rec in codec.records.values()}

    other, _, other_groups = _codec(params, ["fp32", "bf16"])  # other formats, fresh states
    other_groups[0]["lr"] = 0.5
    other.load(sd, other_groups, _plan_of(other), _hyper_of)
    assert other_groups[0]["lr"] == 1e-3  # the saved hyperparameters
    for p, rec in other.records.items():
        assert rec.format == codec.records[p].format and (rec.step, rec.m_step) == (5, 3)
        assert all(torch.equal(t, saved[rec.name][k]) for k, t in rec.views.items())
    assert other.pools.live_bytes == codec.pools.live_bytes == sum(other.pools.held_bytes(host=False).values())


def test_a_refused_load_leaves_everything_as_it_was() -> None:
    params = _params()
    codec, names, groups = _codec(params, ["int8", "fp32"])
    _fill(codec)
    sd = codec.state_dict(groups)
    extra = nn.Parameter(torch.zeros(3))
    sd["param_groups"][0]["params"].append("w2")
    groups[0]["params"].append(extra)  # put into the group directly: adopted under the saved name...
    sd["baoc"]["refuse"] = True
    before = {p: (rec.format, rec.views, rec.step) for p, rec in codec.records.items()}
    pools = codec.pools.pools
    with pytest.raises(CheckpointError, match="refused"):
        codec.load(sd, groups, _plan_of(codec), _hyper_of)
    assert {p: (rec.format, rec.views, rec.step) for p, rec in codec.records.items()} == before
    assert extra not in codec.records and "w2" not in names  # ... and taken back out
    assert codec.pools.pools is pools


def test_a_copys_state_holds_compact_copies_and_restores_the_pools() -> None:
    params = _params()
    codec, names, groups = _codec(params, ["int8", "bf16"])
    _fill(codec)
    codec.stepper.warned.add("w1")
    peak = codec.pools.peak_bytes
    state = copy.deepcopy(codec.copy_state({"_records": codec.records, "_names": names, "step": "runtime only"}))
    assert "step" not in state  # tied to this process
    copied = CheckpointCodec.take_copied(state)
    records = state["_records"]
    assert all(rec.views is None for rec in records.values())
    new_params = list(records)
    stepper = StepDispatcher(records, FORMATS, StepSettings(0, True, "eager", "TestOptimizer"))
    pools = StatePools(records, FORMATS, stepper.forget_plans)
    twin = CheckpointCodec(records, state["_names"], pools, stepper, FORMATS, "adamw", "TestOptimizer", 0)
    twin.restore(copied)
    assert twin.pools.peak_bytes == peak and twin.pools.live_bytes == codec.pools.live_bytes
    assert stepper.warned == {"w1"}
    for p, q in zip(params, new_params):
        a, b = codec.records[p], records[q]
        assert (a.format, a.step, a.m_step) == (b.format, b.step, b.m_step)
        assert all(torch.equal(t, b.views[k]) and t.data_ptr() != b.views[k].data_ptr() for k, t in a.views.items())


def test_only_an_adamw_codec_exports_adamw_state() -> None:
    params = _params()
    codec, _, groups = _codec(params, ["int8", "fp32"])
    assert set(codec.to_adamw_state_dict(groups)["state"][0]) >= {"exp_avg", "exp_avg_sq"}
    codec.rule = "lion"
    with pytest.raises(TypeError, match="TestOptimizer holds a lion momentum"):
        codec.to_adamw_state_dict(groups)
