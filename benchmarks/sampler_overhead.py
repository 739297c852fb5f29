"""Cost of GradientSampler on a training step of a >= 1M-parameter character GPT on the CPU.

Trains one CharGPT (6 layers, 128 wide, 1.2M parameters; batch 16 x 64 characters of Python
standard-library source) with plain AdamW. The settings (no sampler, no sampler again, a sampler
at each interval) take turns step by step in a random order, so that drifts of the (shared,
noisy) machine hit all of them alike. Two measures of the overhead, as a share of the step time without the sampler:

- direct: the seconds the sampler really spends (hot path + worker thread, both counted as if
  serial, which overstates it where the worker has a free core), per training step;
- end-to-end: the trimmed mean of the per-round step-time differences with and without the
  sampler, over the mean step time without, with the worker flushed inside the sampling step;
  the second no-sampler setting shows the noise of this measure.

The ring buffer's memory is reported from ``GradientSampler.buffer_bytes()``.

Exact command (writes the tables between the sampler_overhead markers of
docs/benchmarks/sampler-overhead.md)::

    python benchmarks/sampler_overhead.py --docs
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import re
import statistics as stats
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _models import CharGPT, batches, char_corpus  # noqa: E402
from _report import write_docs_section  # noqa: E402

from lightning_baoc import GradientSampler, partition  # noqa: E402
from lightning_baoc.sampling import DEFAULT_CAPACITY, DEFAULT_MAX_ELEMENTS, DEFAULT_MAX_ROWS, DEFAULT_SAMPLE_EVERY  # noqa: E402

PAGE, SECTION = "benchmarks/sampler-overhead.md", "sampler_overhead"  # where --docs writes (under docs/)


def machine() -> str:
    """nproc, CPU model and torch version, for the table's caption."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        found = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M)
        if found:
            model = found.group(1).strip()
    return f"{os.cpu_count()} CPUs ({model}), torch {torch.__version__}, Python {platform.python_version()}"


def paired_difference(a: list[float], b: list[float], trim: float = 0.1) -> float:
    """Mean of the per-round differences ``a - b``, the ``trim`` share cut off at each end.

    Both settings of a round ran side by side, so a slow phase of the machine mostly cancels in the
    difference; what is left is symmetric noise (spikes in either), which a symmetric trim removes
    without moving the mean, while a small systematic cost (the sampler's) stays.
    """
    d = sorted(x - y for x, y in zip(a, b))
    cut = int(len(d) * trim)
    return stats.mean(d[cut : len(d) - cut])


def measure(
    intervals: tuple[int, ...] = (1, 10, 50),
    rounds: int = 150,
    warmup: int = 10,
    n_layer: int = 6,
    n_embd: int = 128,
    batch_size: int = 16,
    block_size: int = 64,
    seed: int = 0,
) -> dict[str, Any]:
    """Run the interleaved measurement; returns per-interval rows and the baseline step time.

    Each of ``rounds`` rounds runs one training step per setting, in a random order: no sampler,
    a second no-sampler setting (its difference from the first shows the measurement noise), and
    one per interval (all samplers see the round's step number). A sampling step includes flushing the worker,
    so the worker's time lands in the step that caused it.
    """
    torch.manual_seed(seed)
    data, vocab = char_corpus()
    model = CharGPT(vocab_size=vocab, block_size=block_size, n_layer=n_layer, n_head=4, n_embd=n_embd)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(seed)
    blocks = partition(model)

    def train_step(sampler: GradientSampler | None, step: int) -> float:
        t0 = time.perf_counter()
        x, y = batches(data, batch_size, block_size, generator)
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        if sampler is not None and sampler.sample(step):
            sampler.flush()
        optimizer.step()
        return time.perf_counter() - t0

    for step in range(warmup):
        train_step(None, step)

    samplers = {n: GradientSampler(model, blocks, sample_every=n) for n in intervals}
    settings: list[Any] = ["base", "base2", *intervals]
    times: dict[Any, list[float]] = {k: [] for k in settings}
    order = random.Random(seed)
    for step in range(rounds):
        # A fresh random order each round: no setting always runs right after another one.
        for k in order.sample(settings, len(settings)):
            times[k].append(train_step(samplers.get(k), step))

    base = stats.mean(times["base"])
    rows = []
    for n in intervals:
        s = samplers[n]
        t = s.timings()
        calls = max(int(t["sample_calls"]), 1)
        rows.append(
            {
                "sample_every": n,
                "samples": int(t["sample_calls"]),
                "hot_ms": 1e3 * t["hot_path_s"] / calls,
                "worker_ms": 1e3 * t["worker_s"] / calls,
                "direct_pct": 100 * (t["hot_path_s"] + t["worker_s"]) / rounds / base,
                "step_ms": 1e3 * stats.median(times[n]),
                "e2e_pct": 100 * paired_difference(times[n], times["base"]) / base,
                "buffer_mb": s.buffer_bytes() / 2**20,
            }
        )
    shown = DEFAULT_SAMPLE_EVERY if DEFAULT_SAMPLE_EVERY in samplers else intervals[0]
    final = samplers[shown].statistics()
    for s in samplers.values():
        s.close()
    return {
        "params": model.num_parameters(),
        "blocks": len(blocks),
        "base_ms": 1e3 * stats.median(times["base"]),
        "noise_pct": 100 * paired_difference(times["base2"], times["base"]) / base,
        "rows": rows,
        "statistics": final,
        "statistics_interval": shown,
        "rounds": rounds,
    }


