"""Train a small DDPM on scikit-learn's 8x8 digits, optionally under the BAOC callback.

The model and data are ``examples/workloads.py``'s ``ddpm_digits`` (a ~0.25M-parameter conv UNet,
1000 diffusion steps, eps prediction). The quality metric is the held-out denoising loss: the
noise-prediction MSE on the validation images at fixed (timestep, noise) draws, the same for every
run. A couple of minutes on 2 CPU cores:

    python examples/ddpm_digits.py                                  # fp32 AdamW, 1000 steps
    python examples/ddpm_digits.py --baoc-budget 0.35               # BAOC: optimizer state <= 35% of fp32 AdamW
    python examples/ddpm_digits.py --samples samples.png            # also sample 64 digits into a PNG
    python examples/ddpm_digits.py --data-dir path/to/images        # an image folder <dir>/<class>/*.png

Prints the held-out denoising loss, and the optimizer-state bytes when the optimizer reports them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from workload_cli import run_workload_cli


def save_samples(module: object, path: Path, n: int = 64, seed: int = 0) -> None:
    """Sample ``n`` digits from ``module`` (a ``DDPMDigits``) into a PNG grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    images = module.sample(n, generator=torch.Generator().manual_seed(seed))  # type: ignore[attr-defined]
    side = int(n**0.5)
    fig, axes = plt.subplots(side, side, figsize=(side, side))
    for ax, img in zip(axes.flat, images):
        ax.imshow(img[0], cmap="gray_r", vmin=0, vmax=1)
        ax.axis("off")
    fig.savefig(path, dpi=80)
    plt.close(fig)
    print(f"{n} samples written to {path}")


def _add_samples_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--samples", type=Path, default=None, help="write 64 generated digits to this PNG")


def _save_samples_if_asked(args: argparse.Namespace, keep: dict[str, Any]) -> None:
    if args.samples is not None:
        save_samples(keep["module"], args.samples)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Parse the options, train, print and return the final validation metrics (and save samples)."""
    return run_workload_cli("ddpm_digits", argv, __doc__.splitlines()[0], steps=1000,
                            add_arguments=_add_samples_option, after=_save_samples_if_asked)


if __name__ == "__main__":
    main()
