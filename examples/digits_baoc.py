"""Train a digits classifier with the BAOC callback: the main example.

An unchanged LightningModule (plain ``torch.optim.AdamW`` with two param groups and a cosine
schedule) on scikit-learn's embedded 8x8 digits (no download). ``BAOC`` replaces the optimizer by
an identical fp32 ``BlockwiseAdamW``, samples gradients during warm-up, scores each block's risk
per format, solves for the allocation under the memory budget, converts the state in place and
prints the allocation report. Runs in about a minute on 2 CPU cores:

    python examples/digits_baoc.py
    python examples/digits_baoc.py --budget 0.25 --warmup 150 --epochs 15
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from digits_common import DigitsMLP, digits_loaders

from lightning_baoc import BAOC


class Digits(DigitsMLP):
    """An MLP on digits (3 hidden layers); the optimizer is the user's plain AdamW."""

    def __init__(self, lr: float = 2e-3, max_steps: int = 400) -> None:
        super().__init__(hidden_layers=3, lr=lr, max_steps=max_steps)

    def validation_step(self, batch, batch_idx):
        self.evaluate(batch, "val", prog_bar=True)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}], lr=self.lr
        )
        return self.with_cosine_schedule(opt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=0.3, help="fraction of fp32 AdamW state (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=100, help="warm-up steps (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=15)
    args = parser.parse_args()
    L.seed_everything(0, verbose=False)
    train, test = digits_loaders()
    model = Digits(max_steps=args.epochs * len(train))
    baoc = BAOC(memory_budget=args.budget, warmup_steps=args.warmup, min_8bit_numel=0)
    trainer = L.Trainer(
        max_epochs=args.epochs, accelerator="cpu", callbacks=[baoc], default_root_dir="lightning_logs/digits_baoc"
    )
    trainer.fit(model, train, test)
    s = baoc.summary()  # the run's figures: state bytes, AdamW's, the fraction, formats, corrections, peaks
    print(f"optimizer state: {s.state_bytes:,} bytes = {s.state_fraction:.3f} of AdamW's {s.baseline_state_bytes:,}; "
          f"formats {s.formats}")


if __name__ == "__main__":
    main()
