"""Train a character-level GPT on the Python standard library's own source, optionally under BAOC.

The model and data are ``examples/workloads.py``'s ``char_gpt`` (~0.8M parameters, 4 blocks of
width 128, context 64; the text is the ``.py`` source of a fixed list of standard-library modules,
so every Python installation has it; the last 10% is held out). A few minutes on 2 CPU cores:

    python examples/char_gpt.py                                # fp32 AdamW, 1000 steps
    python examples/char_gpt.py --baoc-budget 0.35             # BAOC: optimizer state <= 35% of fp32 AdamW
    python examples/char_gpt.py --recipe stress                # constant, higher learning rate
    python examples/char_gpt.py --data-dir path/to/corpus      # a directory of .txt / .py / .md files

Prints the validation perplexity and loss, and the optimizer-state bytes when the optimizer reports them.
"""

from __future__ import annotations

from workload_cli import run_workload_cli


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Parse the options, train, print and return the final validation metrics."""
    return run_workload_cli("char_gpt", argv, __doc__.splitlines()[0], steps=1000)


if __name__ == "__main__":
    main()
