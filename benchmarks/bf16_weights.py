"""Quality with bf16 weights (``precision="bf16-true"``): what the master-weight correction buys.

On the character GPT and the DDPM of ``examples/workloads.py`` (both recipes of the quality table,
the same seeds and steps), rows trained with bf16 weights and gradients:

- ``bf16mixed_adamw``: fp32 weights and states, bf16 compute (``precision="bf16-mixed"``): what bf16
  arithmetic alone costs, which no master-weight correction can recover (not in the default run);
- ``bf16w_adamw``: torch AdamW on the bf16 weights (its states follow them into bf16);
- ``bf16w_int8``: BlockwiseAdamW, int8 states, no correction (updates below half a bf16 ulp lost);
- ``bf16w_int8_ecc8``: BlockwiseAdamW, int8 states, an 8-bit master-weight correction: 7.13 bytes
  per parameter with the gradients (``benchmarks/total_memory.py``);
- ``bf16w_baoc_0.15``: the module's AdamW under ``BAOC(memory_budget=0.15, corrections=["none",
  "ecc8", "ecc16"])``: states and corrections chosen per block within 0.15 of fp32 AdamW's state;
- ``bf16w_baoc_0.15_defaults``: the same with BAOC's defaults (``corrections`` unset: where weights are bf16
  the solver is offered none, ecc8 and ecc16 unasked);

against fp32 AdamW's runs of the quality table (read from its cache, ``benchmarks/runs/quality/``;
with ``--accelerator cuda``, fp32 AdamW is trained on the same device, ``benchmarks/runs/quality_cuda/``).
Each row's final quality is the mean +- sample std over the seeds; "vs fp32" is the difference of
means with its noise (the root sum of squares of the two standard errors). Runs are cached under
``benchmarks/runs/bf16_weights/``.

Run from the repository root:

    python benchmarks/bf16_weights.py --docs        # 2 workloads x 2 recipes x 4 rows x 3 seeds
    python benchmarks/bf16_weights.py --accelerator cuda --docs   # on a GPU (bf16 matrix units)
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

import quality as q
import torch
from _report import command, markdown_table, write_docs_section

from lightning_baoc import BlockwiseAdamW

RESULTS = Path(__file__).resolve().parent / "runs" / "bf16_weights"
QUALITY = Path(__file__).resolve().parent / "runs" / "quality"  # the quality table's runs: fp32 AdamW
WORKLOADS = ("char_gpt", "ddpm_digits")


def _blockwise(correction: str):  # type: ignore[no-untyped-def]
    def make(module: q.Workload) -> torch.optim.Optimizer:
        return BlockwiseAdamW(module.param_groups(), **q._adamw_kwargs(module), state_format="int8",
                              weight_correction=correction, param_names=module)

    return make


ROWS = {
    r.name: r
    for r in [
        q.Row("bf16mixed_adamw", "fp32 weights, bf16 compute (bf16-mixed), torch AdamW", precision="bf16-mixed"),
        q.Row("bf16w_adamw", "bf16 weights, torch AdamW (bf16 states)", precision="bf16-true"),
        q.Row("bf16w_int8", "bf16 weights, int8 states, no correction", _blockwise("none"), precision="bf16-true"),
        q.Row("bf16w_int8_ecc8", "bf16 weights + ecc8, int8 states", _blockwise("ecc8"), precision="bf16-true"),
        q.Row("bf16w_baoc_0.15", "bf16 weights, BAOC at 0.15, corrections chosen per block", budget=0.15,
              precision="bf16-true", baoc=(("corrections", ("none", "ecc8", "ecc16")),)),
        q.Row("bf16w_baoc_0.15_defaults", "bf16 weights, BAOC at 0.15, its defaults (corrections offered unasked)",
              budget=0.15, precision="bf16-true"),
    ]
}


def _finals(results: list[dict]) -> list[float]:
    return [r["final"] for r in results if r.get("status") == "ok" and r.get("final") is not None]


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} +- {sd:.4f} (n={len(values)})"


def _vs(values: list[float], ref: list[float]) -> str:
    if len(values) < 2 or len(ref) < 2:
        return "-"
    diff = statistics.mean(values) - statistics.mean(ref)
    noise = math.sqrt(statistics.variance(values) / len(values) + statistics.variance(ref) / len(ref))
    return f"{diff:+.4f} (noise {noise:.4f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    parser.add_argument("--rows", nargs="+", default=[r for r in ROWS if r != "bf16mixed_adamw"], choices=list(ROWS))
    args = q.parse_table_arguments(parser, "benchmarks/total-memory.md")
    results_dir, reference_dir = RESULTS, QUALITY
    if args.accelerator != "cpu":  # fp32 AdamW trained on the same device as the rows
        results_dir, reference_dir = (d.with_name(f"{d.name}_{args.accelerator}") for d in (RESULTS, QUALITY))
    lines = []
    every: list[dict] = []  # every run of the tables: the machine they recorded
    for w in args.workloads:
        cls = q.WORKLOADS[w]
        metric = f"{cls.quality_metric}, {'higher' if cls.higher_is_better else 'lower'} is better"
        rows_out = []
        for recipe in args.recipes:
            if args.accelerator != "cpu" and not args.report_only:
                for seed in args.seeds:
                    q.run_cached(reference_dir, w, recipe, q.ROWS["fp32"], seed, args.steps)
            ref_runs = [r for s in args.seeds if (r := q.load_cached(reference_dir, w, recipe, "fp32", s, args.steps, any_torch=True))]
            every += ref_runs
            ref = _finals(ref_runs)
            rows_out.append([recipe, q.ROWS["fp32"].label, _cell(ref), ""])
            for name in args.rows:
                row = ROWS[name]
                results = []
                for seed in args.seeds:
                    if args.report_only:
                        found = q.load_cached(results_dir, w, recipe, name, seed, args.steps, any_torch=True)
                        if found is not None:
                            results.append(found)
                    else:
                        results.append(q.run_cached(results_dir, w, recipe, row, seed, args.steps))
                        print(w, recipe, name, seed, results[-1].get("final"), results[-1].get("status"), flush=True)
                every += results
                values = _finals(results)
                rows_out.append([recipe, row.label, _cell(values), _vs(values, ref)])
        lines.append(f"**{w}** ({metric})\n\n"
                     + markdown_table(["recipe", "row", "final quality", "vs fp32 AdamW"], rows_out))
    where = "on the GPU, " if args.accelerator == "cuda" else ""
    body = (f"{args.steps} steps, seeds {', '.join(map(str, args.seeds))}, {where}{args.threads} torch thread(s). "
            f"Machine: {q.machine_of(every)}. Command: `{command()}`\n\n" + "\n\n".join(lines))
    print(body)
    if args.docs:
        section = "bf16_weights" if args.accelerator == "cpu" else f"bf16_weights_{args.accelerator}"
        write_docs_section("benchmarks/total-memory.md", section, body)


if __name__ == "__main__":
    main()
