"""The controller's instruments (``lightning_baoc.control.instrumentation.Instrumentation``), alone: the
sampling schedule, the count of fresh samples, the shadow moments' betas and restarts."""

from __future__ import annotations


import torch
from support_control import backward, instrumented
from torch import nn

from lightning_baoc import BlockwiseAdamW, BlockwiseSGD


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def test_sampling_is_sparser_after_the_first_allocation() -> None:
    model = _model()
    inst = instrumented(model, BlockwiseAdamW(model.parameters()), sample_every=2, sparse_sampling=3)
    assert all(inst.sampling_step(s, allocated=False) for s in range(12))
    # after it: every third sampling step (step // every % 3 == 0) and its follower
    assert [s for s in range(12) if inst.sampling_step(s, allocated=True)] == [0, 1, 6, 7]
    inst.close()


def test_only_a_sampling_steps_sample_counts_as_fresh() -> None:
    model = _model()
    inst = instrumented(model, BlockwiseAdamW(model.parameters()), sample_every=4)
    assert inst.count(0, True) and inst.ring_samples == 1
    assert inst.count(1, True) and inst.ring_samples == 1  # a sampling step's follower: not counted
    assert not inst.count(4, False) and inst.ring_samples == 1  # nothing taken
    inst.count(8, True)
    assert inst.ring_samples == 2
    inst.close()


def test_observe_feeds_both_instruments_and_a_restart_empties_the_ring() -> None:
    model = _model()
    opt = BlockwiseAdamW(model.parameters(), lr=1e-3)
    inst = instrumented(model, opt, sample_every=2)
    taken = []
    for step in range(6):
        opt.zero_grad()
        backward(model, step)
        taken.append(inst.observe(opt, step))
        opt.step()
    assert inst.ring_samples == 3 and any(taken)
    assert inst.shadow is not None and all(entry.steps == 6 for entry in inst.shadow.entries.values())
    stats = inst.statistics()
    assert set(stats) == {"0", "2"} and all(isinstance(v, float) for row in stats.values() for v in row.values())
    held = inst.nbytes()
    assert held == inst.sampler.buffer_bytes() + inst.shadow.nbytes() > 0  # type: ignore[union-attr]
    inst.restart_statistics()
    assert inst.ring_samples == 0
    inst.close()


def test_betas_per_group_cached_until_a_group_changes() -> None:
    model = _model()
    opt = BlockwiseAdamW([{"params": model[0].parameters(), "betas": (0.8, 0.99)}, {"params": model[2].parameters()}])
    inst = instrumented(model, opt)
    betas = inst.betas(opt)
    assert betas == {"0": (0.8, 0.99), "1": (0.8, 0.99), "2": (0.9, 0.999), "3": (0.9, 0.999)}
    assert inst.betas(opt) is betas  # cached
    opt.param_groups[1]["betas"] = (0.5, 0.9)
    assert inst.betas(opt)["2"] == (0.5, 0.9)
    sgd_model = _model()
    sgd = BlockwiseSGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    assert instrumented(sgd_model, sgd).betas(sgd)["0"][1] == 0.999  # SGD's buffer: its own average and 0.999
    inst.close()


def test_a_restarted_shadow_keeps_the_moments_of_the_tensors_it_shadowed() -> None:
    model = _model()
    opt = BlockwiseAdamW(model.parameters(), lr=1e-3)
    inst = instrumented(model, opt, sample_every=1)
    for step in range(3):
        opt.zero_grad()
        backward(model, step)
        inst.observe(opt, step)
        opt.step()
    old = inst.shadow
    inst.restart_shadow(opt)
    assert inst.shadow is not old and inst.shadow is not None and old is not None
    assert inst.shadow.entries.keys() == old.entries.keys()
    for name, entry in old.entries.items():
        new = inst.shadow.entries[name]
        assert new.steps == entry.steps == 3
        assert torch.equal(new.exp_avg, entry.exp_avg) and torch.equal(new.exp_avg_sq, entry.exp_avg_sq)
    inst.close()
