"""Train a small Vision Transformer on scikit-learn's 8x8 digits, optionally under the BAOC callback.

The model and data are ``examples/workloads.py``'s ``vit_digits`` (~150k parameters, patches of
2x2, embedded data, no download). About a minute on 2 CPU cores:

    python examples/vit_digits.py                              # fp32 AdamW, 500 steps
    python examples/vit_digits.py --baoc-budget 0.35           # BAOC: optimizer state <= 35% of fp32 AdamW
    python examples/vit_digits.py --recipe stress --steps 300  # constant, higher learning rate
    python examples/vit_digits.py --data-dir path/to/images    # an image folder <dir>/<class>/*.png

Prints the validation accuracy and loss, and the optimizer-state bytes when the optimizer reports them.
"""

from __future__ import annotations

from workload_cli import run_workload_cli


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Parse the options, train, print and return the final validation metrics."""
    return run_workload_cli("vit_digits", argv, __doc__.splitlines()[0], steps=500)


if __name__ == "__main__":
    main()
