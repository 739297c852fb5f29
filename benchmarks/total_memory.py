"""Total training memory per parameter: weights, corrections, gradients and states, measured.

A 42M-parameter model (40 square 1024 x 1024 linear layers with biases) trains a few steps on random
data in a plain loop, each configuration in its own process. Two measurements per run:

- from storages, after the last step (:func:`lightning_baoc.training_memory`): the bytes of the
  weights, the gradients, the optimizer's states and the master-weight corrections, per parameter;
- the whole run: the peak resident set of the process (``os.wait4``) above a baseline process that
  loads the same code and builds no model, per parameter (allocator slack, activations and the
  step's transients included); and the same less what a stateless run (plain SGD on the bf16 model)
  holds beyond its weights and gradients (its activations and allocator slack), which every run pays
  alike: what is left is the weights, corrections, gradients, states and the step's transients.

Runs: fp32 weights with torch AdamW (the 16 bytes of mixed-precision AdamW's master copy: weight 4,
gradient 4, m 4, v 4); bf16 weights with torch AdamW (its states follow the weights: bf16); bf16
weights with BlockwiseAdamW in int8 states, without a correction, with ``ecc8`` and with ``ecc16``, and
with ``ecc8`` and gradient release (each parameter stepped in backward, its gradient freed at once); BAOC
at 0.15 of fp32 AdamW's state with the user's ``ecc8`` outside the budget, and with the corrections chosen
per block inside it (``BAOC(corrections=[...])``).

On a GPU (``--device cuda``) the whole-run figure is the peak of ``torch.cuda.max_memory_allocated()``
(the device's allocated storage, read in the run's process) above the baseline process's, instead of
the peak resident set.

Example::

    python benchmarks/total_memory.py --docs
    python benchmarks/total_memory.py --device cuda --docs     # section total_memory_cuda
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _report import command, machine, markdown_table, run_child, write_docs_section

RUNS = {
    "baseline": "the code loaded, no model",
    "torch SGD, bf16 weights": "bf16 weights and gradients, no state (the stateless reference)",
    "torch AdamW, fp32 weights": "fp32 weights and gradients, fp32 states",
    "torch AdamW, bf16 weights": "bf16 weights and gradients, bf16 states",
    "BlockwiseAdamW int8, bf16 weights": "bf16 weights and gradients, int8 states, no correction",
    "BlockwiseAdamW int8, bf16 weights + ecc8": "the same with an 8-bit correction",
    "BlockwiseAdamW int8, bf16 weights + ecc16": "the same with a 16-bit correction",
    "BlockwiseAdamW int8, bf16 weights + ecc8, gradient release": "ecc8, each gradient freed in backward once stepped",
    "BAOC at 0.15 of fp32 AdamW state, bf16 weights + ecc8, gradient release":
        "BAOC's allocation within 1.2 bytes of state per parameter (ecc8 set by the user on every weight)",
    "BAOC at 0.15 of fp32 AdamW state, bf16 weights, corrections chosen per block, gradient release":
        "BAOC's allocation of states and corrections together within 1.2 bytes per parameter "
        "(BAOC(corrections=['none', 'ecc8', 'ecc16']))",
}
BAOC_BUDGET = 0.15  # of fp32 AdamW's 8 bytes of state per parameter


@dataclass(frozen=True)
class Workload:
    """``layers`` square linear layers of ``width`` (with biases), ``steps`` steps of batch ``batch``."""

    layers: int = 40
    width: int = 1024
    batch: int = 16
    steps: int = 6
    threads: int = 1
    device: str = "cpu"
    history: str = ""  # on a GPU: a folder for each run's CUDA memory history (what is live at the peak)

    @property
    def params(self) -> int:
        return self.layers * (self.width * self.width + self.width)


def child(run: str, workload: Workload) -> dict[str, Any]:
    """One run in this process: its storages per parameter after the last step."""
    import torch
    from torch import nn

    from lightning_baoc import BlockwiseAdamW, training_memory
    from lightning_baoc.control.controller import BAOCController

    torch.set_num_threads(workload.threads)
    device = torch.device(workload.device)
    cuda = device.type == "cuda"
    warm = nn.Linear(64, 64).to(device, torch.bfloat16)  # the code of every run, loaded in the baseline too
    opt = BlockwiseAdamW(warm.named_parameters(), state_format="int8", min_8bit_numel=0, weight_correction="ecc8")
    warm(torch.randn(2, 64, dtype=torch.bfloat16, device=device)).float().sum().backward()
    opt.step()
    torch.optim.AdamW(warm.parameters(), fused=True).step()
    del warm, opt
    if cuda:  # what stays allocated after the warm-up (the libraries' workspaces) is in every run
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    if run == "baseline":
        return {"peak_device": torch.cuda.memory_allocated()} if cuda else {}
    if cuda and workload.history:  # every allocation and free of the run, with its Python stack
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
    torch.manual_seed(0)
    dtype = torch.float32 if "fp32 weights" in run else torch.bfloat16
    model = nn.Sequential(*[nn.Linear(workload.width, workload.width) for _ in range(workload.layers)]).to(device, dtype)
    if run.startswith("torch SGD"):
        optimizer: Any = torch.optim.SGD(model.parameters(), lr=1e-4)
    elif run.startswith("torch"):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    elif run.startswith("BAOC"):
        chosen = "chosen per block" in run
        controller = BAOCController(memory_budget=int(BAOC_BUDGET * 8 * workload.params), warmup_steps=3, sample_every=1,
                                    corrections=["none", "ecc8", "ecc16"] if chosen else None)
        user = BlockwiseAdamW(model.named_parameters(), lr=1e-4, weight_correction="none" if chosen else "ecc8")
        optimizer = controller.install(user, model)
        optimizer.release_gradients()
    else:
        correction = run.split("+ ", 1)[1].split(",")[0] if "+ " in run else "none"
        optimizer = BlockwiseAdamW(model.named_parameters(), lr=1e-4, state_format="int8", weight_correction=correction)
        if "gradient release" in run:
            optimizer.release_gradients()
    gen = torch.Generator().manual_seed(1)
    for step in range(workload.steps):
        if run.startswith("BAOC"):  # the framework-free lifecycle, as BAOCStrategy runs it
            controller.before_step(step)
            controller.open_released_step(step)
        optimizer.zero_grad(set_to_none=False)
        x = torch.randn(workload.batch, workload.width, generator=gen).to(device, dtype)
        model(x).float().square().mean().backward()
        if run.startswith("BAOC"):
            controller.close_released_step()
        optimizer.step()
        if run.startswith("BAOC"):
            controller.maybe_allocate(step + 1)
    out = training_memory(model, optimizer).to_dict()
    if cuda:
        torch.cuda.synchronize()
        out["peak_device"] = torch.cuda.max_memory_allocated()
        if workload.history:
            Path(workload.history).mkdir(parents=True, exist_ok=True)
            slug = "".join(c if c.isalnum() else "_" for c in run.lower())[:80]
            torch.cuda.memory._dump_snapshot(str(Path(workload.history) / f"{slug}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None)
    if run.startswith("BAOC"):
        formats = list(optimizer.formats().values())
        out["allocation"] = {f: formats.count(f) for f in sorted(set(formats))}
        summary = controller.summary()  # the figures BAOC.summary() gives a Lightning run
        out["phase"], out["budget"] = summary.phase, summary.memory_budget_bytes
    return out


def run_all(workload: Workload) -> dict[str, dict[str, Any]]:
    results = {}
    for run in RUNS:
        results[run] = run_child("total_memory", "child", run, workload.__dict__)
        print(run, results[run], flush=True)
    return results


def table(workload: Workload, results: dict[str, dict[str, Any]]) -> str:
    n = workload.params
    peak = _peak_key(workload)
    base = results["baseline"][peak]
    sgd = results["torch SGD, bf16 weights"]
    stateless = sgd[peak] - (sgd["weights"] + sgd["gradients"])  # the run's own: activations, slack
    rows = []
    for run, what in RUNS.items():
        if run == "baseline":
            continue
        r = results[run]
        parts = [r["weights"], r["corrections"], r["gradients"], r["states"]]
        rows.append([run, what, *[f"{b / n:.3f}" for b in parts], f"{sum(parts) / n:.3f}", f"{(r[peak] - base) / n:.2f}",
                     f"{(r[peak] - stateless) / n:.2f}"])
    headers = ["run", "what it holds", "weights", "corrections", "gradients", "states",
               "total (storages)",
               f"whole run (peak {'CUDA allocated' if peak == 'peak_device' else 'RSS'} above the baseline)",
               "whole run less the stateless run's activations and slack"]
    return markdown_table(headers, rows)


def _peak_key(workload: Workload) -> str:
    """The whole-run figure of a run's result: the device's allocated peak on a GPU, else the peak RSS."""
    return "peak_device" if workload.device.startswith("cuda") else "peak_rss"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=Workload.layers)
    parser.add_argument("--steps", type=int, default=Workload.steps)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the model trains")
    parser.add_argument("--docs", action="store_true", help="write the table into docs/benchmarks/total-memory.md")
    parser.add_argument("--memory-history", default="", metavar="DIR",
                        help="on a GPU: write each run's CUDA memory history into DIR (a snapshot to read what is live at the peak)")
    args = parser.parse_args()
    workload = Workload(layers=args.layers, steps=args.steps, device=args.device, history=args.memory_history)
    results = run_all(workload)
    body = (
        f"Bytes per parameter, {workload.params / 1e6:.1f}M parameters ({workload.layers} x "
        f"Linear({workload.width}, {workload.width})), {workload.steps} steps of batch {workload.batch}, "
        f"{workload.threads} torch thread(s), each run in its own process{' on the GPU' if args.device == 'cuda' else ''}; "
        f"baseline {'CUDA allocated' if _peak_key(workload) == 'peak_device' else 'peak resident set'} "
        f"{results['baseline'][_peak_key(workload)] / 2**20:.0f} MiB.\n\n"
        f"Machine: {machine()}. Command: `{command()}`\n\n{table(workload, results)}"
    )
    print(body)
    if args.docs:
        section = "total_memory" if args.device == "cpu" else f"total_memory_{args.device}"
        write_docs_section("benchmarks/total-memory.md", section, body)


if __name__ == "__main__":
    main()
