"""Two or more versions of the CPU kernels (``lightning_baoc/kernels/cpu_step.cpp``) side by side: each
version is built as its own extension (its operators under a namespace of their own), and
a ``BlockwiseAdamW`` optimizer of each chosen format steps through each version in interleaved rounds
beside ``torch.optim.AdamW(fused=True)``, as in ``benchmarks/step_time.py``. The versions step the same
optimizer, so the same tensors at the same places in memory: on a CPU, fresh allocations of the same shapes
alone move a step's time by more than most kernel changes (``step_time.py --layouts``). It also checks that the
versions give the same bits: every version takes the same 12 steps (gradients from 1e-8 to 1e2, some
large enough to saturate the 16-bit moments, one non-finite) on a model of ragged and whole super-blocks,
and its parameters and states are compared bit for bit with the first version's.

A version is a file, or ``REV:PATH`` for the file at a git revision of this repository. Run from the
repository root:

    python benchmarks/kernel_ab.py --versions HEAD~1:lightning_baoc/kernels/cpu_step.cpp \\
        lightning_baoc/kernels/cpu_step.cpp --formats bf16 int8 --threads 1 2

Prints a table (median step, median ratio to fused AdamW over the rounds) with the machine and the
command; writes nothing.

``--kernel-only`` times the compiled operators alone: the calls one step of each format makes are recorded
once and replayed with the same arguments, against ``torch._fused_adamw_`` over the same tensors, so the
step's Python is left out. With a small model (``--layers 1 --width 256``: 65,536 weights, whose states fit
in L2) it measures the kernels' arithmetic apart from memory; the replayed calls still include the operator
call itself (about 15 us on the Zen 4 test machine, 4 us for the fused AdamW operator):

    python benchmarks/kernel_ab.py --versions lightning_baoc/kernels/cpu_step.cpp --formats int8 \
        --layers 1 --width 256 --steps 300 --rounds 31 --kernel-only
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command, file_text, machine, markdown_table  # noqa: E402

from lightning_baoc import BlockwiseAdamW, kernels  # noqa: E402


def build(version: str, where: Path) -> str:
    """Build ``version`` with the kernels' own flags under an operator namespace of its own; its name."""
    from torch.utils.cpp_extension import load

    text = file_text(version)
    tag = "baoc_ab_" + hashlib.sha1((text + " ".join(kernels.compile_flags())).encode()).hexdigest()[:10]
    text = text.replace("TORCH_LIBRARY(lightning_baoc,", f"TORCH_LIBRARY({tag},")
    text = text.replace("TORCH_LIBRARY_IMPL(lightning_baoc,", f"TORCH_LIBRARY_IMPL({tag},")
    file = where / f"{tag}.cpp"
    file.write_text(text)
    load(name=tag, sources=[str(file)], extra_cflags=kernels.compile_flags(), extra_ldflags=["-fopenmp"],
         is_python_module=False)
    return tag


def through(namespace: str, call: Callable[[], object]) -> Callable[[], None]:
    """``call`` with the optimizer's kernel operators taken from ``namespace``."""
    def run() -> None:
        original = kernels.ops
        kernels.ops = lambda: getattr(torch.ops, namespace)
        try:
            call()
        finally:
            kernels.ops = original
    return run


def recorded_calls(opt: torch.optim.Optimizer, namespace: str) -> list[tuple[Callable[..., object], tuple]]:
    """The compiled-operator calls of one step of ``opt`` through ``namespace``, each with its arguments
    (the step is taken)."""
    operators, calls = getattr(torch.ops, namespace), []

    class Recorder:
        def __getattr__(self, name: str) -> Callable[..., object]:
            operator = getattr(operators, name)

            def call(*args: object) -> object:
                calls.append((operator, args))
                return operator(*args)
            return call

    original = kernels.ops
    kernels.ops = Recorder
    try:
        opt.step()
    finally:
        kernels.ops = original
    return calls


def replay(calls: list[tuple[Callable[..., object], tuple]]) -> Callable[[], None]:
    """The recorded operator calls, called again with the same arguments."""
    if not calls:
        raise ValueError("the step called no compiled operator (no parameter had a gradient, or the eager step "
                         "ran): --kernel-only has nothing to time")

    def run() -> None:
        for operator, args in calls:
            operator(*args)
    return run


def fused_adamw(params: list[torch.Tensor]) -> Callable[[], None]:
    """``torch._fused_adamw_`` over ``params``, their gradients and zeroed moments of their own."""
    grads = [p.grad for p in params]
    m, v = [torch.zeros_like(p) for p in params], [torch.zeros_like(p) for p in params]
    steps = [torch.tensor(1.0) for _ in params]

    def run() -> None:
        torch._fused_adamw_(params, grads, m, v, [], steps, lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.01,
                            eps=1e-8, amsgrad=False, maximize=False)
    return run


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}.get(t.element_size(), t.dtype)) if t.is_floating_point() else t


