"""``benchmarks/step_time.py``: the ratios pool each optimizer against the fused AdamW of its own round
and layout, and ``--layouts`` builds fresh allocations of the same model."""

from __future__ import annotations

import argparse
import time

import pytest
import step_time as S
import torch


def test_each_ratio_is_taken_against_the_reference_of_its_own_round_and_layout() -> None:
    # layout 1 is twice as slow for both, round 1 three times as slow: every ratio is 1.5
    rounds = [
        {("ref", 0): 1.0, ("x", 0): 1.5, ("ref", 1): 2.0, ("x", 1): 3.0},
        {("ref", 0): 3.0, ("x", 0): 4.5, ("ref", 1): 6.0, ("x", 1): 9.0},
    ]
    timing = S.pooled(rounds, "ref")
    assert timing.ratios == {"ref": 1.0, "x": 1.5}
    assert timing.layouts == {"ref": [1.0, 1.0], "x": [1.5, 1.5]}
    assert timing.seconds["x"] == pytest.approx(3.75)  # the median of 1.5, 3.0, 4.5, 9.0


def test_the_layouts_give_their_own_medians() -> None:
    rounds = [{("ref", 0): 1.0, ("x", 0): 1.2, ("ref", 1): 1.0, ("x", 1): 1.4} for _ in range(3)]
    rounds.append({("ref", 0): 1.0, ("x", 0): 1.3, ("ref", 1): 1.0, ("x", 1): 1.3})
    timing = S.pooled(rounds, "ref")
    assert timing.layouts["x"] == pytest.approx([1.2, 1.4])
    assert timing.ratios["x"] == pytest.approx(1.3)  # the median of 1.2 x 3, 1.3 x 2, 1.4 x 3
    text = S.layout_spread({1: timing}, ["x"])
    assert "1 thread: x 1.20-1.40x." in text


def test_each_layout_is_a_fresh_allocation_of_the_same_model() -> None:
    args = argparse.Namespace(layers=2, width=32, bf16_weights=False, momentum=True, shapes="square")
    (a, opts_a), (b, opts_b) = S.build_layout(args), S.build_layout(args)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb) and torch.equal(pa.grad, pb.grad)
        assert pa.data_ptr() != pb.data_ptr()
    assert opts_a.keys() == opts_b.keys()
    for label in opts_a:
        assert opts_a[label][0] is not opts_b[label][0]


def test_the_shape_sets_are_the_models_they_name() -> None:
    """GPT-2 small's 148 tensors and 124.4M parameters; 20.4M in 33 ragged tensors (an embedding larger than the
    cache, odd sizes, 1-D ones down to one element); 1,000 tensors of 4,096."""
    import math

    sets = {name: S.shape_set(name) for name in ("gpt2-small", "ragged", "many")}
    counts = {name: (len(shapes), sum(math.prod(s) for _, s in shapes)) for name, shapes in sets.items()}
    assert counts == {"gpt2-small": (148, 124_439_808), "ragged": (33, 20_428_398), "many": (1000, 4_096_000)}
    assert (50257, 768) in [s for _, s in sets["gpt2-small"]] and (1,) in [s for _, s in sets["ragged"]]
    model = S.Tensors([("a.b", (3, 5)), ("c", (7,))])
    assert [tuple(p.shape) for p in model.parameters()] == [(3, 5), (7,)]
    with pytest.raises(SystemExit, match="unknown set"):
        S.shape_set("huge")


class _Sleeper:
    def __init__(self, seconds: float) -> None:
        self.seconds, self.steps = seconds, 0

    def step(self) -> None:
        self.steps += 1
        time.sleep(self.seconds)


def test_a_label_missing_from_one_layout_is_timed_in_the_others_against_their_own_reference() -> None:
    ref = [_Sleeper(0.002), _Sleeper(0.002)]
    peer = _Sleeper(0.004)
    timing = S.interleaved({"ref": ref, "peer": [None, peer]}, rounds=2, steps=1, reference="ref")
    assert [o.steps for o in ref] == [2, 2] and peer.steps == 2
    assert len(timing.layouts["peer"]) == 1 and len(timing.layouts["ref"]) == 2
    assert 1.3 < timing.ratios["peer"] < 4.0
