"""The framework-free BAOC lifecycle (``lightning_baoc.control.controller``): install, warm-up, allocation,
hysteresis, budgets, rank-zero decisions and checkpoints, driven by a plain PyTorch loop."""

from __future__ import annotations

import io
import math
import warnings
from typing import Any, Mapping

import pytest
import torch
from support import controller_steps, one_thread  # noqa: F401  (one_thread: one intra-op thread, see there)
from torch import nn

from lightning_baoc import FORMATS, BlockwiseAdamW, BudgetInfeasibleError
from lightning_baoc.control.controller import (
    BAOCConfig,
    BAOCController,
    convert_optimizer,
    decide_on_rank_zero,
    rebind_scheduler,
)

CPU_FORMATS = [f for f in FORMATS if f != "offload"]  # offload is masked on the CPU


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() <= 1]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=2e-3)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 64, generator=g)
    return x, (x[:, :10] * 3).argmax(dim=1)


def _train(ctl: BAOCController, model: nn.Module, opt: torch.optim.Optimizer, start: int, steps: int) -> list[Any]:
    """Steps ``start .. start + steps - 1``: observe before each step, maybe allocate after."""
    def loss(step: int) -> torch.Tensor:
        x, y = _batch(step)
        return nn.functional.cross_entropy(model(x), y)

    return controller_steps(ctl, opt, loss, start, steps)


class TableRisk:
    """A risk model returning a fixed table (block -> format -> risk); counts its calls."""

    def __init__(self, table: Mapping[str, Mapping[str, float]]) -> None:
        self.table = {b: dict(r) for b, r in table.items()}
        self.calls = 0

    def __call__(self, optimizer: Any, blocks: Any, statistics: Any, formats: Any = None, horizon: int = 200) -> Any:
        self.calls += 1
        assert statistics is not None and set(statistics) == set(blocks)
        return {b: {f: self.table[b][f] for f in formats} for b in blocks}


def _prior_table(blocks: Mapping[str, Any], scale: Mapping[str, float] | None = None) -> dict[str, dict[str, float]]:
    """Risk growing with cheapness, the same for every block unless ``scale`` says otherwise."""
    order = {f: i for i, f in enumerate(CPU_FORMATS)}
    return {b: {f: order[f] * (scale or {}).get(b, 1.0) * 0.01 for f in CPU_FORMATS} for b in blocks}


# ---------------------------------------------------------------------------- config and install


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"memory_budget": 0}, "memory_budget"),
        ({"memory_budget": 1.5}, "memory_budget"),
        ({"memory_budget": "lots"}, "memory_budget"),
        ({"memory_budget": 0.3, "time_budget": 0.5}, "time_budget"),
        ({"memory_budget": 0.3, "warmup_steps": 5, "sample_every": 10}, "warmup_steps=5"),
        ({"memory_budget": 0.3, "granularity": "row"}, "granularity"),
        ({"memory_budget": 0.3, "formats": ["int4"]}, "int4"),
        ({"memory_budget": 0.3, "mode": "up"}, "mode"),
        ({"memory_budget": 0.3, "patience": 0}, "patience"),
        ({"memory_budget": 0.3, "hysteresis": -0.1}, "hysteresis"),
        ({"memory_budget": 0.3, "reevaluate_every_n_epochs": 0}, "reevaluate_every_n_epochs"),
        ({"memory_budget": 0.3, "calibration": "fast"}, "calibration"),
    ],
)
def test_config_rejects_bad_values_naming_them(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises((ValueError, TypeError), match=match):
        BAOCConfig(**kwargs)


def test_config_turns_omegaconf_containers_into_plain_ones() -> None:
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"blocks": {"head": ["net.6.*"]}, "formats": ["fp32", "int8"]})
    config = BAOCConfig(memory_budget="30%", blocks=cfg.blocks, formats=cfg.formats)
    assert type(config.blocks) is dict and type(config.blocks["head"]) is list
    assert type(config.formats) is list


def test_install_keeps_groups_hyperparameters_and_adamw_behaviour() -> None:
    model, twin = _model(), _model()
    ref = _adamw(twin)
    ctl = BAOCController(memory_budget=1.0, warmup_steps=1000)  # fp32 fits: the start is all fp32
    opt = ctl.install(_adamw(model), model)
    assert set((ctl.start_allocation or {}).values()) == {"fp32"}
    assert isinstance(opt, BlockwiseAdamW) and type(opt).__name__ == "AdamW"
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in opt.param_groups] == [3, 3]
    assert ctl.install(opt, model) is opt  # idempotent
    assert list(ctl.block_params) == ["0", "2", "4"]
    assert ctl.fp32_state_bytes() == 8 * sum(p.numel() for p in model.parameters())
    for step in range(20):
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            x, y = _batch(step)
            nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
    ctl.close()


