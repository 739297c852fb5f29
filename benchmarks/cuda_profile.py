"""Where the CUDA step's time goes: the host's Python against the GPU's kernels (needs a GPU).

The model of the step-time table (20 x Linear(1024, 1024), 21M parameters, 40 tensors). For fused AdamW and
BlockwiseAdamW in fp32, int8 and bf16 (fp32 weights), and int8 with an ecc8 correction and fused AdamW on bf16
weights: the step's time in a loop of 20 steps between two synchronisations, and the host's time alone (the same
steps without waiting for the GPU); then, for int8, the host's profile (``cProfile``, the functions of most own
time) and the GPU's kernels (``torch.profiler``, their device time).

Example::

    python benchmarks/cuda_profile.py
"""

from __future__ import annotations

import cProfile
import pstats
import time

import torch
from _report import command, machine
from torch import nn

from lightning_baoc import BlockwiseAdamW

STEPS = 20


def _model(device: torch.device, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(20)]).to(device, dtype)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    return model


def _timed(step, sync: bool) -> float:  # type: ignore[no-untyped-def]
    """Milliseconds per step over STEPS steps (``sync``: the GPU's work included)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(STEPS):
        step()
    if sync:
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / STEPS * 1e3
    torch.cuda.synchronize()
    return elapsed


def _kernels(step) -> str:  # type: ignore[no-untyped-def]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("device_time_total", "cuda_time_total"):  # the key's name differs between torch versions
        try:
            return averages.table(sort_by=key, row_limit=8)
        except (AttributeError, KeyError, ValueError):
            continue
    return str(averages)


def main() -> None:
    device = torch.device("cuda")
    print(f"Machine: {machine()}. Command: `{command()}`\n")
    runs = [("torch AdamW fused", torch.float32, None), ("fp32", torch.float32, dict(state_format="fp32")),
            ("int8", torch.float32, dict(state_format="int8")), ("bf16", torch.float32, dict(state_format="bf16")),
            ("int8 + ecc8, bf16 weights", torch.bfloat16, dict(state_format="int8", weight_correction="ecc8")),
            ("torch AdamW fused, bf16 weights", torch.bfloat16, None)]
    for label, dtype, options in runs:
        model = _model(device, dtype)
        opt = (torch.optim.AdamW(model.parameters(), fused=True) if options is None
               else BlockwiseAdamW(model.named_parameters(), **options))
        for _ in range(3):
            opt.step()
        step, host = _timed(opt.step, sync=True), _timed(opt.step, sync=False)
        print(f"{label:32s} step {step:7.3f} ms   host alone {host:7.3f} ms", flush=True)
        if label == "int8":
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(STEPS):
                opt.step()
            torch.cuda.synchronize()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(22)
        if label in ("torch AdamW fused", "int8", "int8 + ecc8, bf16 weights"):
            print(_kernels(opt.step), flush=True)


if __name__ == "__main__":
    main()
