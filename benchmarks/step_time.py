"""Optimizer step time of every state format against torch.optim.AdamW (fused and foreach) and the
8-bit optimizers of bitsandbytes and torchao.

A 21M-parameter model of 20 square 1024x1024 linear layers (with biases) gets random gradients.
Every optimizer is built once over the same parameters and warmed up; then, at each torch thread
count, the optimizers take turns in rounds (a shuffled order each round, a few steps each), so
that a background load slows them all alike. Each optimizer's time is its median step over all
rounds, and its ratio to ``torch.optim.AdamW(fused=True)`` the median over rounds of its round
median divided by fused AdamW's round median, measured in the same round. Results go into the
section ``step_time`` of ``docs/benchmarks/step-time.md``.

A step's time on a CPU also depends on where its tensors land in physical memory: the same code on
three fresh allocations of the same shapes measured from 1.11x to 1.30x fused AdamW in one run
(``bf16_momentum`` at 1 thread).
``--layouts N`` builds the model and every optimizer N times (N such allocations, each optimizer
against the fused AdamW of its own copy), times them all in the same shuffled rounds and pools the
ratios; the page then also gives each format's range of per-layout medians.

Beside the times: the machine's memory bandwidth at each thread count (a 512 MiB ``copy_``, bytes
read and written per second) and the rate at which fused AdamW moves its 28 bytes per parameter
(it reads parameter, gradient and both moments and writes three of them); and how the compiled
kernels were obtained (built, with the build time, or loaded from the cache). The peers (``pip install -e ".[bench]"``) are rows marked unavailable, with
the reason, where they are not installed.

Run from the repository root:

    python benchmarks/step_time.py            # 21M parameters, 1 and 2 threads, 15 rounds of 3 steps
    python benchmarks/step_time.py --quick    # a 2M-parameter smoke run (writes no docs page)
    python benchmarks/step_time.py --layouts 3   # three copies of the model and optimizers, ratios pooled
    python benchmarks/step_time.py --bf16-weights   # bf16 weights: master-weight corrections (its own section)
    python benchmarks/step_time.py --momentum       # SGD and Lion against torch's fused SGD (its own section)
    python benchmarks/step_time.py --device cuda --threads 1   # on a GPU (sections *_cuda; steps synchronized)
    python benchmarks/step_time.py --layers 400 --width 64 --threads 1   # 800 small tensors: the host's work
                                                                         # per parameter (section step_time_400x64)
    python benchmarks/step_time.py --shapes gpt2-small --device cuda --threads 1   # a shape set (section
                                                                         # step_time_gpt2-small_cuda)

Shape sets (``--shapes``): ``square`` (the default: ``--layers`` x Linear(``--width``)), ``gpt2-small`` (GPT-2
small's 124M parameters in its 148 tensors), ``ragged`` (21M parameters in 33 tensors unlike the square
layers: an embedding, wide, narrow, odd-sized and 1-D ones), ``many`` (1,000 tensors of 4,096 elements: the
host's work per tensor). On a GPU each format's row is its default step (captured in a CUDA graph from its
third step: ``lightning_baoc/optim/graph_step.py``; the capture's time and the steps replayed are given), and
a row ``(planned)`` the same step with graphs off.

On a machine whose cores are busy with other work, prefix ``OMP_WAIT_POLICY=PASSIVE`` (recorded
beside the command on the page): with OpenMP's default spinning, every parallel region at 2 threads waits
for a thread the OS has descheduled, and the 2-thread times measure the scheduler (measured on a
2-core machine with one core busy: fused AdamW 156 ms instead of 13 ms, an int8 step 34 s).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch
from torch import nn

# this checkout's package, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _report import command, machine, markdown_table, write_docs_section  # noqa: E402

from lightning_baoc import FORMATS, BlockwiseAdamW, kernels  # noqa: E402
from lightning_baoc.kernels import TRITON_SERVED  # noqa: E402

FUSED = "torch AdamW fused"
FOREACH = "torch AdamW foreach"
BNB = "bitsandbytes AdamW8bit"
TORCHAO = "torchao AdamW8bit"
FLASHOPTIM = "FlashOptim FlashAdamW"
NO_TEST = "fp32, skip_nonfinite=False"


#: Where the optimizers step (``--device``).
DEVICE = torch.device("cpu")


def shape_set(name: str) -> list[tuple[str, tuple[int, ...]]]:
    """The named tensors of a shape set (``--shapes``) but ``square``."""
    if name == "gpt2-small":
        d, vocab, context, layers = 768, 50257, 1024, 12
        out = [("wte", (vocab, d)), ("wpe", (context, d))]
        for i in range(layers):
            out += [(f"h{i}.ln_1.weight", (d,)), (f"h{i}.ln_1.bias", (d,)),
                    (f"h{i}.attn.c_attn.weight", (d, 3 * d)), (f"h{i}.attn.c_attn.bias", (3 * d,)),
                    (f"h{i}.attn.c_proj.weight", (d, d)), (f"h{i}.attn.c_proj.bias", (d,)),
                    (f"h{i}.ln_2.weight", (d,)), (f"h{i}.ln_2.bias", (d,)),
                    (f"h{i}.mlp.c_fc.weight", (d, 4 * d)), (f"h{i}.mlp.c_fc.bias", (4 * d,)),
                    (f"h{i}.mlp.c_proj.weight", (4 * d, d)), (f"h{i}.mlp.c_proj.bias", (d,))]
        return out + [("ln_f.weight", (d,)), ("ln_f.bias", (d,))]
    if name == "ragged":
        shapes = [(32000, 256)] + [(256, 8192)] * 2 + [(8192, 64)] * 4 + [(1023, 1025)] * 4 + [(777, 1111)] * 2
        shapes += [(3001,)] * 8 + [(17,)] * 8 + [(1,)] * 4
        return [(f"t{i}", shape) for i, shape in enumerate(shapes)]
    if name == "many":
        return [(f"t{i}", (4096,)) for i in range(1000)]
    raise SystemExit(f"--shapes: unknown set {name!r}; one of square, gpt2-small, ragged, many")


class Tensors(nn.Module):
    """Named parameters of given shapes (a shape set), nothing else."""

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]]) -> None:
        super().__init__()
        for name, shape in shapes:
            self.register_parameter(name.replace(".", "_"), nn.Parameter(torch.randn(shape) * 0.02))


def build(layers: int, width: int, shapes: str = "square") -> nn.Module:
    torch.manual_seed(0)
    if shapes == "square":
        model: nn.Module = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    else:
        model = Tensors(shape_set(shapes))
    model = model.to(DEVICE)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def optimizers(model: nn.Module) -> dict[str, tuple[torch.optim.Optimizer, float]]:
    """Label -> (optimizer over ``model``'s parameters, state bytes per parameter)."""
    out: dict[str, tuple[torch.optim.Optimizer, float]] = {
        FUSED: (torch.optim.AdamW(model.parameters(), fused=True), 8.0),
        FOREACH: (torch.optim.AdamW(model.parameters(), foreach=True), 8.0),
    }
    n = sum(p.numel() for p in model.parameters())
    for fmt in FORMATS:
        opt = BlockwiseAdamW(model.named_parameters(), state_format=fmt)
        opt.step()  # states exist from here: their bytes are known
        out[fmt] = (opt, opt.state_bytes() / n)
        if DEVICE.type == "cuda" and FORMATS[fmt].kernel_kinds in TRITON_SERVED:  # the step the kernels replace
            eager = BlockwiseAdamW(model.named_parameters(), state_format=fmt, kernels="eager")
            eager.step()
            out[f"{fmt} (eager)"] = (eager, eager.state_bytes() / n)
            planned = BlockwiseAdamW(model.named_parameters(), state_format=fmt)
            planned._stepper.graphs.policy = "off"  # the planned step alone  # noqa: SLF001
            planned.step()
            out[f"{fmt} (planned)"] = (planned, planned.state_bytes() / n)
    # what the per-parameter non-finite test costs: the fp32 step without it
    unchecked = BlockwiseAdamW(model.named_parameters(), state_format="fp32", skip_nonfinite=False)
    unchecked.step()
    out[NO_TEST] = (unchecked, unchecked.state_bytes() / n)
    for label, make in ((BNB, _bnb), (TORCHAO, _torchao), (FLASHOPTIM, _flashoptim)):
        try:
            peer = make(model)
            peer.step()
        except Exception as err:  # not installed, or no CPU kernel in this version
            UNAVAILABLE[label] = f"{type(err).__name__}: {str(err).splitlines()[0][:80]}" if str(err) else type(err).__name__
            continue
        out[label] = (peer, _state_bytes(peer) / n)
    return out


#: bf16-weight rows: (label, state format, master-weight correction).
BF16_ROWS = [
    ("int8", "int8", "none"), ("int8 + ecc8", "int8", "ecc8"), ("int8 + ecc16", "int8", "ecc16"),
    ("bf16", "bf16", "none"), ("bf16 + ecc8", "bf16", "ecc8"), ("fp32 + ecc8", "fp32", "ecc8"),
]


def bf16_optimizers(model: nn.Module) -> dict[str, tuple[torch.optim.Optimizer, float]]:
    """Over a bf16 model: torch AdamW (fused; its states are bf16) and BlockwiseAdamW with corrections;
    label -> (optimizer, state and correction bytes per parameter)."""
    n = sum(p.numel() for p in model.parameters())
    fused = torch.optim.AdamW(model.parameters(), fused=True)
    fused.step()
    out: dict[str, tuple[torch.optim.Optimizer, float]] = {FUSED: (fused, _state_bytes(fused) / n)}
    for label, fmt, correction in BF16_ROWS:
        opt = BlockwiseAdamW(model.named_parameters(), state_format=fmt, weight_correction=correction)
        opt.step()
        out[label] = (opt, (opt.state_bytes() + opt.weight_correction_bytes()) / n)
    return out


SGD_FUSED = "torch SGD fused"
#: The SGD and Lion rows of ``--momentum``: label -> (class, momentum format).
MOMENTUM_ROWS = [(f"Blockwise{rule} {fmt}", rule, fmt) for rule in ("SGD", "Lion") for fmt in ("fp32", "bf16", "int8", "none")]


def momentum_optimizers(model: nn.Module) -> dict[str, tuple[torch.optim.Optimizer, float]]:
    """torch's SGD (fused, foreach; momentum 0.9) and BlockwiseSGD / BlockwiseLion in every momentum
    format; label -> (optimizer, state bytes per parameter)."""
    from lightning_baoc import BlockwiseLion, BlockwiseSGD

    n = sum(p.numel() for p in model.parameters())
    out: dict[str, tuple[torch.optim.Optimizer, float]] = {}
    for label, fused in ((SGD_FUSED, True), ("torch SGD foreach", False)):
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9, fused=fused, foreach=not fused)
        opt.step()
        out[label] = (opt, _state_bytes(opt) / n)
    for label, rule, fmt in MOMENTUM_ROWS:
        if rule == "SGD":
            opt = BlockwiseSGD(model.named_parameters(), lr=1e-3, momentum=0.9, state_format=fmt)
        else:
            opt = BlockwiseLion(model.named_parameters(), lr=1e-4, state_format=fmt)
        opt.step()
        out[label] = (opt, opt.state_bytes() / n)
    return out