def test_unsupported_optimizers_are_refused_naming_the_supported_ones() -> None:
    model = _model()
    with pytest.raises(TypeError, match=r"Adagrad.*torch\.optim\.AdamW.*torch\.optim\.Adam.*torch\.optim\.SGD"):
        BAOCController(memory_budget=0.5).install(torch.optim.Adagrad(model.parameters(), lr=0.1), model)
    with pytest.raises(ValueError, match=r"SGD without momentum.*nothing to allocate; set momentum"):
        BAOCController(memory_budget=0.5).install(torch.optim.SGD(model.parameters(), lr=0.1), model)
    with pytest.raises(ValueError, match="amsgrad"):
        convert_optimizer(torch.optim.AdamW(model.parameters(), amsgrad=True), model)
    stranger = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not parameters of the model"):
        BAOCController(memory_budget=0.5).install(torch.optim.AdamW([*model.parameters(), stranger]), model)


def test_rebound_schedulers_drive_the_new_optimizer_without_warnings() -> None:
    model = _model()
    old = _adamw(model)
    lam = torch.optim.lr_scheduler.LambdaLR(old, [lambda s: 1.0 / (1 + s), lambda s: 0.5])
    new = convert_optimizer(old, model)
    rebind_scheduler(lam, new)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            new.step()
            lam.step()
    assert [g["lr"] for g in new.param_groups] == pytest.approx([2e-3 / 4, 2e-3 * 0.5])
    # chained schedulers are rebound through
    old2 = _adamw(_model())
    seq = torch.optim.lr_scheduler.SequentialLR(
        old2,
        [torch.optim.lr_scheduler.LinearLR(old2, 0.1, total_iters=2), torch.optim.lr_scheduler.ExponentialLR(old2, 0.9)],
        milestones=[2],
    )
    new2 = convert_optimizer(old2, _model())
    rebind_scheduler(seq, new2)
    assert seq.optimizer is new2 and all(s.optimizer is new2 for s in seq._schedulers)


# ---------------------------------------------------------------------------- lifecycle


def _largest_state(opt: BlockwiseAdamW) -> int:
    """The most state bytes one parameter can hold (fp32 AdamW: 8 per element)."""
    return max(8 * p.numel() for p in opt.named_params.values())


def test_warmup_then_allocation_within_budget_then_sparse_sampling() -> None:
    model = _model()
    ctl = BAOCController(memory_budget=0.3, warmup_steps=20, sample_every=5)
    opt = ctl.install(_adamw(model), model)
    budget = int(0.3 * ctl.fp32_state_bytes())
    start = dict(ctl.start_allocation or {})
    assert set(start) == set(ctl.block_params) and set(start.values()) - {"fp32"}  # within the budget
    assert _train(ctl, model, opt, 0, 19) == []
    assert ctl.phase == "warmup" and opt.state_bytes() <= budget and opt.peak_state_bytes() <= budget
    warm = opt.state_bytes()
    (event,) = _train(ctl, model, opt, 19, 1)
    assert event.reason == "warmup" and event.step == 20 and ctl.phase == "allocated"
    assert opt.state_bytes() == event.state_bytes <= budget
    assert event.state_bytes_before == warm
    # the conversion's transient: at most one parameter's state above the budget
    assert max(warm, event.state_bytes) <= event.peak_state_bytes <= budget + _largest_state(opt)
    assert event.memory_budget_bytes == budget
    assert sum(event.block_bytes.values()) == event.state_bytes
    assert set(event.changed) == {b for b, f in event.formats.items() if f != start[b]}
    assert event.total_risk == pytest.approx(sum(event.risk[b][f] for b, f in event.formats.items()))
    # after the allocation the sampler starts afresh, 4x sparser: steps 20, 21 (ring row), then 40, 41
    calls = ctl.sampler.timings()["sample_calls"]
    assert ctl.ring_samples == 0
    _train(ctl, model, opt, 20, 25)
    assert ctl.sampler.timings()["sample_calls"] - calls == 4 and ctl.ring_samples == 2
    ctl.close()


def test_infeasible_budget_fails_at_install_naming_the_smallest_feasible() -> None:
    model = _model()
    ctl = BAOCController(memory_budget=0.01, warmup_steps=20, sample_every=5, formats=["fp32", "bf16", "int8"])
    user = _adamw(model)
    with pytest.raises(BudgetInfeasibleError, match="smallest feasible") as info:
        ctl.install(user, model)  # the start allocation cannot meet the budget
    err = info.value
    assert err.min_memory is not None and err.min_memory > 0.01 * ctl.fp32_state_bytes()
    assert "memory_budget=0.01" in str(err) and "No format was converted" in str(err)
    assert not user.state  # the user's optimizer is untouched
    ctl.close()


