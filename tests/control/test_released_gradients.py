"""The observation of released gradients (``lightning_baoc.control.released_gradients``), alone: under
gradient release the instruments store what ``Instrumentation.observe`` stores without it."""

from __future__ import annotations


import torch
from support import one_thread  # noqa: F401  (one intra-op thread: bit-equal reductions)
from support_control import backward, instrumented
from torch import nn

from lightning_baoc import BlockwiseAdamW
from lightning_baoc.control.instrumentation import Instrumentation
from lightning_baoc.control.released_gradients import ReleasedGradientObserver

STEPS = 7


def _setup() -> tuple[nn.Module, BlockwiseAdamW, Instrumentation]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    model[2].bias.requires_grad_(False)  # held, no gradient: observed when the step closes
    opt = BlockwiseAdamW(model.parameters(), lr=1e-3)
    return model, opt, instrumented(model, opt, sample_every=2)


def test_released_gradients_are_observed_as_observe_would_store_them() -> None:
    plain_model, plain_opt, plain = _setup()
    model, opt, inst = _setup()
    observer = ReleasedGradientObserver(inst)
    observer.watch(opt)
    opt.release_gradients()
    for step in range(STEPS):
        plain_opt.zero_grad()
        backward(plain_model, step)
        plain.observe(plain_opt, step)
        plain_opt.step()
        observer.open(step)
        assert observer.is_open
        backward(model, step)  # each parameter is observed, then steps, in its hook
        assert observer.open_step is not None and observer.open_step.observed == {"0", "1", "2"}
        observer.close()
        assert not observer.is_open
        opt.step()
    assert inst.ring_samples == plain.ring_samples == 4
    assert inst.statistics() == plain.statistics()
    for name, entry in plain.shadow.entries.items():  # type: ignore[union-attr]
        other = inst.shadow.entries[name]  # type: ignore[union-attr]
        assert entry.steps == other.steps
        assert torch.equal(entry.exp_avg, other.exp_avg) and torch.equal(entry.exp_avg_sq, other.exp_avg_sq)
    for p, q in zip(plain_model.parameters(), model.parameters()):
        assert torch.equal(p, q)
    plain.close()
    inst.close()


def test_a_step_without_backward_drops_its_sample_and_a_close_without_open_takes_none() -> None:
    model, opt, inst = _setup()
    observer = ReleasedGradientObserver(inst)
    observer.watch(opt)
    opt.release_gradients()
    assert not observer.close()
    observer.open(0)  # no backward follows
    observer.open(0)
    backward(model, 0)
    assert observer.close() and inst.ring_samples == 1
    opt.step()
    observer.open(1)  # a follower of a sampling step: sampled, not counted
    backward(model, 1)
    opt.step()
    assert observer.close() and inst.ring_samples == 1
    inst.close()


def test_watching_another_optimizer_ends_the_first_ones_observation() -> None:
    model, opt, inst = _setup()
    observer = ReleasedGradientObserver(inst)
    observer.watch(opt)
    opt.release_gradients()
    observer.open(0)
    backward(model, 0)
    assert observer.open_step is not None and observer.open_step.observed == {"0", "1", "2"}
    observer.close()
    opt.step()
    other = BlockwiseAdamW(model.parameters(), lr=1e-3)
    observer.watch(other)  # the first optimizer's gradients no longer reach the observer
    assert not observer.is_open
    observer.open(2)
    backward(model, 2)  # released by the first optimizer: unseen
    assert observer.open_step is not None and observer.open_step.observed == set()
    assert observer.close()  # what was not seen in the hook is observed now: the sample is whole
    inst.close()