#: Peer label -> why it is not in the table.
UNAVAILABLE: dict[str, str] = {}


def _bnb(model: nn.Module) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(model.parameters())


def _torchao(model: nn.Module) -> torch.optim.Optimizer:
    from torchao.optim import AdamW8bit

    return AdamW8bit(model.parameters())


def _flashoptim(model: nn.Module) -> torch.optim.Optimizer:
    from flashoptim import FlashAdamW  # type: ignore[import-not-found]

    return FlashAdamW(model.parameters())


def graph_notes(built: dict[str, tuple[torch.optim.Optimizer, float]]) -> str:
    """Each format's CUDA graph: its captures, their time on the host, and the steps it replayed (or why it is off)."""
    parts = []
    for label, (opt, _) in built.items():
        graphs = getattr(getattr(opt, "_stepper", None), "graphs", None)
        if graphs is None or graphs.policy == "off" or label.endswith("(eager)"):
            continue
        if graphs.captures:
            seconds = ", ".join(f"{s * 1e3:.0f}" for s in graphs.capture_seconds)
            parts.append(f"{label}: {graphs.captures} capture(s) ({seconds} ms), {graphs.replays} steps replayed")
        else:
            parts.append(f"{label}: no graph ({graphs.off_reason or 'its steps are not all planned'})")
    return " CUDA graphs: " + "; ".join(parts) + "." if parts else ""


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in a torch optimizer's state (through tensor subclasses' inner tensors)."""
    total = 0
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                inner = [getattr(value, name) for name in getattr(value, "__tensor_flatten__", lambda: ([], None))()[0]]
                total += sum(t.numel() * t.element_size() for t in inner) if inner else value.numel() * value.element_size()
    return total


def bandwidth() -> float:
    """Bytes per second of a 512 MiB copy (read + write), the best of 5."""
    src = torch.ones(1 << 27, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(time_steps(lambda: dst.copy_(src), 5))
    return 2 * src.numel() * src.element_size() / best


def _synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def time_steps(step: Callable[[], object], steps: int) -> list[float]:
    """Wall seconds of each of ``steps`` calls of ``step`` (the device's queue drained around each)."""
    times = []
    for _ in range(steps):
        _synchronize()
        start = time.perf_counter()
        step()
        _synchronize()
        times.append(time.perf_counter() - start)
    return times


class Timing(NamedTuple):
    """What :func:`interleaved` measured, per label."""

    seconds: dict[str, float]  # median step over every round and layout
    ratios: dict[str, float]  # median over rounds and layouts of the step / the reference's in the same ones
    layouts: dict[str, list[float]]  # each layout's median ratio


def pooled(medians: list[dict[tuple[str, int], float]], reference: str) -> Timing:
    """Pool rounds of (label, layout) -> median step: each step against the reference's of its own round and layout."""
    labels = sorted({label for round_ in medians for label, _ in round_})
    times: dict[str, list[float]] = {label: [] for label in labels}
    ratios: dict[str, list[float]] = {label: [] for label in labels}
    by_layout: dict[str, dict[int, list[float]]] = {label: {} for label in labels}
    for round_ in medians:
        for (label, layout), median in round_.items():
            ratio = median / round_[(reference, layout)]
            times[label].append(median)
            ratios[label].append(ratio)
            by_layout[label].setdefault(layout, []).append(ratio)
    return Timing(
        {label: statistics.median(t) for label, t in times.items()},
        {label: statistics.median(r) for label, r in ratios.items()},
        {label: [statistics.median(by_layout[label][k]) for k in sorted(by_layout[label])] for label in labels},
    )


def interleaved(
    opts: dict[str, list[torch.optim.Optimizer | None]], rounds: int, steps: int, seed: int = 0, reference: str = FUSED
) -> Timing:
    """Round-robin timing of label -> its optimizer in each layout (None where it could not be built):
    every (label, layout) steps ``steps`` times per round, in an order shuffled each round; pooled by
    :func:`pooled`."""
    order = [(label, k) for label, group in opts.items() for k, opt in enumerate(group) if opt is not None]
    rng = random.Random(seed)
    medians = []
    for _ in range(rounds):
        rng.shuffle(order)
        medians.append({(label, k): statistics.median(time_steps(opts[label][k].step, steps)) for label, k in order})
    return pooled(medians, reference)


def _arguments() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each optimizer per thread count")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=3, help="timed steps of each optimizer per round")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layouts", type=int, default=1,
                        help="copies of the model and optimizers (fresh allocations), timed side by side and pooled")
    parser.add_argument("--quick", action="store_true", help="small model, few rounds, no docs update")
    parser.add_argument("--bf16-weights", action="store_true",
                        help="bf16 weights: torch AdamW against BlockwiseAdamW with master-weight corrections "
                             "(section step_time_bf16)")
    parser.add_argument("--momentum", action="store_true",
                        help="SGD and Lion: torch's SGD against BlockwiseSGD and BlockwiseLion in every momentum format "
                             "(section step_time_momentum)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda: where the model and the optimizers live")
    parser.add_argument("--shapes", default="square", choices=["square", "gpt2-small", "ragged", "many"],
                        help="the tensors: square layers (--layers, --width; the default) or a shape set")
    return parser.parse_args()


