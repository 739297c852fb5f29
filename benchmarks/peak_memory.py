"""Peak resident memory of a whole training run: BAOC against fp32 AdamW and a stateless optimizer.

Each run is its own process (a Lightning ``Trainer`` on the CPU, the same model, data and steps), and
its peak resident set size is read from the kernel when it exits (``os.wait4``: the child's
``ru_maxrss``). Runs:

- ``sgd``: plain SGD without momentum, the baseline: weights, gradients, activations, the libraries;
- ``adamw``: ``torch.optim.AdamW``, the reference: the baseline plus fp32 AdamW's state;
- ``baoc:B``: the same AdamW under ``BAOC(memory_budget=B)``: a warm-up, the allocation at its end
  (a conversion), and re-evaluations every epoch.

Every run first loads the same code (:func:`load_the_code`: a tiny model through BAOC), so the
libraries' memory is in the baseline. The claim measured: BAOC's peak above the baseline is at most
``B`` times AdamW's peak above the baseline, plus a bound (:func:`bound_bytes`): the transient of one
tensor (the largest tensor's fp32 state, 8 bytes per element: decoded by the risk model at an
allocation, or converted), the instruments' allowance (the sampler's ring and the shadow moments:
``max(instrument_share x`` AdamW's state, 256 KiB ``)``) and 2% of the fp32 state.

On a GPU (``--accelerator cuda``) the Trainer runs there and each run's figure is the peak of
``torch.cuda.max_memory_allocated()`` (read in the run's process after the shared code was loaded)
instead of the peak resident set; the claim and the bound are the same.

``--planned`` compares the peak that BAOC plans with the bytes of the run's tensors, counted at every
allocation and free (:class:`TensorBytes`, from torch's profiler; on CUDA ``max_memory_allocated``): a
counter, not a sampler, so no peak falls between two readings however the threads are scheduled.

Example::

    python benchmarks/peak_memory.py --docs
    python benchmarks/peak_memory.py --accelerator cuda --docs     # section peak_memory_cuda
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from typing import Any

from _report import command, machine, markdown_table, run_child, write_docs_section


@dataclass(frozen=True)
class Workload:
    """A model of ``layers`` square linear layers of ``width`` (with biases) trained ``steps`` steps."""

    layers: int = 40
    width: int = 1024
    batch: int = 16
    steps: int = 24
    epoch_steps: int = 8
    warmup: int = 6
    threads: int = 1
    capacity: int = 32  # BAOC's sampler ring (its defaults)
    max_elements: int = 4096
    accelerator: str = "cpu"
    precision: str = "32-true"  # the Trainer's; the model is built under trainer.init_module()
    defaults: bool = False  # BAOC with its defaults but the budget and the warm-up (as a new user runs it)
    count: bool = False  # count the tensors' bytes from fit start (the planned peak's comparison): TensorBytes

    @property
    def params(self) -> int:
        return self.layers * (self.width * self.width + self.width)


def load_the_code() -> None:
    """Train a 3-layer model through BAOC for a warm-up, an allocation and a conversion, and drop it.

    Every run calls this first, so the code of every library BAOC runs (libtorch's kernels of each
    format, the risk model, the solver, the sampler's thread) is mapped and initialized in the
    baseline as in the others, as importing them is: code pages are read from disk and shared
    between processes, they do not grow with the model, and no budget caps them (``--trace``
    measures them: about 10 MiB). What is left to compare is the memory the runs allocate.
    """
    import gc

    import torch
    from torch import nn

    from lightning_baoc.control.controller import BAOCController

    model = nn.Sequential(nn.Linear(2048, 64), nn.Linear(64, 64), nn.Linear(64, 2048))
    ctl = BAOCController(memory_budget=0.3, warmup_steps=3, sample_every=1, calibration="prior")
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    for step in range(6):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(4, 2048)).square().mean().backward()
        ctl.observe(step)
        opt.step()
        ctl.maybe_allocate(step + 1)
    if ctl.phase != "allocated":
        raise RuntimeError("load_the_code: the warm-up did not end in an allocation")
    ctl.close()
    del ctl, opt, model
    gc.collect()


def child(run: str, workload: Workload) -> dict[str, Any]:
    """Train one run in this process; what it held (called in the child process)."""
    import lightning as L
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_baoc  # noqa: F401  (imported by every run: the libraries are in the baseline)
    from lightning_baoc import BAOC
    from lightning_baoc.report.memory import resident_bytes

    torch.set_num_threads(workload.threads)
    if not workload.count:  # counted bytes are the run's own blocks: the code's pages matter to the resident set only
        load_the_code()
    cuda = workload.accelerator == "cuda"
    counter = TensorBytes() if workload.count and not cuda else None
    if counter is not None:  # before the model: every block the run frees is then one the counter saw allocated
        counter.start()
    if cuda:  # the peak of this run's own allocations (the CUDA context is not allocated storage)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(0)

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(*[nn.Linear(workload.width, workload.width) for _ in range(workload.layers)])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            (x,) = batch
            return self.net(x).square().mean()

        def configure_optimizers(self) -> Any:
            if run == "sgd":
                return torch.optim.SGD(self.parameters(), lr=1e-3)
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Resident(L.Callback):
        """What the run holds at the end of every step: resident bytes (CPU) or allocated bytes (CUDA)."""

        def __init__(self) -> None:
            self.held: list[int] = []

        def on_train_batch_end(self, *_: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
                self.held.append(int(torch.cuda.memory_allocated()))
            else:
                self.held.append(resident_bytes())

    data = torch.randn(workload.epoch_steps * workload.batch, workload.width)
    loader = DataLoader(TensorDataset(data), batch_size=workload.batch)
    resident = Resident()
    callbacks: list[L.Callback] = [resident]
    marks = TensorMarks(counter, cuda) if workload.count else None
    if marks is not None:
        callbacks.insert(0, marks)
    baoc = None
    if run.startswith("baoc:") and workload.defaults:
        baoc = BAOC(memory_budget=float(run.split(":")[1]), warmup_steps=workload.warmup, report=False)
        callbacks.append(baoc)
    elif run.startswith("baoc:"):
        baoc = BAOC(
            memory_budget=float(run.split(":")[1]), warmup_steps=workload.warmup, sample_every=2,
            reevaluate_every_n_epochs=1, hysteresis=0.0, report=False, capacity=workload.capacity,
            max_elements=workload.max_elements,
        )
        callbacks.append(baoc)
    trainer = L.Trainer(
        accelerator=workload.accelerator, devices=1, max_steps=workload.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, precision=workload.precision,
    )
    with trainer.init_module():
        net = Net()
    try:
        trainer.fit(net, loader)
    finally:  # a profiler left running when the process exits can crash it, hiding the fit's error
        if counter is not None:
            counter.stop()
    out: dict[str, Any] = {"run": run, "steps": trainer.global_step, "held_by_step": resident.held}
    if cuda:
        torch.cuda.synchronize()
        out["peak_device"] = torch.cuda.max_memory_allocated()
    if counter is not None:
        counted = counter.counts()
        held = counted["held"]  # at fit start, every step's end and train end
        out.update(allocated_start=held[0], allocated_peak=counted["peak"], allocated_by_step=held[1:-1],
                   allocated_step_peaks=counted["peaks"])
    elif marks is not None:  # CUDA: its own counters, and memory_allocated at the steps' ends
        out.update(allocated_start=marks.cuda_start, allocated_peak=out["peak_device"], allocated_by_step=resident.held)
    if baoc is not None:
        opt = trainer.optimizers[0]
        ctl = baoc.controller
        planned = ctl.planned_peak()
        out["planned_peak"] = planned.to_dict() if planned is not None else None
        out["measured_memory"] = baoc.measured_memory().to_dict()
        out["memory_line"] = baoc.memory_line()
        out.update(
            state_bytes=int(opt.state_bytes()), peak_state_bytes=int(ctl.peak_state_bytes()),
            correction_bytes=int(opt.weight_correction_bytes()),
            budget_bytes=int(ctl.memory_budget_bytes()), baseline_state_bytes=int(ctl.baseline_state_bytes()),
            allocations=[(h["step"], h["reason"]) for h in ctl.history],
            shadow_bytes=int(ctl.shadow.nbytes()) if ctl.shadow is not None else 0,
            sampler_bytes=int(ctl.sampler.buffer_bytes()) if ctl.sampler is not None else 0,
            instrument_allowance=int(ctl.instruments.allowance), sampled_elements=int(ctl.instruments.max_elements),
            shadow_elements=int(ctl.instruments.shadow_elements),
        )
    return out


#: The size of the marks put into the stream of allocations (bytes): odd and near 1 MB, a size no tensor of
#: the runs has, so that each mark is found by its size.
MARK_BYTES = 1_000_003


class TensorBytes:
    """The bytes torch's CPU allocator holds for the tensors made since :meth:`start`, from every allocation
    and free, on the thread that started it.

    torch's profiler with ``profile_memory=True`` is told of every allocation and free of the CPU allocator
    (``c10``'s memory reporter calls it from inside the allocation) and records each with its block's address
    and size, in order. :meth:`counts` adds them up block by block: the bytes held after every allocation are
    known, so the peak is the largest of them whatever the scheduling (a thread reading a counter now and then
    misses the peaks that fall between two readings, and misses more when it is not scheduled). It counts
    tensors' storage (weights, gradients, the optimizer state, activations, BAOC's instruments and scratch),
    not Python objects nor memory that libraries allocate outside torch (a BLAS's buffers).

    The profiler follows the thread that starts it and the threads torch runs its work on (autograd's); a
    thread of a library's own is not followed: BAOC's sampler worker, whose reductions hold at most about
    1.3 MiB for a moment (``lightning_baoc.sampling.reduce.COSINE_SLICE``), is not counted, nor a free there of
    a block this thread allocated (none in these runs: what is held at the steps' ends does not grow).

    :meth:`mark` puts an allocation and a free of :data:`MARK_BYTES` into the record; :meth:`counts` reads
    the bytes held at each mark and the most held between marks.

    Example::

        counter = TensorBytes()
        counter.start()
        counter.mark()
        x = torch.empty(2**20)  # 4 MiB, freed at once
        del x
        counter.mark()
        counter.stop()
        counter.counts()["peak"] - counter.counts()["held"][0]  # 4 MiB
    """

    def __init__(self) -> None:
        self._profile: Any = None

    def start(self) -> None:
        """Start counting (before anything the measured work allocates: a free is counted only for a block
        allocated since then)."""
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.start()

    @staticmethod
    def mark() -> None:
        """A mark in the record: :data:`MARK_BYTES` allocated and freed at once."""
        import torch

        torch.empty(MARK_BYTES, dtype=torch.uint8)

    def stop(self) -> None:
        """Stop counting."""
        self._profile.stop()

    def counts(self) -> dict[str, Any]:
        """After :meth:`stop`: ``held``, the bytes held at each mark; ``peaks``, the most held between each
        mark and the next; ``peak``, the most held from the first mark to the last (bytes of the blocks
        allocated since :meth:`start`)."""
        from torch._C._profiler import _EventType

        events, todo = [], list(self._profile.profiler.kineto_results.experimental_event_tree())
        while todo:
            event = todo.pop()
            todo.extend(event.children)
            fields = event.extra_fields
            if event.tag == _EventType.Allocation and fields.device.type == "cpu":
                events.append((event.start_time_ns, fields.alloc_size, fields.ptr))
        events.sort()  # one thread's events: in the order they happened
        # The sum is kept here, block by block: the allocator's own running total also holds the blocks that an
        # earlier profile saw allocated and that were freed while none was on (it is told of frees only then).
        live: dict[int, int] = {}
        held: list[int] = []
        peaks: list[int] = []
        now = 0
        for _, size, ptr in events:
            if size == MARK_BYTES:
                held.append(now)
                peaks.append(now)
            elif size == -MARK_BYTES:
                continue
            elif size > 0:
                live[ptr] = size
                now += size
                if peaks:
                    peaks[-1] = max(peaks[-1], now)
            elif ptr in live:  # a free of a block allocated before start() is not the work's
                now -= live.pop(ptr)
        if len(held) < 2:
            raise RuntimeError(f"the profiler recorded {len(held)} marks of {MARK_BYTES} bytes; counts() needs 2 "
                               "or more (call mark() between start() and stop())")
        peaks = [max(p, h) for p, h in zip(peaks, held[1:])]  # the interval after the last mark is not counted
        return {"held": held, "peaks": peaks, "peak": max(peaks)}


def TensorMarks(counter: TensorBytes | None, cuda: bool) -> Any:  # noqa: N802 - a callback class made here
    """A callback marking fit start, every step's end and train end in ``counter``'s stream (the CPU); on
    CUDA resetting the allocated peak at fit start. First in the list, so fit start is before BAOC's."""
    import lightning as L
    import torch

    class Marks(L.Callback):
        def __init__(self) -> None:
            self.cuda_start = 0

        def on_fit_start(self, *_: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                self.cuda_start = int(torch.cuda.memory_allocated())
            elif counter is not None:
                counter.mark()

        def on_train_batch_end(self, *_: Any) -> None:
            if counter is not None:
                counter.mark()

        def on_train_end(self, *_: Any) -> None:
            if counter is not None:
                counter.mark()

    return Marks()


def planned_rows(workload: Workload, budget: float, here: bool = False) -> list[dict[str, Any]]:
    """BAOC at ``budget`` with its defaults on ``workload``, fp32 and bf16-true: the planned peak beyond the
    weights (the controller's, and ``lightning-baoc check``'s on the model built on the meta device) against
    the tensors' bytes counted from fit start (:class:`TensorBytes`; on CUDA ``max_memory_allocated`` and
    ``memory_allocated``): ``measured``, their peak over fit start; ``held``, the most held at a step's end
    over fit start. ``here``: the runs in this process (:func:`measure`)."""
    import torch
    from torch import nn

    from lightning_baoc.config.files import parse_config
    from lightning_baoc.tools.check import run_checks

    rows = []
    for precision in ("32-true", "bf16-true"):
        w = replace(workload, precision=precision, defaults=True, count=True)
        r = measure(f"baoc:{budget}", w, here=here)
        cfg = parse_config({"baoc": {"memory_budget": budget, "warmup_steps": w.warmup},
                            "trainer": {"precision": precision, "max_steps": w.steps}})
        with torch.device("meta"):
            model = nn.Sequential(*[nn.Linear(w.width, w.width) for _ in range(w.layers)])
        budget_row = next(c for c in run_checks(cfg, model, w.accelerator) if c.name == "memory budget")
        rows.append({"precision": precision, "planned": r["planned_peak"]["total"],
                     "check": budget_row.figures["planned_peak"]["total"],
                     "measured": r["allocated_peak"] - r["allocated_start"],
                     "held": max(r["allocated_by_step"]) - r["allocated_start"], "line": r["memory_line"],
                     "terms": r["planned_peak"], "allocations": r["allocations"]})
    return rows


#: How near the most a counted run holds at a step's end must be to the plan's gradients, optimizer state and
#: instruments (of their sum). Measured on :func:`fast_workload`: +0.34% (fp32) and +0.45% (bf16-true).
HELD_TOLERANCE = 0.02


def plan_misses(row: dict[str, Any]) -> list[str]:
    """What a row of :func:`planned_rows` shows the plan to get wrong, as sentences; none when it holds.

    The plan's terms are of two kinds. Gradients, the optimizer state and the instruments are held from one
    step to the next: the most held at a step's end must be their sum, within :data:`HELD_TOLERANCE`. The
    working memory is a bound on BAOC's scratch, on top of them for a moment: the peak must be within the
    plan. On a large model the bound is nearly reached and the plan is the peak within 5% (the 42M run);
    on a small one the scratch is smaller than the bound (about 4 MiB of its 8 at 3M parameters), and these
    two checks are what holds whatever the size.
    """
    terms = row["terms"]
    held_planned = terms["gradients"] + terms["state"] + terms["instruments"] + terms.get("staging", 0)
    misses = []
    if abs(row["held"] - held_planned) > HELD_TOLERANCE * held_planned:
        misses.append(f"{row['precision']}: held at a step's end {row['held']:,} bytes over fit start, planned "
                      f"gradients + state + instruments {held_planned:,} ({row['held'] / held_planned - 1:+.1%})")
    if row["measured"] > row["planned"]:
        misses.append(f"{row['precision']}: the peak, {row['measured']:,} bytes over fit start, is above the "
                      f"planned {row['planned']:,}")
    return misses


def planned_table(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`planned_rows` as a markdown table."""
    mib = 2**20
    lines = []
    for r in rows:
        t = r["terms"]
        held_planned = t["gradients"] + t["state"] + t["instruments"] + t.get("staging", 0)
        lines.append([r["precision"], f"{r['check'] / mib:.1f}", f"{r['planned'] / mib:.1f}",
                      f"{r['measured'] / mib:.1f}", f"{(r['planned'] - r['measured']) / r['measured']:+.1%}",
                      f"{held_planned / mib:.2f}", f"{r['held'] / mib:.2f}"])
    head = ["precision", "planned by check (MiB)", "planned at the run (MiB)", "measured peak (MiB)",
            "planned - measured", "planned gradients + state + instruments (MiB)", "held at a step's end (MiB)"]
    return markdown_table(head, lines)


def measure(run: str, workload: Workload, here: bool = False) -> dict[str, Any]:
    """Run ``run`` in a fresh process; its report and its peak RSS in bytes (:func:`_report.run_child`).

    ``here``: in this process instead, for a counted workload (``count=True``) only: its figures are the
    blocks the run itself allocates, which nothing done before in the process changes, where the resident
    set is the whole process's. torch's thread count and random state are restored after it.
    """
    if not here:
        return run_child("peak_memory", "child", run, workload.__dict__)
    if not workload.count:
        raise ValueError(f"measure(here=True) needs a counted workload, got {workload.count=}: a resident set is "
                         "the process's; use here=False (a fresh process) or replace(workload, count=True)")
    import torch

    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng():
            return child(run, workload)
    finally:
        torch.set_num_threads(threads)


def bound_bytes(workload: Workload, result: dict[str, Any]) -> int:
    """The documented allowance above ``B x`` AdamW's peak, from the run's own report:

    - one tensor's transient, 8 bytes per element of the largest tensor (decoded by the risk model,
      or converted, one at a time);
    - the instruments' allowance (``BAOCController.instruments.allowance``: the sampler's ring and
      the shadow moments hold at most ``max(instrument_share x`` AdamW's state, 256 KiB ``)``);
    - 2% of AdamW's fp32 state for the step's working slices (``FOREACH_ELEMENTS`` and
      ``chunk_size`` elements), the controller's Python objects and the allocator's rounding.
    """
    largest = workload.width * workload.width
    return 8 * largest + int(result["instrument_allowance"]) + int(0.02 * 8 * workload.params)


def run_all(workload: Workload, budgets: list[float]) -> dict[str, dict[str, Any]]:
    """Every run, one after the other (never side by side: they would share the memory)."""
    return {run: measure(run, workload) for run in ["sgd", "adamw", *[f"baoc:{b}" for b in budgets]]}


def peak_key(workload: Workload) -> str:
    """A run's figure: ``"peak_device"`` (CUDA's allocated peak) on a GPU, else ``"peak_rss"``."""
    return "peak_device" if workload.accelerator == "cuda" else "peak_rss"


def table(workload: Workload, results: dict[str, dict[str, Any]], budgets: list[float]) -> str:
    key = peak_key(workload)
    base = results["sgd"][key]
    adamw = results["adamw"][key] - base
    mib = 2**20
    dash = ["-"] * 5
    rows = [["SGD (baseline)", f"{base / mib:,.1f}", "-", "-", *dash],
            ["AdamW (reference)", f"{results['adamw'][key] / mib:,.1f}", f"{adamw / mib:,.1f}", "1.000", *dash]]
    for b in budgets:
        r = results[f"baoc:{b}"]
        above = r[key] - base
        bound = bound_bytes(workload, r)
        allowed = b * adamw + bound
        held = r["sampler_bytes"] + r["shadow_bytes"]
        rows.append([f"BAOC, budget {b}", f"{r[key] / mib:,.1f}", f"{above / mib:,.1f}", f"{above / adamw:.3f}",
                     f"{(above - b * adamw) / adamw:.1%}", f"{bound / adamw:.1%}", f"{held / mib:.1f}",
                     f"{allowed / mib:,.1f}", "yes" if above <= allowed else "**no**"])
    head = ["run", "peak CUDA allocated (MiB)" if key == "peak_device" else "peak RSS (MiB)", "above baseline (MiB)", "of AdamW's", "over B x AdamW's (of AdamW's)",
            "bound (of AdamW's)", "instruments (MiB)", "allowed (MiB)", "within"]
    return markdown_table(head, rows)


def section(workload: Workload, results: dict[str, dict[str, Any]], budgets: list[float]) -> str:
    """One workload's paragraph and table."""
    sizes = next(r for run, r in results.items() if run.startswith("baoc"))
    return "\n\n".join([
        f"**{workload.layers} x Linear({workload.width}, {workload.width})** ({workload.params:,} parameters), batch "
        f"{workload.batch}, {workload.steps} steps, epochs of {workload.epoch_steps}; BAOC warm-up {workload.warmup} "
        f"steps, re-evaluation every epoch; the instruments sized to {sizes['sampled_elements']:,} sampled elements "
        f"per block and {sizes['shadow_elements']:,} shadowed per tensor.",
        table(workload, results, budgets),
        "Allocations: " + "; ".join(f"{run}: {r.get('allocations')}" for run, r in results.items() if run.startswith("baoc")),
    ])


#: What BAOC's whole-run peak may exceed its own steady state by, beyond AdamW's own excess (bytes per parameter).
EXCESS_ALLOWANCE = 0.3


def excess_workload(layers: int = 10, width: int = 2048, accelerator: str = "cpu") -> Workload:
    """The run of ``--excess``: ``layers x Linear(width, width)``, 40 steps, BAOC's allocation at step 20."""
    return Workload(layers=layers, width=width, steps=40, epoch_steps=40, warmup=20, threads=2, accelerator=accelerator)


def fast_workload(accelerator: str = "cpu") -> Workload:
    """The default tests' run: 3 x Linear(1024, 1024) (3.1M parameters), 16 steps, BAOC's allocation at step 12
    (the earliest its defaults allow: two gradient samples, 10 steps apart), the tensors' bytes counted
    (:class:`TensorBytes`), one torch thread (the same blocks on any machine)."""
    return Workload(layers=3, width=1024, steps=16, epoch_steps=16, warmup=12, threads=1, accelerator=accelerator,
                    count=True)


def excess(workload: Workload, budget: float, here: bool = False) -> list[dict[str, Any]]:
    """Plain AdamW and BAOC at ``budget`` with its defaults, at each precision (fp32 and bf16-true): the
    whole run's peak over its steady state (what it holds at the end of the last step), in bytes per
    parameter, against AdamW's own excess plus :data:`EXCESS_ALLOWANCE`; and the peak's saving against
    the state's (bytes per parameter, corrections counted as the budget counts them). One dict per precision.

    The bytes are the resident set's (CPU) or the allocated ones (CUDA); for a counted workload
    (``count=True``) the tensors' (:class:`TensorBytes`; CUDA's allocated bytes). ``here``: the runs in this
    process (:func:`measure`)."""
    n = workload.params
    out = []
    for precision in ("32-true", "bf16-true"):
        w = replace(workload, precision=precision, defaults=True)
        runs = {"adamw": measure("adamw", w, here=here), "baoc": measure(f"baoc:{budget}", w, here=here)}
        if workload.count:
            steady = {name: r["allocated_by_step"][-1] / n for name, r in runs.items()}
            peak = {name: r["allocated_peak"] / n for name, r in runs.items()}
        else:
            steady = {name: r["held_by_step"][-1] / n for name, r in runs.items()}
            peak = {name: r[peak_key(workload)] / n for name, r in runs.items()}
        baoc = runs["baoc"]
        out.append({
            "precision": precision, "budget": budget, "steady": steady, "peak": peak,
            "excess": {name: peak[name] - steady[name] for name in runs},
            "allowed": peak["adamw"] - steady["adamw"] + EXCESS_ALLOWANCE,
            "state_saved": (baoc["baseline_state_bytes"] - baoc["state_bytes"] - baoc["correction_bytes"]) / n,
            "peak_saved": peak["adamw"] - peak["baoc"],
            "allocations": baoc["allocations"],
        })
    return out


def excess_misses(row: dict[str, Any], warmup: int) -> list[str]:
    """What a row of :func:`excess` shows to be wrong, as sentences; none when it holds: BAOC's allocation at
    the end of its ``warmup``, its peak over its steady state within AdamW's own excess plus
    :data:`EXCESS_ALLOWANCE`, and a peak that saves at least half of what the state saves."""
    misses = []
    if not row["allocations"] or list(row["allocations"][0]) != [warmup, "warmup"]:
        misses.append(f"{row['precision']}: allocations {row['allocations']}, expected the first at step {warmup}")
    if row["excess"]["baoc"] > row["allowed"]:
        misses.append(f"{row['precision']}: BAOC's peak is {row['excess']['baoc']:.2f} bytes per parameter over its "
                      f"steady state, above the {row['allowed']:.2f} allowed")
    if not (row["state_saved"] > 0 and row["peak_saved"] >= 0.5 * row["state_saved"]):
        misses.append(f"{row['precision']}: the peak saves {row['peak_saved']:.2f} bytes per parameter, under half "
                      f"the state's {row['state_saved']:.2f}")
    return misses


def excess_table(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`excess` as a markdown table."""
    lines = []
    for r in rows:
        ex = r["excess"]
        lines.append([r["precision"], "AdamW", f"{r['steady']['adamw']:.2f}", f"{r['peak']['adamw']:.2f}",
                      f"{ex['adamw']:.2f}", "-", "-", "-", "-"])
        lines.append([r["precision"], f"BAOC, budget {r['budget']}", f"{r['steady']['baoc']:.2f}",
                      f"{r['peak']['baoc']:.2f}", f"{ex['baoc']:.2f}", f"{r['allowed']:.2f}",
                      "yes" if ex["baoc"] <= r["allowed"] else "**no**", f"{r['state_saved']:.2f}",
                      f"{r['peak_saved']:.2f} ({r['peak_saved'] / r['state_saved']:.0%})"])
    head = ["precision", "run", "steady (B/param)", "peak (B/param)", "peak - steady", "allowed", "within",
            "state saved (B/param, corrections counted)", "peak saved (of the state's)"]
    return markdown_table(head, lines)


def trace(workload: Workload, budget: float = 0.25, steps: int = 8) -> dict[str, float]:
    """What is live at the peak of a warm-up through the controller, from torch's profiler (MiB).

    The model and its weights are made before the trace, so the live bytes counted are what the
    steps allocate: gradients, the optimizer state, the sampler's buffers and the shadow moments.
    """
    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile

    from lightning_baoc.control.controller import BAOCController

    torch.manual_seed(0)
    torch.set_num_threads(workload.threads)
    model = nn.Sequential(*[nn.Linear(workload.width, workload.width) for _ in range(workload.layers)])
    data = torch.randn(workload.batch, workload.width)
    ctl = BAOCController(memory_budget=budget, warmup_steps=steps + 100, sample_every=2,
                         capacity=workload.capacity, max_elements=workload.max_elements)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-4), model)
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            model(data).square().mean().backward()
            ctl.observe(step)
            opt.step()
    mib = 2.0**20
    out = {
        "state": opt.state_bytes() / mib,
        "gradients": 4 * workload.params / mib,
        "sampler buffers": ctl.sampler.buffer_bytes() / mib,
        "shadow moments": ctl.shadow.nbytes() / mib,
    }
    ctl.close()
    live = peak = 0
    for event in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    out["live at the peak"] = peak / mib
    out["of which not the above"] = out["live at the peak"] - sum(v for k, v in out.items() if k != "live at the peak")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[40, 100],
                        help="one workload per value: that many Linear(width, width) layers (default: 40 100)")
    parser.add_argument("--width", type=int, default=Workload.width)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--docs", action="store_true", help="write the table into docs/benchmarks/peak-memory.md")
    parser.add_argument("--trace", action="store_true",
                        help="only print what is live at the peak of a warm-up, from torch's profiler (no runs)")
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu",
                        help="where the Trainer runs (default: cpu); on cuda the figure is the allocated peak")
    parser.add_argument("--excess", action="store_true",
                        help="only the peak over the steady state: 10 x Linear(2048, 2048) (or --layers/--width), "
                        "fp32 and bf16-true, plain AdamW and BAOC at the first --budgets with its defaults, 40 "
                        "steps, the allocation at step 20 (section peak_excess[_cuda])")
    parser.add_argument("--planned", action="store_true",
                        help="only the planned peak beyond the weights against the measured allocated peak, on the "
                        "--excess run (section peak_planned[_cuda])")
    args = parser.parse_args()
    if args.planned:
        w = excess_workload(accelerator=args.accelerator)
        rows = planned_rows(w, args.budgets[0])
        body = (f"Machine: {machine()}. Command: `{command()}`\n\n**{w.layers} x Linear({w.width}, {w.width})** "
                f"({w.params:,} parameters), built under `trainer.init_module()`, BAOC at {args.budgets[0]} with its "
                f"defaults, {w.steps} steps, the allocation at step {w.warmup}. Planned: what `lightning-baoc check` "
                f"prints for the model built on the meta device, and what the callback prints at fit end "
                f"(`BAOC.memory_line()`); measured: " + ("`torch.cuda.max_memory_allocated` over `memory_allocated` at "
                "fit start; held: `memory_allocated` at a step's end" if args.accelerator == "cuda" else
                "the bytes of torch's CPU tensors from fit start, every allocation and free as torch's profiler "
                "records them (`TensorBytes`: no peak is missed), their peak over the fit-start value; held: "
                "the most at a step's end") + f".\n\n{planned_table(rows)}\n\n"
                + "\n".join(f"- {r['precision']}: `{r['line']}`" for r in rows))
        print(body)
        if args.docs:
            name = "peak_planned" if args.accelerator == "cpu" else f"peak_planned_{args.accelerator}"
            write_docs_section("benchmarks/peak-memory.md", name, body)
        return
    if args.excess:
        layers = 10 if args.layers == parser.get_default("layers") else args.layers[0]
        width = 2048 if args.width == Workload.width else args.width
        w = excess_workload(layers, width, args.accelerator)
        text = excess_table(excess(w, args.budgets[0]))
        body = (f"Machine: {machine()}. Command: `{command()}`\n\n**{w.layers} x Linear({w.width}, {w.width})** "
                f"({w.params:,} parameters), built under `trainer.init_module()`, batch {w.batch}, {w.steps} steps, BAOC's "
                f"defaults but `memory_budget` and `warmup_steps={w.warmup}`. Steady: what the run holds at the end of "
                f"its last step ({'allocated' if args.accelerator == 'cuda' else 'resident'} bytes); peak: the whole "
                f"run's; allowed: AdamW's own peak - steady + {EXCESS_ALLOWANCE} bytes per parameter.\n\n{text}")
        print(body)
        if args.docs:
            name = "peak_excess" if args.accelerator == "cpu" else f"peak_excess_{args.accelerator}"
            write_docs_section("benchmarks/peak-memory.md", name, body)
        return
    workloads = [Workload(layers=n, width=args.width, accelerator=args.accelerator) for n in args.layers]
    if args.trace:
        for name, value in trace(workloads[0], args.budgets[0]).items():
            print(f"{name:>24}: {value:8.1f} MiB")
        return
    parts = [f"Machine: {machine()}. Command: `{command()}`",
             "Allowed: budget x AdamW's peak above the baseline + the bound (`bound_bytes`: the largest tensor's "
             "fp32 state, the instruments' allowance, 2% of AdamW's fp32 state). Instruments: the sampler's "
             "buffers and the shadow moments the run held (measured)."]
    for workload in workloads:
        parts.append(section(workload, run_all(workload, args.budgets), args.budgets))
        print(parts[-1], flush=True)
    if args.docs:
        section_name = "peak_memory" if args.accelerator == "cpu" else f"peak_memory_{args.accelerator}"
        write_docs_section("benchmarks/peak-memory.md", section_name, "\n\n".join(parts))


if __name__ == "__main__":
    main()