def same_results(fmt: str, namespaces: list[str], dtype: torch.dtype, correction: str) -> list[bool]:
    """Whether each version's parameters (and master-weight corrections) and states equal the first
    version's, bit for bit, after 12 steps."""
    results = []
    for namespace in namespaces:
        torch.manual_seed(0)
        model = nn.ModuleDict({"a": nn.Linear(1000, 37), "b": nn.Linear(64, 64), "c": nn.Linear(3, 5)}).to(dtype)
        opt = BlockwiseAdamW(model.named_parameters(), state_format=fmt, lr=1e-2, min_8bit_numel=0,
                             skip_nonfinite=False, weight_correction=correction)
        gen = torch.Generator().manual_seed(1)
        params = list(model.parameters())
        for step in range(12):
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * 10.0 ** torch.randint(-8, 3, p.shape, generator=gen)).to(dtype)
            if step in (5, 8):  # squares past fp32's range: saturated 16-bit moments
                params[2].grad[0, :4] = torch.tensor([3e38, -3e38, 1e20, -1e20])
            if step == 9:
                params[4].grad[0, 0] = float("nan")
            through(namespace, opt.step)()
        state = [_bits(t) for record in opt.state_dict()["state"].values() for _, t in sorted(record["tensors"].items())]
        if correction != "none":  # the master-weight corrections beside the weights
            state += [opt._records[p].master_correction.clone() for p in params]  # noqa: SLF001
        results.append(([_bits(p.detach().clone()) for p in params], state))
    first = results[0]
    return [all(torch.equal(a, b) for a, b in zip(first[0] + first[1], r[0] + r[1])) for r in results]


def _ms(seconds: float) -> str:
    """Milliseconds, to 0.1 ms, or to the microsecond below 1 ms."""
    return f"{seconds * 1e3:.1f}" if seconds >= 1e-3 else f"{seconds * 1e3:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--versions", nargs="+", required=True, help="files, or REV:PATH at a git revision")
    parser.add_argument("--formats", nargs="+", default=["bf16", "int8"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024, help="each layer is a Linear(width, width)")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bf16-weights", action="store_true", help="a bf16 model (fused AdamW's states are bf16)")
    parser.add_argument("--correction", default="none", help="master-weight correction with --bf16-weights: none, ecc8, ecc16")
    parser.add_argument("--kernel-only", action="store_true",
                        help="time the compiled operators' calls alone, against torch._fused_adamw_")
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.bf16_weights else torch.float32
    if not kernels.cpu_kernels().available:
        sys.exit(f"no compiled kernels here: {kernels.cpu_kernels().detail}")
    with tempfile.TemporaryDirectory() as tmp:
        namespaces = [build(v, Path(tmp)) for v in args.versions]
    equal = {fmt: same_results(fmt, namespaces, dtype, args.correction) for fmt in args.formats}
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)]).to(dtype)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape) * 1e-3).to(dtype)
    reference = fused_adamw(list(model.parameters())) if args.kernel_only else \
        torch.optim.AdamW(model.parameters(), fused=True).step
    fused = "torch._fused_adamw_" if args.kernel_only else "torch AdamW fused"
    steps: dict[str, Callable[[], None]] = {fused: reference}
    for fmt in args.formats:
        # one optimizer per format that every version steps: the same tensors at the same places in memory
        opt = BlockwiseAdamW(model.named_parameters(), state_format=fmt, weight_correction=args.correction)
        for i, namespace in enumerate(namespaces):
            steps[f"{fmt} / version {i + 1}"] = replay(recorded_calls(opt, namespace)) if args.kernel_only else \
                through(namespace, opt.step)
    rows = {label: [] for label in steps}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for step in steps.values():
            step()
        order, ratios, times = list(steps), {k: [] for k in steps}, {k: [] for k in steps}
        rng = random.Random(0)
        for _ in range(args.rounds):
            rng.shuffle(order)
            medians = {}
            for label in order:
                spent = []
                for _ in range(args.steps):
                    start = time.perf_counter()
                    steps[label]()
                    spent.append(time.perf_counter() - start)
                medians[label] = statistics.median(spent)
            for label in steps:
                times[label].append(medians[label])
                ratios[label].append(medians[label] / medians[fused])
        for label in steps:
            rows[label] += [_ms(statistics.median(times[label])), f"{statistics.median(ratios[label]):.2f}x"]
    headers = ["optimizer / version", "same bits as version 1"]
    for threads in args.threads:
        headers += [f"{threads} thread(s): median step (ms)", f"{threads} thread(s): vs fused"]
    table = [[label, "" if " / version " not in label else
              ("yes" if equal[label.split(" / ")[0]][int(label.rsplit(" ", 1)[1]) - 1] else "NO"), *cells]
             for label, cells in rows.items()]
    print("Versions: " + ", ".join(f"{i + 1}: {v}" for i, v in enumerate(args.versions)))
    print(markdown_table(headers, table))
    print(f"\nMachine: {machine()}. Command: `{command()}`")


if __name__ == "__main__":
    main()
