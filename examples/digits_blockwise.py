"""Train a digits classifier with Lightning and BlockwiseAdamW, a state format per block.

Runs on the CPU in well under a minute on scikit-learn's embedded 8x8 digits (no download):

    python examples/digits_blockwise.py
    python examples/digits_blockwise.py --formats net.0=int8 net.3=bf16 net.6=fp32 --epochs 5

The LightningModule is ordinary; ``configure_optimizers`` returns a BlockwiseAdamW (an AdamW with
per-parameter state formats) and a cosine schedule. After training it prints, per block, the
format, the state bytes really allocated, and the saving against fp32 AdamW, then the test
accuracy. (The BAOC callback, which chooses the formats itself from gradient statistics, builds
on this optimizer.)
"""

from __future__ import annotations

import argparse

import lightning as L
from digits_common import DigitsMLP, digits_loaders
from rich.console import Console
from rich.table import Table

from lightning_baoc import BlockwiseAdamW
from lightning_baoc.formats import format_state_bytes


class DigitsClassifier(DigitsMLP):
    """A 2-hidden-layer MLP with LayerNorm; AdamW hyperparameters, per-block state formats."""

    def __init__(self, formats: dict[str, str], lr: float = 2e-3, max_steps: int = 500) -> None:
        super().__init__(hidden_layers=2, lr=lr, max_steps=max_steps)
        self.formats = formats

    def test_step(self, batch, batch_idx):
        self.evaluate(batch, "test")

    def configure_optimizers(self):
        opt = BlockwiseAdamW(self.named_parameters(), lr=self.lr, weight_decay=1e-2, min_8bit_numel=0)
        opt.set_formats(self.formats)
        return self.with_cosine_schedule(opt)


def report(model: DigitsClassifier, opt: BlockwiseAdamW) -> None:
    """Per block: format, parameters, state bytes allocated, fp32 AdamW bytes."""
    table = Table(title="optimizer state per block")
    for col in ("block", "format", "params", "state bytes", "fp32 AdamW bytes"):
        table.add_column(col, justify="right" if col != "block" else "left")
    formats = opt.formats()
    blocks: dict[str, list[str]] = {}
    for name in formats:
        blocks.setdefault(name.rsplit(".", 1)[0], []).append(name)
    for block, names in blocks.items():
        params = [opt.named_params[n] for n in names]
        fmts = sorted({formats[n] for n in names})
        state = sum(format_state_bytes(formats[n], p.shape, 0) for n, p in zip(names, params))
        table.add_row(block, "/".join(fmts), str(sum(p.numel() for p in params)), str(state), str(8 * sum(p.numel() for p in params)))
    console = Console()
    console.print(table)
    fp32 = 8 * sum(p.numel() for p in opt.named_params.values())
    console.print(f"state bytes {opt.state_bytes()} of fp32 AdamW's {fp32}: {1 - opt.state_bytes() / fp32:.1%} saved")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", nargs="*", default=["net.0=int8", "net.3=int8_factored", "net.6=bf16"],
                        help="block=format pairs (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=20)
    args = parser.parse_args()
    formats = dict(item.split("=", 1) for item in args.formats)
    L.seed_everything(0, verbose=False)
    train, test = digits_loaders()
    model = DigitsClassifier(formats, max_steps=args.epochs * len(train))
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", logger=False, enable_checkpointing=False)
    trainer.fit(model, train)
    report(model, trainer.optimizers[0])
    trainer.test(model, test)


if __name__ == "__main__":
    main()
