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
    watch: bool = False  # sample the C allocator's allocated bytes every 0.2 ms (the planned peak's comparison)

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
    load_the_code()
    cuda = workload.accelerator == "cuda"
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
    watcher = AllocatedWatcher(cuda) if workload.watch else None
    if watcher is not None:
        callbacks.insert(0, watcher)
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
    trainer.fit(net, loader)
    out: dict[str, Any] = {"run": run, "steps": trainer.global_step, "held_by_step": resident.held}
    if cuda:
        torch.cuda.synchronize()
        out["peak_device"] = torch.cuda.max_memory_allocated()
    if watcher is not None:
        out.update(watcher.stop())
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


class _Watcher:
    """The run's allocated peak from fit start: on the CPU a thread reading glibc's allocated bytes every 0.2 ms;
    on CUDA ``max_memory_allocated`` (reset at fit start) over ``memory_allocated`` then."""

    def __init__(self, cuda: bool = False) -> None:
        import threading

        from lightning_baoc.report.memory import glibc_allocated

        self.cuda = cuda
        self.allocated = glibc_allocated
        if not cuda and glibc_allocated() is None:
            raise RuntimeError("--planned needs glibc >= 2.33 (mallinfo2)")
        self.start_bytes = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def begin(self) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start_bytes = int(torch.cuda.memory_allocated())
            return
        self.start_bytes = self.peak = self.allocated()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.0002):
            self.peak = max(self.peak, self.allocated())

    def stop(self) -> dict[str, int]:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            return {"allocated_start": self.start_bytes, "allocated_peak": int(torch.cuda.max_memory_allocated())}
        self._stop.set()
        self._thread.join()
        return {"allocated_start": self.start_bytes, "allocated_peak": self.peak}


def AllocatedWatcher(cuda: bool = False) -> Any:  # noqa: N802 - a Lightning callback class built where Lightning is imported
    """A callback starting a :class:`_Watcher` at fit start (before BAOC's, which it precedes in the list)."""
    import lightning as L

    class Watch(L.Callback):
        def __init__(self) -> None:
            self.watcher = _Watcher(cuda)

        def on_fit_start(self, *_: Any) -> None:
            self.watcher.begin()

        def stop(self) -> dict[str, int]:
            return self.watcher.stop()

    return Watch()


def planned_rows(workload: Workload, budget: float) -> list[dict[str, Any]]:
    """BAOC at ``budget`` with its defaults on ``workload``, fp32 and bf16-true: the planned peak beyond the
    weights (the controller's, and ``lightning-baoc check``'s on the model built on the meta device) against
    the allocated peak measured from fit start (glibc's allocated bytes, sampled every 0.2 ms; on CUDA
    ``max_memory_allocated``)."""
    import torch
    from torch import nn

    from lightning_baoc.config.files import parse_config
    from lightning_baoc.tools.check import run_checks

    rows = []
    for precision in ("32-true", "bf16-true"):
        w = replace(workload, precision=precision, defaults=True, watch=True)
        r = measure(f"baoc:{budget}", w)
        cfg = parse_config({"baoc": {"memory_budget": budget, "warmup_steps": w.warmup},
                            "trainer": {"precision": precision, "max_steps": w.steps}})
        with torch.device("meta"):
            model = nn.Sequential(*[nn.Linear(w.width, w.width) for _ in range(w.layers)])
        budget_row = next(c for c in run_checks(cfg, model, w.accelerator) if c.name == "memory budget")
        rows.append({"precision": precision, "planned": r["planned_peak"]["total"],
                     "check": budget_row.figures["planned_peak"]["total"],
                     "measured": r["allocated_peak"] - r["allocated_start"], "line": r["memory_line"],
                     "terms": r["planned_peak"]})
    return rows


def planned_table(rows: list[dict[str, Any]]) -> str:
    """The rows of :func:`planned_rows` as a markdown table."""
    mib = 2**20
    lines = [[r["precision"], f"{r['check'] / mib:.1f}", f"{r['planned'] / mib:.1f}", f"{r['measured'] / mib:.1f}",
              f"{(r['planned'] - r['measured']) / r['measured']:+.1%}"] for r in rows]
    head = ["precision", "planned by check (MiB)", "planned at the run (MiB)", "measured allocated peak (MiB)",
            "planned - measured"]
    return markdown_table(head, lines)


def measure(run: str, workload: Workload) -> dict[str, Any]:
    """Run ``run`` in a fresh process; its report and its peak RSS in bytes (:func:`_report.run_child`)."""
    return run_child("peak_memory", "child", run, workload.__dict__)


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


def excess(workload: Workload, budget: float) -> list[dict[str, Any]]:
    """Plain AdamW and BAOC at ``budget`` with its defaults, at each precision (fp32 and bf16-true): the
    whole run's peak over its steady state (what it holds at the end of the last step), in bytes per
    parameter, against AdamW's own excess plus :data:`EXCESS_ALLOWANCE`; and the peak's saving against
    the state's (bytes per parameter, corrections counted as the budget counts them). One dict per precision."""
    key = peak_key(workload)
    n = workload.params
    out = []
    for precision in ("32-true", "bf16-true"):
        w = replace(workload, precision=precision, defaults=True)
        runs = {"adamw": measure("adamw", w), "baoc": measure(f"baoc:{budget}", w)}
        steady = {name: r["held_by_step"][-1] / n for name, r in runs.items()}
        peak = {name: r[key] / n for name, r in runs.items()}
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
                "fit start" if args.accelerator == "cuda" else "the C allocator's allocated bytes, sampled every "
                "0.2 ms from fit start, their peak over the fit-start value") + f".\n\n{planned_table(rows)}\n\n"
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