def table(result: dict[str, Any]) -> str:
    """The markdown table of :func:`measure`'s result."""
    lines = [
        "| sample_every | samples taken | hot path ms/sample | worker ms/sample | direct overhead | "
        "step ms (median) | end-to-end overhead | sampler memory |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| no sampler | - | - | - | - | {result['base_ms']:.1f} | - | - |",
        f"| no sampler (again: noise) | - | - | - | - | - | {result['noise_pct']:+.1f}% | - |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['sample_every']} | {r['samples']} | {r['hot_ms']:.2f} | {r['worker_ms']:.2f} | "
            f"{r['direct_pct']:.2f}% | {r['step_ms']:.1f} | {r['e2e_pct']:+.1f}% | {r['buffer_mb']:.1f} MiB |"
        )
    return "\n".join(lines)


def stats_table(statistics: dict[str, dict[str, float | int]], names: list[str]) -> str:
    """A few blocks' statistics, to show what the sampler reports."""
    lines = [
        "| block | samples | stability (lag 1) | persistence | anisotropy | SNR |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        s = statistics[name]
        lines.append(
            f"| `{name}` | {s['samples']} | {s['stability']:.3f} | {s['persistence']:.3f} | "
            f"{s['anisotropy']:.3f} | {s['snr']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=150, help="training steps per setting (default: 150)")
    parser.add_argument("--docs", "--readme", dest="docs", action="store_true",
                        help=f"write the tables into docs/{PAGE} (--readme: former name)")
    args = parser.parse_args()

    result = measure(rounds=args.rounds)
    command = "python benchmarks/sampler_overhead.py" + (" --docs" if args.docs else "")
    if args.rounds != 150:
        command += f" --rounds {args.rounds}"
    shown = ["wte", "h.0.attn.qkv", "h.0.mlp.fc", "h.5.attn.proj", "h.5.ln_2", "lm_head"]
    text = (
        f"Character GPT, {result['params']:,} parameters in {result['blocks']} blocks (`partition(model)`), "
        f"batch 16 x 64, AdamW; {result['rounds']} steps per setting, the settings taking turns step by step "
        f"in a random order. Defaults `max_elements={DEFAULT_MAX_ELEMENTS}`, `capacity={DEFAULT_CAPACITY}`, "
        f"`max_rows={DEFAULT_MAX_ROWS}`; with `sample_every` > 1 the step "
        f"after each sampling step is sampled too (lag-1 cosine). Direct overhead: seconds the sampler "
        f"spends (hot path + worker thread) per training step / step time without it. End-to-end: "
        f"step-time difference with - without the sampler in the same round (10%-trimmed mean over "
        f"rounds) / step time without, with the worker flushed inside the sampling step (no overlap); "
        f"the second no-sampler row shows the noise of that measure on this shared machine.\n\n"
        f"Machine: {machine()}. Command: `{command}`\n\n"
        f"{table(result)}\n\n"
        f"What the `sample_every={result['statistics_interval']}` sampler reports at the end (stability: "
        f"lag 1; persistence: lag {result['statistics_interval']}; SNR: gradient signal-to-noise ratio over the ring):\n\n"
        f"{stats_table(result['statistics'], shown)}\n"
    )
    print(text)
    if args.docs:
        write_docs_section(PAGE, SECTION, text)


if __name__ == "__main__":
    main()