def main() -> None:
    args = _arguments()
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible to torch here")
    if args.quick:
        args.layers, args.width, args.warmup, args.rounds, args.steps = 8, 512, 1, 3, 1
    if args.layouts < 1:
        raise SystemExit("--layouts: at least 1")
    layouts = [build_layout(args) for _ in range(args.layouts)]
    n = sum(p.numel() for p in layouts[0][0].parameters())
    built = layouts[0][1]
    reference = SGD_FUSED if args.momentum else FUSED
    print(f"lightning_baoc from {Path(sys.modules['lightning_baoc'].__file__).parent}", flush=True)
    opts = {label: [layout[1][label][0] if label in layout[1] else None for layout in layouts] for label in built}
    default_threads = torch.get_num_threads()
    results: dict[int, Timing] = {}
    speeds: dict[int, float] = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        speeds[threads] = bandwidth()
        for group in opts.values():
            for opt in filter(None, group):
                time_steps(opt.step, args.warmup)
        results[threads] = interleaved(opts, args.rounds, args.steps, reference=reference)
        for label in opts:
            print(f"{_threads(threads)}, {label}: {results[threads].seconds[label] * 1e3:.1f} ms, "
                  f"{results[threads].ratios[label]:.2f}x {reference}", flush=True)
    torch.set_num_threads(default_threads)
    headers = ["optimizer / format", "state (+ correction) bytes/param" if args.bf16_weights else "state bytes/param"]
    for threads in args.threads:
        headers += [f"{_threads(threads)}: median step (ms)", f"{_threads(threads)}: vs {reference}"]
    rows = []
    for label, (_, bpp) in built.items():
        row: list[object] = [label, f"{bpp:.3f}"]
        for threads in args.threads:
            row += [f"{results[threads].seconds[label] * 1e3:.1f}", f"{results[threads].ratios[label]:.2f}x"]
        rows.append(row)
    table = markdown_table(headers, rows)
    moved, who = (20, "fused SGD") if args.momentum else (14 if args.bf16_weights else 28, "fused AdamW")
    floor = "; ".join(
        f"{_threads(t)}: copy {speeds[t] / 1e9:.1f} GB/s, {who} "
        f"{moved * n / results[t].seconds[reference] / 1e9:.1f} GB/s"
        for t in args.threads
    )
    spread = layout_spread(results, [label for label in built if label != reference]) if args.layouts > 1 else ""
    status = kernels.cpu_kernels()
    compiled = f"compiled kernels: {status.detail}" if status.available else f"compiled kernels unavailable ({status.detail})"
    if DEVICE.type == "cuda":
        from lightning_baoc.kernels.triton_common import triton_status

        compiled = f"CUDA step kernels: {triton_status()[1]} (rows marked eager: the eager step)"
    missing = "; ".join(f"{label}: unavailable ({why})" for label, why in UNAVAILABLE.items())
    notes = f"Memory traffic per second: {floor}. {compiled.capitalize()}." + (f" {missing}." if missing else "")
    notes += spread
    if DEVICE.type == "cuda":
        notes += graph_notes(built)
    print(table)
    print(notes)
    section = "step_time_momentum" if args.momentum else "step_time_bf16" if args.bf16_weights else "step_time"
    if args.shapes != "square":
        section += f"_{args.shapes}"
    elif (args.layers, args.width) != (20, 1024):  # another model: a section of its own (many small layers: host work)
        section += f"_{args.layers}x{args.width}"
    if DEVICE.type != "cpu":
        section += f"_{DEVICE.type}"
    if not args.quick:
        weights = "bf16 weights and gradients, " if args.bf16_weights else ""
        body = (
            f"Step time, {n / 1e6:.1f}M parameters ({model_text(args, layouts[0][0])}), {weights}"
            f"at {' and '.join(str(t) for t in args.threads)} torch threads: {args.rounds} rounds, each "
            f"optimizer {args.steps} steps per round in a shuffled order, after {args.warmup} warm-up steps; "
            f"median step over the rounds, and median over the rounds of the ratio to {reference}'s "
            f"step in the same round{layouts_text(args.layouts)}.\n\n"
            f"{'On the GPU: ' if DEVICE.type == 'cuda' else ''}Machine: {machine()} (default). Command: `{_command()}\n\n{table}\n\n{notes}"
        )
        write_docs_section("benchmarks/step-time.md", section, body)


