"""The pools part alone (``lightning_baoc/optim/pools.py``: :class:`StatePools`), over a records table made here.

- A fresh state is zero, in one segment per parameter, and the bytes it counts (``held_bytes``,
  ``live_bytes``, ``pool_bytes``) are the storage really allocated; an empty pool is dropped.
- A conversion keeps the state (fp32 -> int8 -> fp32 within int8's error), calls ``on_replace`` before
  the old views go and ``on_commit`` once per parameter, shrinking parameters first; the peak counts
  the transient of the one parameter being converted.
- ``fresh`` touches no record and no pool until ``install``; ``recount`` and ``reset_peak`` say what is
  held now.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_baoc.formats import FORMATS, StepHyper
from lightning_baoc.optim.pools import Pool, Record, StatePools


def _hyper(p: torch.Tensor) -> StepHyper:
    return StepHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, chunk=1024, kernels="eager")


def _table(*shapes: tuple[int, ...]) -> tuple[list[nn.Parameter], dict[torch.Tensor, Record]]:
    gen = torch.Generator().manual_seed(0)
    params = [nn.Parameter(torch.randn(shape, generator=gen)) for shape in shapes]
    records = {p: Record(name=f"w{i}", group=i % 2) for i, p in enumerate(params)}
    return params, records


def _storage(records: dict[torch.Tensor, Record]) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for rec in records.values() for t in rec.views.values() if t.numel()}.values())


def test_a_fresh_state_is_zero_and_counted_as_allocated() -> None:
    (a, b), records = _table((64, 64), (128,))
    pools = StatePools(records, FORMATS)
    committed: list[str] = []
    pools.rebuild({a: "int8", b: "fp32"}, _hyper, lambda p: committed.append(records[p].name))
    assert sorted(committed) == ["w0", "w1"]
    assert records[a].format == "int8" and records[b].format == "fp32"
    assert all(int(t.count_nonzero()) == 0 for rec in records.values() for t in rec.views.values())
    held = pools.held_bytes(host=False)
    assert held == {0: FORMATS["int8"].state_bytes((64, 64)), 1: FORMATS["fp32"].state_bytes((128,))}
    assert sum(held.values()) == pools.live_bytes == pools.peak_bytes == _storage(records)
    assert set(pools.pool_bytes()) == {("int8", "cpu"), ("fp32", "cpu")}
    assert sum(pools.pool_bytes().values()) == pools.live_bytes
    assert pools.held_bytes(host=True) == {}  # CPU parameters: no host memory apart from the device's


def test_a_conversion_keeps_the_state_and_drops_an_empty_pool() -> None:
    (a,), records = _table((64, 64))
    replaced: list[int] = []
    pools = StatePools(records, FORMATS, lambda: replaced.append(1))
    pools.rebuild({a: "fp32"}, _hyper)
    m = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    records[a].views["exp_avg"].copy_(m.view(-1))
    records[a].views["exp_avg_sq"].copy_(m.square().view(-1))
    records[a].m_step = 3
    before = len(replaced)
    pools.rebuild({a: "int8"}, _hyper)
    assert len(replaced) == before + 1  # told before the old views went
    assert set(pools.pools) == {("int8", "cpu")}  # the fp32 pool, empty, is gone
    state = pools.decode(a)
    assert state is not None and records[a].m_step == 3
    assert torch.allclose(state.exp_avg, m, atol=0.05 * float(m.abs().max()))
    pools.rebuild({a: "nomomentum"}, _hyper)
    assert records[a].m_step == 0 and pools.decode(a).exp_avg is None
    assert pools.live_bytes == _storage(records) == FORMATS["nomomentum"].state_bytes((64, 64))


def test_the_peak_counts_one_parameter_converting_and_shrinking_ones_go_first() -> None:
    (a, b), records = _table((64, 64), (32, 64))
    pools = StatePools(records, FORMATS)
    pools.rebuild({a: "int8", b: "fp32"}, _hyper)
    pools.reset_peak()
    order: list[str] = []
    pools.rebuild({a: "fp32", b: "int8"}, _hyper, lambda p: order.append(records[p].name))
    assert order == ["w1", "w0"]  # b shrinks: it goes first, then a grows
    before = FORMATS["int8"].state_bytes((64, 64)) + FORMATS["fp32"].state_bytes((32, 64))
    after = FORMATS["fp32"].state_bytes((64, 64)) + FORMATS["int8"].state_bytes((32, 64))
    assert pools.live_bytes == after
    # at most the larger of before and after, plus the smaller of the one converting parameter's states
    transient = min(FORMATS["int8"].state_bytes((64, 64)), FORMATS["fp32"].state_bytes((64, 64)))
    assert max(before, after) <= pools.peak_bytes <= max(before, after) + transient


def test_fresh_pools_touch_nothing_until_installed() -> None:
    (a, b), records = _table((40, 40), (7,))
    pools = StatePools(records, FORMATS)
    pools.rebuild({a: "bf16", b: "fp32"}, _hyper)
    old_views = {p: rec.views for p, rec in records.items()}
    old_pools = pools.pools

    def fill(p: torch.Tensor, fmt: str, target: dict[str, torch.Tensor]) -> None:
        for t in target.values():
            t.fill_(1)

    new, views = pools.fresh({a: "int8", b: "fp32"}, fill)
    assert pools.pools is old_pools and all(records[p].views is v for p, v in old_views.items())
    assert set(new) == {("int8", "cpu"), ("fp32", "cpu")} and all(isinstance(pool, Pool) for pool in new.values())
    pools.install(new)
    for p, v in views.items():
        records[p].views, records[p].format = v, "int8" if p is a else "fp32"
    pools.recount()
    assert pools.pools is new
    assert pools.live_bytes == _storage(records)
    assert pools.layout("int8", a) == FORMATS["int8"].shard_layout((40, 40), 0)
    assert pools.state_tensors() and all(bool((t == 1).all()) for t in pools.state_tensors())
