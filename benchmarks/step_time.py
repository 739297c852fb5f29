"""Optimizer step time of every state format against torch.optim.AdamW (foreach and fused).

A 21M-parameter model of 20 square 1024x1024 linear layers (with biases) gets random gradients;
each optimizer takes warm-up steps, then the median of the timed steps is reported, with the
state bytes per parameter it holds. Results go into the section ``step_time`` of
``docs/benchmarks/step-time.md``.

Run from the repository root:

    python benchmarks/step_time.py            # 21M parameters, 5 warm-up + 25 timed steps
    python benchmarks/step_time.py --quick    # a 2M-parameter smoke run (writes no docs page)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from _report import command, machine, markdown_table, write_docs_section
from lightning_baoc import FORMATS, BlockwiseAdamW


def build(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def time_steps(opt: torch.optim.Optimizer, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--quick", action="store_true", help="small model, no docs update")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.width, args.warmup, args.steps = 8, 512, 2, 5
    model = build(args.layers, args.width)
    n = sum(p.numel() for p in model.parameters())
    results: dict[str, tuple[float, float]] = {}
    for label, make in [
        ("torch AdamW foreach", lambda: torch.optim.AdamW(model.parameters(), foreach=True)),
        ("torch AdamW fused", lambda: torch.optim.AdamW(model.parameters(), fused=True)),
    ]:
        results[label] = (time_steps(make(), args.warmup, args.steps), 8.0)
        print(f"{label}: {results[label][0] * 1e3:.1f} ms", flush=True)
    for fmt in FORMATS:
        opt = BlockwiseAdamW(model.named_parameters(), state_format=fmt)
        seconds = time_steps(opt, args.warmup, args.steps)
        results[fmt] = (seconds, opt.state_bytes() / n)
        print(f"{fmt}: {seconds * 1e3:.1f} ms", flush=True)
        del opt
    foreach = results["torch AdamW foreach"][0]
    fused = results["torch AdamW fused"][0]
    rows = [
        [label, f"{sec * 1e3:.1f}", f"{sec / foreach:.2f}x", f"{sec / fused:.2f}x", f"{bpp:.3f}"]
        for label, (sec, bpp) in results.items()
    ]
    table = markdown_table(["optimizer / format", "median step (ms)", "vs foreach", "vs fused", "state bytes/param"], rows)
    print(table)
    if not args.quick:
        body = (
            f"Step time, {n / 1e6:.1f}M parameters ({args.layers} x Linear({args.width}, {args.width})), "
            f"median of {args.steps} steps after {args.warmup} warm-up steps.\n\n"
            f"Machine: {machine()}. Command: `{command()}`\n\n{table}"
        )
        write_docs_section("benchmarks/step-time.md", "step_time", body)


if __name__ == "__main__":
    main()
