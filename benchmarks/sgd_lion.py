"""Quality of SGD's and Lion's momentum formats on the ViT (BlockwiseSGD, BlockwiseLion).

On the ViT of ``examples/workloads.py`` (digits; both recipes of the quality table: realistic = warm-up +
cosine, stress = constant at 3x the peak learning rate; the same seeds and steps), each optimizer with
its momentum buffer in every format of ``MOMENTUM_FORMATS``, against the same optimizer in fp32:

- SGD (momentum 0.9, L2 weight decay 5e-4 on the matrices): ``sgd_fp32`` is ``torch.optim.SGD``
  itself (BlockwiseSGD in fp32 equals it to the bit, ``tests/optim/test_momentum_optimizers.py``);
  ``sgd_bf16``, ``sgd_int8``, ``sgd_none``: BlockwiseSGD with the buffer in bf16, int8, none.
- Lion (betas 0.9, 0.99, decoupled weight decay 0.1 on the matrices): ``lion_fp32`` is BlockwiseLion in
  fp32 (equal to the paper's reference within 1e-6 in the tests); ``lion_bf16``, ``lion_int8``,
  ``lion_none`` (sign descent).
- With bf16 weights (``precision="bf16-true"``, 8-bit buffer): ``*_bf16w_int8_ecc8`` with an 8-bit master-
  weight correction, ``*_bf16w_int8`` without. Not in the default run: on a CPU without bf16 matrix
  instructions a bf16 matmul is ~18x slower than fp32 (measured), hours per table; ask for them with
  ``--rows``.

Learning rates: the peak of the realistic recipe was chosen on seed 0 (1000 steps, final accuracy):
SGD 0.01: 0.952, 0.02: 0.962, 0.03: 0.955, 0.1: 0.914, 0.3: 0.695; Lion (lr, weight decay) 2e-4, 0.5:
0.914; 4e-4, 0.25: 0.937; 8e-4, 0.1: 0.952; 1e-3, 0.1: 0.952 (fp32 AdamW at 2e-3: 0.970). The stress
recipe runs at 3x these, as the AdamW recipes do.

Each row's final accuracy is the mean +- sample std over the seeds; "vs fp32" is the difference of
means with its noise (the root sum of squares of the two standard errors). Runs are cached under
``benchmarks/runs/sgd_lion/``.

Run from the repository root:

    python benchmarks/sgd_lion.py --docs                 # 8 rows x 2 recipes x 3 seeds, ~1 h on 1 core
    python benchmarks/sgd_lion.py --rows sgd_bf16w_int8_ecc8 sgd_bf16w_int8 lion_bf16w_int8_ecc8 lion_bf16w_int8
    python benchmarks/sgd_lion.py --accelerator cuda --docs --rows sgd_fp32 sgd_bf16w_int8_ecc8 sgd_bf16w_int8 \
        lion_fp32 lion_bf16w_int8_ecc8 lion_bf16w_int8   # on a GPU, cached under benchmarks/runs/sgd_lion_cuda/
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable

import quality as q
import torch
from _report import command, markdown_table, write_docs_section
from bf16_weights import _cell, _finals, _vs

from lightning_baoc import BlockwiseLion, BlockwiseSGD

RESULTS = Path(__file__).resolve().parent / "runs" / "sgd_lion"
WORKLOAD = "vit_digits"
#: Peak learning rates per recipe (the sweep in the module docstring; stress at 3x).
SGD_LR = {"realistic": 0.02, "stress": 0.06}
LION_LR = {"realistic": 8e-4, "stress": 2.4e-3}
SGD_DECAY, LION_DECAY = 5e-4, 0.1


def _groups(module: q.Workload, decay: float) -> list[dict]:
    groups = module.param_groups()  # matrices first (decayed), then vectors, norms and tokens
    groups[0]["weight_decay"] = decay
    return groups


def _sgd(fmt: str | None, correction: str = "none") -> Callable[[q.Workload], torch.optim.Optimizer]:
    def make(module: q.Workload) -> torch.optim.Optimizer:
        lr = SGD_LR[module.recipe_name]
        if fmt is None:
            return torch.optim.SGD(_groups(module, SGD_DECAY), lr=lr, momentum=0.9)
        return BlockwiseSGD(_groups(module, SGD_DECAY), lr=lr, momentum=0.9, state_format=fmt,
                            weight_correction=correction, param_names=module)

    return make


def _lion(fmt: str, correction: str = "none") -> Callable[[q.Workload], torch.optim.Optimizer]:
    def make(module: q.Workload) -> torch.optim.Optimizer:
        return BlockwiseLion(_groups(module, LION_DECAY), lr=LION_LR[module.recipe_name], betas=(0.9, 0.99),
                             state_format=fmt, weight_correction=correction, param_names=module)

    return make


ROWS = {
    r.name: r
    for r in [
        q.Row("sgd_fp32", "SGD, fp32 buffer (torch.optim.SGD)", _sgd(None)),
        q.Row("sgd_bf16", "SGD, bf16 buffer", _sgd("bf16")),
        q.Row("sgd_int8", "SGD, int8 buffer", _sgd("int8")),
        q.Row("sgd_none", "SGD without momentum", _sgd("none")),
        q.Row("lion_fp32", "Lion, fp32 buffer", _lion("fp32")),
        q.Row("lion_bf16", "Lion, bf16 buffer", _lion("bf16")),
        q.Row("lion_int8", "Lion, int8 buffer", _lion("int8")),
        q.Row("lion_none", "Lion without momentum (sign descent)", _lion("none")),
        q.Row("sgd_bf16w_int8_ecc8", "SGD, bf16 weights + ecc8, int8 buffer", _sgd("int8", "ecc8"), precision="bf16-true"),
        q.Row("sgd_bf16w_int8", "SGD, bf16 weights, int8 buffer, no correction", _sgd("int8"), precision="bf16-true"),
        q.Row("lion_bf16w_int8_ecc8", "Lion, bf16 weights + ecc8, int8 buffer", _lion("int8", "ecc8"), precision="bf16-true"),
        q.Row("lion_bf16w_int8", "Lion, bf16 weights, int8 buffer, no correction", _lion("int8"), precision="bf16-true"),
    ]
}
DEFAULT_ROWS = [name for name, row in ROWS.items() if row.precision == "32-true"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, choices=list(ROWS))
    args = q.parse_table_arguments(parser, "benchmarks/quality.md")
    results_dir = RESULTS if args.accelerator == "cpu" else RESULTS.with_name(f"{RESULTS.name}_{args.accelerator}")
    table = []
    every: list[dict] = []  # every run of the table: the machine they recorded
    for recipe in args.recipes:
        finals: dict[str, list[float]] = {}
        for name in args.rows:
            results = []
            for seed in args.seeds:
                if args.report_only:
                    found = q.load_cached(results_dir, WORKLOAD, recipe, name, seed, args.steps, any_torch=True)
                    if found is not None:
                        results.append(found)
                else:
                    results.append(q.run_cached(results_dir, WORKLOAD, recipe, ROWS[name], seed, args.steps))
                    print(recipe, name, seed, results[-1].get("final"), results[-1].get("status"), flush=True)
            every += results
            finals[name] = _finals(results)
            per_param = [r["state_bytes"] / r["params"] for r in results if r.get("params")]
            ref = finals.get(name.split("_")[0] + "_fp32", [])
            table.append([recipe, ROWS[name].label, f"{per_param[0]:.3f}" if per_param else "-",
                          _cell(finals[name]), "" if name.endswith("_fp32") else _vs(finals[name], ref)])
    where = "on the GPU, " if args.accelerator == "cuda" else ""
    body = (f"ViT on digits, {args.steps} steps, seeds {', '.join(map(str, args.seeds))}, {where}{args.threads} torch "
            f"thread(s); final accuracy (higher is better). Machine: {q.machine_of(every)}. Command: `{command()}`\n\n"
            + markdown_table(["recipe", "row", "state bytes / param", "final accuracy", "vs the same optimizer in fp32"],
                             table))
    print(body)
    if args.docs:
        section = "sgd_lion" if args.accelerator == "cpu" else f"sgd_lion_{args.accelerator}"
        write_docs_section("benchmarks/quality.md", section, body)


if __name__ == "__main__":
    main()