def test_budget_lowered_during_warmup_caps_the_next_step_or_is_refused() -> None:
    model = _model()
    ctl = BAOCController(memory_budget=0.5, warmup_steps=20, sample_every=5, formats=["fp32", "bf16", "int8"])
    opt = ctl.install(_adamw(model), model)
    _train(ctl, model, opt, 0, 10)
    held = dict(opt.formats())
    with pytest.raises(BudgetInfeasibleError, match="smallest feasible") as info:
        ctl.set_budget(memory_budget=0.05)  # below anything bf16/int8 can reach
    assert info.value.min_memory is not None
    assert opt.formats() == held and ctl.config.memory_budget == 0.5 and ctl.phase == "warmup"
    ctl.set_budget(memory_budget=0.3)  # feasible: the start allocation follows at once
    assert opt.state_bytes() <= 0.3 * ctl.fp32_state_bytes()
    opt.reset_peak_state_bytes()
    (event,) = _train(ctl, model, opt, 10, 10)
    assert event.reason == "warmup" and opt.peak_state_bytes() <= int(0.3 * ctl.fp32_state_bytes()) + _largest_state(opt)
    ctl.close()


def test_time_budget_priced_with_the_prior_step_costs() -> None:
    model = _model()
    ctl = BAOCController(memory_budget=0.6, time_budget=1.0, calibration="prior", warmup_steps=12, sample_every=5)
    opt = ctl.install(_adamw(model), model)
    ctl.check_feasible()
    (event,) = _train(ctl, model, opt, 0, 12)
    assert event.time is not None and event.time_budget is not None and event.time <= event.time_budget
    assert opt.state_bytes() <= 0.6 * ctl.fp32_state_bytes()
    ctl.close()


# ---------------------------------------------------------------------------- re-evaluation


def _allocated(risk: TableRisk, **kwargs: Any) -> tuple[BAOCController, nn.Module, BlockwiseAdamW]:
    model = _model()
    settings = dict(memory_budget=0.3, warmup_steps=12, sample_every=4, sparse_sampling=1, patience=2)
    settings.update(kwargs)
    ctl = BAOCController(BAOCConfig(**settings), risk_fn=risk)
    opt = ctl.install(_adamw(model), model)
    (event,) = _train(ctl, model, opt, 0, 12)
    assert event.reason == "warmup"
    return ctl, model, opt


def test_hysteresis_keeps_an_allocation_that_is_not_clearly_worse() -> None:
    risk = TableRisk(_prior_table(["0", "2", "4"]))
    ctl, model, opt = _allocated(risk)
    first = dict(ctl.allocation)
    # the same risks: a re-evaluation keeps everything (the plateau after `patience` checks)
    assert not ctl.validation_end(1.0) and not ctl.validation_end(1.0)
    assert ctl.validation_end(1.0) and ctl.pending == "plateau"
    (event,) = _train(ctl, model, opt, 12, 8)
    assert event.reason == "plateau" and event.kept and event.changed == {} and event.migrated == {}
    assert ctl.allocation == first
    # an alternative 5% better (< hysteresis 10%) is not worth a migration
    current = sum(risk.table[b][f] for b, f in first.items())
    big = max(first, key=lambda b: ctl.tables.numel[b])
    risk.table[big][first[big]] += 0.05 * current / 0.95
    ctl.pending = "epoch"
    (event,) = _train(ctl, model, opt, 20, 8)
    assert event.kept and ctl.allocation == first
    ctl.close()