def model_text(args: argparse.Namespace, model: nn.Module) -> str:
    """The model of a run, in words."""
    if args.shapes == "square":
        return f"{args.layers} x Linear({args.width}, {args.width})"
    return f"shape set {args.shapes}: {len(list(model.parameters()))} tensors"


def build_layout(args: argparse.Namespace) -> tuple[nn.Module, dict[str, tuple[torch.optim.Optimizer, float]]]:
    """One copy of the model (fresh allocations, the same values) and every optimizer over it."""
    model = build(args.layers, args.width, args.shapes)
    if args.bf16_weights:
        model = model.to(torch.bfloat16)
    if args.momentum:
        return model, momentum_optimizers(model)
    return model, bf16_optimizers(model) if args.bf16_weights else optimizers(model)


def layouts_text(layouts: int) -> str:
    if layouts == 1:
        return ""
    return (f", over {layouts} layouts (the model and every optimizer built {layouts} times: each optimizer's "
            f"ratio to the fused optimizer of its own copy, pooled over rounds and layouts)")


def layout_spread(results: dict[int, Timing], labels: list[str]) -> str:
    """The range of per-layout median ratios of each label, at each thread count."""
    parts = []
    for threads, timing in results.items():
        ranges = "; ".join(
            f"{label} {min(timing.layouts[label]):.2f}-{max(timing.layouts[label]):.2f}x" for label in labels
        )
        parts.append(f" Per-layout median ratios (lowest-highest), {_threads(threads)}: {ranges}.")
    return "".join(parts)


def _threads(count: int) -> str:
    """'1 thread' or 'N threads'."""
    return f"{count} thread" if count == 1 else f"{count} threads"


def _command() -> str:
    """The command, and the OpenMP wait policy it ran under if one was set."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    return f"{command()}` (environment: `OMP_WAIT_POLICY={policy}`)" if policy else f"{command()}`"


if __name__ == "__main__":
    main()
