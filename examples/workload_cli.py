"""The command line the three example scripts share (``vit_digits.py``, ``char_gpt.py``, ``ddpm_digits.py``):
train one workload of ``workloads.py`` with or without the ``BAOC`` callback and print what it measured."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from workloads import build


def add_common_arguments(parser: Any, steps: int) -> None:
    """The command-line options the three example scripts share."""
    parser.add_argument("--recipe", choices=["realistic", "stress"], default="realistic",
                        help="realistic: warm-up + cosine; stress: constant, higher LR (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=steps, help="optimizer steps (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's)")
    parser.add_argument("--eval-every", type=int, default=100, help="validate every N steps (default: %(default)s)")
    parser.add_argument("--data-dir", default=None, help="a real data set on disk instead of the embedded one")
    parser.add_argument("--baoc-budget", type=float, default=None,
                        help="train with the BAOC callback at this memory budget, e.g. 0.35 (default: off)")
    parser.add_argument("--baoc-warmup", type=int, default=None,
                        help="BAOC warm-up steps (default: a fifth of --steps, within 20..200)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's; 1 is often faster on a busy shared CPU)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_example(name: str, args: Any, keep: dict[str, Any] | None = None) -> dict[str, float]:
    """Train workload ``name`` as the example scripts do and print the result.

    Args:
        name: The workload.
        args: Parsed :func:`add_common_arguments` options.
        keep: If given, receives the trained ``"module"`` and the ``"trainer"``.

    Returns:
        The final validation metrics.
    """
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    callbacks: list[L.Callback] = []
    baoc: Any = None
    if args.baoc_budget is not None:
        try:
            from lightning_baoc import BAOC
        except ImportError as err:
            raise SystemExit(
                f"--baoc-budget needs lightning_baoc.BAOC, which this installation does not have ({err}). "
                "Run without --baoc-budget, or install a lightning_baoc version with the BAOC callback."
            ) from err
        warmup = args.baoc_warmup if args.baoc_warmup is not None else max(20, min(200, args.steps // 5))
        baoc = BAOC(memory_budget=args.baoc_budget, warmup_steps=warmup)
        callbacks.append(baoc)
    module, data = build(name, args.recipe, args.steps, args.seed, args.data_dir, args.lr)
    print(f"{name}: {module.num_parameters():,} parameters, recipe {args.recipe} ({module.recipe})")
    trainer = L.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        val_check_interval=min(args.eval_every, args.steps),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=not args.no_progress,
        callbacks=callbacks,
    )
    trainer.fit(module, data)
    if keep is not None:
        keep.update(module=module, trainer=trainer)
    metrics = {k: float(v) for k, v in trainer.validate(module, data, verbose=False)[0].items()}
    print(f"{name} after {trainer.global_step} steps: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())))
    if baoc is not None:  # BAOC's figures, from its documented summary
        s = baoc.summary()
        print(f"optimizer state: {s.state_bytes:,} bytes ({s.state_fraction:.3f} of AdamW's {s.baseline_state_bytes:,})")
    else:
        opt, fp32 = trainer.optimizers[0], 8 * module.num_parameters()
        if hasattr(opt, "state_bytes"):  # a blockwise optimizer of the recipe's own
            print(f"optimizer state: {opt.state_bytes():,} bytes ({opt.state_bytes() / fp32:.3f} of fp32 AdamW's {fp32:,})")
        else:
            print(f"optimizer: {type(opt).__name__} (fp32 AdamW state: {fp32:,} bytes)")
    return metrics


def run_workload_cli(
    name: str,
    argv: list[str] | None,
    description: str,
    steps: int,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    after: Callable[[argparse.Namespace, dict[str, Any]], None] | None = None,
) -> dict[str, float]:
    """The ``main`` of an example script: parse the options, train workload ``name``, print the result.

    Args:
        name: The workload.
        argv: The command line without the program name (None: ``sys.argv[1:]``).
        description: The ``--help`` description (the scripts pass their docstring's first line).
        steps: Default of ``--steps``.
        add_arguments: Adds the script's own options after :func:`add_common_arguments`' (default: None).
        after: Called with the parsed options and the ``keep`` of :func:`run_example` (the trained
            ``"module"`` and the ``"trainer"``) after training and printing (default: None).

    Returns:
        The final validation metrics.

    Example:
        >>> metrics = run_workload_cli("vit_digits", ["--steps", "3"], "ViT on digits", steps=500)  # doctest: +SKIP
    """
    parser = argparse.ArgumentParser(description=description)
    add_common_arguments(parser, steps=steps)
    if add_arguments is not None:
        add_arguments(parser)
    args = parser.parse_args(argv)
    keep: dict[str, Any] = {}
    metrics = run_example(name, args, keep=keep)
    if after is not None:
        after(args, keep)
    return metrics
