"""The host's work of ``BlockwiseAdamW.step()`` per tensor, with the kernels' calls taken out.

On a GPU the compact formats' step is bound by the host's Python per tensor, not by its kernels
(``benchmarks/cuda_profile.py``: ``int8`` spends nearly all of its step on the host). This measures that
work on any machine: the model's tensors live on the CPU and the step takes either path with its kernel
calls replaced by ones that return at once:

* ``compiled``: the CPU path (the C++ kernel's call, ``kernels.ops().adamw_step``, taken out);
* ``device``: the GPU's path (the device decides each tensor's skip, one Triton launch per format: the
  launch, ``triton_step._adamw_tensors``, taken out), with the CPU standing in for the GPU;
* ``graph``: the GPU's path captured (``lightning_baoc/optim/graph_step.py``, through its tape backend) and
  replayed, the replay itself taken out (on a GPU one call of the CUDA graph): what is left is the host's checks
  and the step's columns, a fixed number of Python and numpy operations.

Everything else runs as it does: the formats' decisions, the counts, the finiteness flags, the launch's
table. Of its device work, the flags' reduction over the gradients (``torch._foreach_norm``: a pass over every
gradient here, one launch per step on a GPU) is taken out too (it returns zeros, all finite), and timed alone
on the row ``finiteness flags``; torch's fused AdamW for fp32 tensors (one call over all of them, whose
``found_inf`` is the flag of any; the Triton launch that then steps the finite ones where it is set is taken
out) is not taken out, so the ``fp32`` device figure holds its kernel's work.
``torch.optim.AdamW(fused=True)``'s whole step on the same tensors is the yardstick (its kernel included).
Each optimizer's steps alternate in rounds; the figure is the median over the rounds of each round's fastest
step, in microseconds per tensor.

Example::

    python benchmarks/step_host.py --layers 400 --width 64
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from unittest import mock

import torch
from _report import command, machine, markdown_table
from torch import nn

from lightning_baoc import BlockwiseAdamW, kernels
from lightning_baoc.optim import stepping


class _NoKernel:
    """``kernels.ops()`` whose AdamW step returns at once (nothing skipped)."""

    @staticmethod
    def adamw_step(*args: object) -> list[int]:
        return []


class _FiniteNorms:
    """``torch._foreach_norm`` that returns zeros at once (every gradient finite), the same tensors each call."""

    def __init__(self) -> None:
        self.zeros: dict[int, list[torch.Tensor]] = {}

    def __call__(self, tensors: list[torch.Tensor], *args: object, **kwargs: object) -> list[torch.Tensor]:
        if len(tensors) not in self.zeros:
            self.zeros[len(tensors)] = [torch.zeros(()) for _ in tensors]
        return self.zeros[len(tensors)]


class _NoLaunch:
    """A Triton kernel whose launch returns at once."""

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: None


def _stubbed(path: str, step: Callable[[], object]) -> Callable[[], float]:
    """``step`` with ``path``'s kernel calls taken out (``path``: compiled or device); it returns the
    step's time in seconds (the stubs' set-up not counted)."""
    norms = _FiniteNorms()

    def run() -> float:
        with ExitStack() as stack:
            if path == "compiled":
                stack.enter_context(mock.patch.object(kernels, "ops", lambda: _NoKernel()))
            else:
                from lightning_baoc.kernels import triton_step

                stack.enter_context(mock.patch.object(kernels, "TRITON_DEVICES", {"cuda", "cpu"}))
                stack.enter_context(mock.patch.object(stepping, "kernel_serves", lambda *args: False))
                stack.enter_context(mock.patch.object(triton_step, "_adamw_tensors", _NoLaunch()))
                stack.enter_context(mock.patch.object(torch, "_foreach_norm", norms))
            return _timed(step)()
    return run


def _timed(step: Callable[[], object]) -> Callable[[], float]:
    """``step``, returning its time in seconds."""
    def run() -> float:
        start = time.perf_counter()
        step()
        return time.perf_counter() - start
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=400)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--formats", nargs="+", default=["fp32", "bf16", "int8"])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10, help="steps of each optimizer per round")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    steps: dict[str, Callable[[], float]] = {"torch AdamW fused (whole step)": _timed(torch.optim.AdamW(params, fused=True).step)}
    # the device path's finiteness flags (StepDispatcher._device_flags): device work, a few launches on a GPU, a pass
    # over every gradient here, taken out of the device path's figures
    grads = [p.grad for p in params]
    steps["finiteness flags (device work)"] = _timed(
        lambda: torch.stack(torch._foreach_norm(grads, ord=float("inf"), dtype=torch.float32)).mul_(0.0).nan_to_num_(nan=1.0))
    for path in ("compiled", "device", "graph"):
        if path != "compiled":
            from lightning_baoc.kernels import triton_common

            if not triton_common.triton_status()[0]:
                print(f"device path left out: {triton_common.triton_status()[1]}")
                continue
        for fmt in args.formats:
            opt = BlockwiseAdamW(model.named_parameters(), state_format=fmt, kernels="compiled" if path == "compiled" else "auto")
            step = _stubbed("compiled" if path == "compiled" else "device", opt.step)
            if path == "graph":
                from lightning_baoc.optim.graph_step import TapeBackend

                tape = TapeBackend()
                opt._stepper.graphs.backend_for = lambda device: tape  # noqa: SLF001
                for _ in range(3):  # two steady steps, then the capture
                    step()
                graphs = opt._stepper.graphs  # noqa: SLF001
                if graphs.current is None or graphs.current.graph is None:
                    raise SystemExit(f"{fmt}: the step was not captured ({graphs.off_reason})")
                graphs.current.graph.replay = lambda: None  # the graph's own work: one call on a GPU
            steps[f"{fmt}, {path} path (host only)"] = step
    for step in steps.values():  # the states made, the decisions taken
        step()
        step()
    best: dict[str, list[float]] = {label: [] for label in steps}
    order = list(steps)
    rng = random.Random(0)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for label in order:
            best[label].append(min(steps[label]() for _ in range(args.steps)))
    tensors = len(params)
    rows = [[label, f"{statistics.median(times) * 1e3:.2f}", f"{statistics.median(times) / tensors * 1e6:.2f}"]
            for label, times in best.items()]
    print(f"Host work per step, {tensors} tensors ({args.layers} x Linear({args.width}, {args.width})), 1 torch thread: "
          f"{args.rounds} rounds of {args.steps} steps of each optimizer; the median over the rounds of each round's fastest step.\n")
    print(markdown_table(["optimizer / path", "step (ms)", "per tensor (us)"], rows))
    print(f"\nMachine: {machine()}. Command: `{command()}`")


if __name__ == "__main__":
    main()