def test_reevaluation_migrates_only_changed_blocks_and_inherits_their_state() -> None:
    risk = TableRisk(_prior_table(["0", "2", "4"]))
    ctl, model, opt = _allocated(risk)
    first = dict(ctl.allocation)
    # make the big block's current format far riskier: the solver moves it, the rest stays
    big = max(first, key=lambda b: ctl.tables.numel[b])
    risk.table[big][first[big]] = 10.0
    _train(ctl, model, opt, 12, 5)  # two fresh ring samples (steps 12 and 16)
    snapshot = opt.state_dict()
    grads = {n: p.grad.clone() for n, p in opt.named_params.items()}
    before = {n: opt.param_state(n) for n in opt.named_params}
    ctl.pending = "epoch"
    event = ctl.maybe_allocate(17)
    assert event is not None and not event.kept
    assert set(event.changed) == {b for b in first if ctl.allocation[b] != first[b]} and big in event.changed
    moved = {n for b in event.changed for n in ctl.block_params[b]}
    assert event.migrated and set(event.migrated) <= moved
    # the reference: the same state, converted by BlockwiseAdamW directly
    twin = _model()
    ref = convert_optimizer(_adamw(twin), twin)
    ref.load_state_dict(snapshot)
    for n, p in ref.named_params.items():
        p.grad = grads[n].clone()
    ref.set_formats({b: f for b, (_, f) in event.changed.items()}, blocks=ctl.block_params)
    for n in opt.named_params:
        got, want, old = opt.param_state(n), ref.param_state(n), before[n]
        for key in ("exp_avg", "exp_avg_sq", "row", "col"):
            a, b, c = getattr(got, key), getattr(want, key), getattr(old, key)
            assert (a is None) == (b is None), (n, key)
            if a is not None:
                assert torch.equal(a, b), (n, key)
            if n not in moved and c is not None:
                assert torch.equal(a, c), (n, key)  # unchanged blocks keep their bytes
    ctl.close()


def test_budget_change_forces_a_migration_even_without_risk_gain() -> None:
    risk = TableRisk(_prior_table(["0", "2", "4"]))
    ctl, model, opt = _allocated(risk, memory_budget=0.5)
    assert opt.state_bytes() <= 0.5 * ctl.fp32_state_bytes()
    held = opt.state_bytes()
    ctl.set_budget(memory_budget=0.2)
    assert ctl.pending == "budget"
    opt.reset_peak_state_bytes()
    (event,) = _train(ctl, model, opt, 12, 8)
    assert event.reason == "budget" and not event.kept and event.changed
    assert opt.state_bytes() <= 0.2 * ctl.fp32_state_bytes() and event.memory_budget_bytes == int(0.2 * ctl.fp32_state_bytes())
    # lowering the budget: the old state until the conversion, never more than it plus one parameter's
    largest = max(8 * p.numel() for p in model.parameters())
    assert held <= opt.peak_state_bytes() <= held + largest
    assert held > 0.2 * ctl.fp32_state_bytes()  # the old state was over the new budget until then
    ctl.close()


def test_plateau_and_epoch_triggers() -> None:
    ctl = BAOCController(memory_budget=0.3, patience=2, min_delta=0.01, reevaluate_every_n_epochs=2)
    assert not ctl.validation_end(1.0) and not ctl.epoch_end(1)  # ignored during warm-up
    ctl.phase = "allocated"
    assert not ctl.validation_end(1.0)  # first value: the best so far
    assert not ctl.validation_end(0.995)  # better by less than min_delta: no improvement (wait 1)
    assert not ctl.validation_end(0.5)  # improvement: wait restarts
    assert not ctl.validation_end(0.6) and ctl.validation_end(0.55) and ctl.pending == "plateau"
    assert not ctl.validation_end(math.nan)
    ctl.pending = None
    assert not ctl.epoch_end(0) and ctl.epoch_end(1) and ctl.pending == "epoch"
    ctl_max = BAOCController(memory_budget=0.3, mode="max", patience=1)
    ctl_max.phase = "allocated"
    assert not ctl_max.validation_end(0.5) and not ctl_max.validation_end(0.6) and ctl_max.validation_end(0.6)


# ---------------------------------------------------------------------------- ranks and checkpoints


def test_rank_zero_decision_and_errors_reach_every_rank() -> None:
    sent: list[Any] = []

    def rank0_broadcast(obj: Any) -> Any:
        sent.append(obj)
        return obj

    assert decide_on_rank_zero(lambda: {"a": "int8"}, rank0_broadcast, True) == {"a": "int8"}
    # rank one never runs fn; it gets rank zero's payload
    assert decide_on_rank_zero(lambda: 1 / 0, lambda _: sent[-1], False) == {"a": "int8"}
    err = BudgetInfeasibleError("too small; the smallest feasible is 9", memory_budget=1, time_budget=None, min_memory=9, min_time=None)

    def fail() -> Any:
        raise err

    with pytest.raises(BudgetInfeasibleError):
        decide_on_rank_zero(fail, rank0_broadcast, True)
    with pytest.raises(BudgetInfeasibleError, match="smallest feasible is 9") as info:
        decide_on_rank_zero(lambda: None, lambda _: sent[-1], False)
    assert info.value.min_memory == 9
    with pytest.raises(ZeroDivisionError):
        decide_on_rank_zero(lambda: 1 / 0, rank0_broadcast, True)
    with pytest.raises(RuntimeError, match="ZeroDivisionError"):
        decide_on_rank_zero(lambda: None, lambda _: sent[-1], False)


