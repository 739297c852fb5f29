"""Shared test helpers with no Lightning: seeded models, the digits data, one thread, allocator peaks.

Importable from any test module (``tests`` is on the test ``pythonpath``): ``from support import mlp``.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile


def digits_tensors(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits (1797 images, shipped with the package): train/test split, scaled."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    x, y = x[order], y[order]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def mlp(widths: tuple[int, ...] = (64, 256, 256, 10), seed: int = 0) -> nn.Sequential:
    """A plain MLP with LayerNorm, seeded."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers += [nn.LayerNorm(b), nn.GELU()]
    return nn.Sequential(*layers)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Any:
    """Run a test module's trainings on one intra-op thread (import it into the module to apply).

    The test machines are 2-core and shared: with two threads a tiny model's step waits on the
    other thread and runs 5-8x slower than with one. Results are compared within a module only.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train_digits(fmt: str, digits, steps: int = 600, seed: int = 0, switch_at: int | None = None) -> tuple[float, list[float]]:
    """Train the digits MLP with one state format (or fp32 switched to it at ``switch_at``): test loss, losses."""
    from lightning_baoc import BlockwiseAdamW

    xtr, ytr, xte, yte = digits
    model = mlp((64, 256, 256, 10), seed=seed)
    opt = BlockwiseAdamW(
        model.named_parameters(), lr=2e-3, weight_decay=1e-2,
        state_format="fp32" if switch_at else fmt, min_8bit_numel=0,
    )
    gen = torch.Generator().manual_seed(seed)
    losses = []
    order = torch.randperm(len(xtr), generator=gen)
    for step in range(steps):
        if switch_at is not None and step == switch_at:
            opt.set_formats({name: fmt for name in opt.named_params})
        start = (step * 64) % (len(xtr) - 64)
        if start < 64:
            order = torch.randperm(len(xtr), generator=gen)
        idx = order[start : start + 64]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(xtr[idx]), ytr[idx])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        test_loss = nn.functional.cross_entropy(model(xte), yte).item()
    return test_loss, losses


_MARK = 12_345  # bytes of the marker allocations around the measured region (an unlikely size)


def peak_above_start(setup, fn):  # type: ignore[no-untyped-def]
    """Run ``setup()`` then ``fn(setup's result)`` under the allocator's profiler; the largest
    (allocated - freed) bytes at any moment of ``fn`` above what was live when it began, and the
    result of ``setup``.

    Everything is allocated inside the profiled region (the profiler reports the size of a free
    only for blocks it saw allocated), and no ``record_function`` scope is opened (frees in a
    scope are booked at its start): the region is marked by two allocations of ``_MARK`` bytes.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        made = setup()
        first = torch.empty(_MARK, dtype=torch.uint8)  # held: its free would fall inside the region
        fn(made)
        last = torch.empty(_MARK, dtype=torch.uint8)
        del first, last
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    marks = [i for i, e in enumerate(events) if e.name == "aten::empty" and e.self_cpu_memory_usage == _MARK]
    assert len(marks) == 2, "the profiler did not record the markers"
    base = sum(e.self_cpu_memory_usage for e in events[: marks[0]])
    live = peak = base
    for event in events[marks[0] + 1 : marks[1]]:
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak - base, made


def controller_steps(ctl, opt, loss_of, start: int, steps: int, before: bool = False) -> list:  # type: ignore[no-untyped-def]
    """Steps ``start .. start + steps - 1`` of a framework-free BAOC loop: backward of ``loss_of(step)``,
    ``ctl.before_step`` (with ``before``), ``ctl.observe``, the step, ``ctl.maybe_allocate``; the events."""
    events = []
    for step in range(start, start + steps):
        opt.zero_grad()
        loss_of(step).backward()
        if before:
            ctl.before_step(step)
        ctl.observe(step)
        opt.step()
        event = ctl.maybe_allocate(step + 1)
        if event is not None:
            events.append(event)
    return events


def record_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the tensors of each launch of the Triton step (``triton_step._adamw_tensors``: the planned
    step's and :func:`~lightning_baoc.kernels.triton_step.adamw_step`'s), and launch it."""
    from lightning_baoc.kernels import triton_step

    launches: list[int] = []
    real = triton_step._adamw_tensors

    class Counted:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            def launch(table, count, *args, **kwargs):  # type: ignore[no-untyped-def]
                launches.append(count)
                return real[grid](table, count, *args, **kwargs)
            return launch

    monkeypatch.setattr(triton_step, "_adamw_tensors", Counted())
    return launches


def record_grids(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[int]:
    """Replace the Triton kernel ``module.name`` by one that records each launch's grid (its programs) and
    launches the kernel."""
    grids: list[int] = []
    real = getattr(module, name)

    class Recorded:
        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            grids.append(grid[0])
            return real[grid]

    monkeypatch.setattr(module, name, Recorded())
    return grids


def ragged_shapes(count: int = 40, seed: int = 3) -> list[tuple[int, ...]]:
    """``count`` tensor shapes of 1 to 3000 elements (2-D, 7 columns, where odd and at least 14), and an empty one."""
    sizes = [int(x) for x in torch.randint(1, 3000, (count,), generator=torch.Generator().manual_seed(seed))] + [0]
    return [(n // 7, 7) if n % 2 and n >= 14 else (n,) for n in sizes]


def lone_fp32_steps(device: torch.device, policy: str) -> list[torch.Tensor]:
    """One fp32 parameter alone in its optimizer (as gradient release steps it), three steps on ``device``
    with a NaN in the second gradient (drawn on the CPU, the same on every device): its weight and states on
    the CPU, the skip checked (one non-finite count, two steps)."""
    from lightning_baoc import BlockwiseAdamW

    gen = torch.Generator().manual_seed(0)
    p = nn.Parameter(torch.randn(37, 101, generator=gen).to(device))
    opt = BlockwiseAdamW([("w", p)], lr=1e-2, state_format="fp32", kernels=policy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the NaN's warning
        for i in range(3):
            g = torch.randn(p.shape, generator=gen)
            if i == 1:
                g[3, 5] = float("nan")
            p.grad = g.to(device)
            opt.step()
        assert opt.nonfinite_counts == {"w": 1} and opt.step_count("w") == 2
    return [p.detach().cpu(), *(v.cpu() for _, v in sorted(opt._records[p].views.items()))]  # noqa: SLF001


class BusyCores:
    """Keep ``count`` cores busy while a block runs: one process per core spinning in a Python loop (it
    allocates nothing and touches no file), started on entry and killed by its process id on exit. A
    measurement that holds only on a quiet machine fails under it (issue 61: the memory tests hold under load).

    After the block, ``cpu_seconds`` holds each spinner's CPU time (user + system, from ``os.wait4``) and
    ``wall_seconds`` the block's, so a test can show that the spinners ran.

    Example::

        with BusyCores(1) as busy:
            measure()
        assert min(busy.cpu_seconds) > 0.1 * busy.wall_seconds
    """

    def __init__(self, count: int = 1) -> None:
        if count < 1:
            raise ValueError(f"Invalid count={count}: the number of cores to keep busy, at least 1")
        self.count = count
        self.cpu_seconds: list[float] = []
        self.wall_seconds = 0.0
        self._procs: list[Any] = []
        self._began = 0.0

    def __enter__(self) -> BusyCores:
        import subprocess
        import sys
        import time

        self._procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.count)]
        self._began = time.perf_counter()
        return self

    def __exit__(self, *_: Any) -> None:
        import os
        import time

        self.wall_seconds = time.perf_counter() - self._began
        for proc in self._procs:
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)  # reaped here, with the spinner's own CPU time
            proc.returncode = os.waitstatus_to_exitcode(status)
            self.cpu_seconds.append(usage.ru_utime + usage.ru_stime)
        self._procs = []