def test_state_dict_loads_weights_only_and_rebuilds_the_allocation() -> None:
    ctl, model, opt = _allocated(TableRisk(_prior_table(["0", "2", "4"])), reevaluate_every_n_epochs=1)
    ctl.epoch_end(0)
    buffer = io.BytesIO()
    torch.save({"baoc": ctl.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    fresh_model = _model()
    fresh = BAOCController(BAOCConfig(memory_budget=0.3, warmup_steps=12, sample_every=4, sparse_sampling=1))
    fresh.load_state_dict(loaded["baoc"])  # before install, as Lightning does
    new_opt = fresh.install(_adamw(fresh_model), fresh_model)
    assert fresh.phase == "allocated" and fresh.allocation == ctl.allocation and fresh.pending == "epoch"
    named = new_opt.named_params
    for b, f in ctl.allocation.items():
        assert all(new_opt.requested_format(named[n]) == f for n in ctl.block_params[b])
    new_opt.load_state_dict(loaded["optimizer"])
    assert new_opt.formats() == opt.formats() and new_opt.state_bytes() == opt.state_bytes()
    assert fresh.sampler.statistics().keys() == ctl.sampler.statistics().keys()
    assert fresh.history == ctl.history
    # a different partition is mapped parameter by parameter and re-evaluated before the next step
    other = BAOCController(memory_budget=0.3, warmup_steps=12, sample_every=4, granularity="param")
    other.load_state_dict(loaded["baoc"])
    m = _model()
    other.install(_adamw(m), m)
    assert other.pending == "settings"
    for c in (ctl, fresh, other):
        c.close()


def test_the_controller_is_composed_of_parts_not_stacked_from_mixins() -> None:
    project = [c for c in BAOCController.__mro__ if c.__module__.startswith("lightning_baoc")]
    assert len(project) <= 3, project
    ctl = BAOCController(memory_budget=0.5)
    parts = {
        "blocks": "Blocks", "tables": "BlockTables", "instrumentation": "Instrumentation",
        "release_observer": "ReleasedGradientObserver", "options": "Options", "scoring": "Scoring",
        "start": "StartAllocation", "triggers": "Triggers", "checkpoint": "ControllerCheckpoint",
    }
    assert {name: type(getattr(ctl, name)).__name__ for name in parts} == parts
    assert all(getattr(ctl, name).config is ctl.config for name in parts if name != "release_observer")  # one settings object


def test_the_byte_counts_of_the_optimizer_and_the_controller_are_methods() -> None:
    """One convention: a count an object computes is a method (``state_bytes()``, ``peak_state_bytes()``);
    records (``AllocationEvent``, ``StatePhases``) hold their figures as fields."""
    import inspect

    from lightning_baoc import BlockwiseAdamW

    counts = {BlockwiseAdamW: ("state_bytes", "host_state_bytes", "peak_state_bytes"),
              BAOCController: ("fp32_state_bytes", "baseline_state_bytes", "peak_state_bytes", "instrument_bytes",
                               "memory_budget_bytes")}
    for cls, names in counts.items():
        for name in names:
            assert inspect.isfunction(inspect.getattr_static(cls, name)), f"{cls.__name__}.{name} is not a method"


def test_min_8bit_numel_applies_or_its_conflict_with_a_blockwise_optimizer_is_refused() -> None:
    """``BAOC(min_8bit_numel=0)`` over a returned BlockwiseLion was ignored silently (the optimizer's 4096
    held, so the setting never worked for Lion); now a converted optimizer takes it, a blockwise one keeps its
    own, and a BAOC value that differs from the blockwise optimizer's is refused by name before anything."""
    from lightning_baoc import BlockwiseLion
    from lightning_baoc.control.controller import BAOCController

    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 2))
    converted = BAOCController(memory_budget=0.5, calibration="prior", min_8bit_numel=0).install(
        torch.optim.AdamW(model.parameters()), model)
    assert converted.min_8bit_numel == 0
    lion = BlockwiseLion(model.named_parameters())
    with pytest.raises(ValueError, match=r"BAOC\(min_8bit_numel=0\) and the BlockwiseLion .*min_8bit_numel=4096\) differ"):
        BAOCController(memory_budget=0.5, calibration="prior", min_8bit_numel=0).install(lion, model)
    own = BlockwiseLion(model.named_parameters(), min_8bit_numel=0)
    for controller in (BAOCController(memory_budget=0.5, calibration="prior"),
                       BAOCController(memory_budget=0.5, calibration="prior", min_8bit_numel=0)):
        assert controller.install(own, model) is own and own.min_8bit_numel == 0
        controller.close()
