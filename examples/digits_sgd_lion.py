"""Train the digits classifier with SGD or Lion, the momentum buffer in 8 bits (BlockwiseSGD, BlockwiseLion).

Runs on the CPU in well under a minute on scikit-learn's embedded 8x8 digits (no download):

    python examples/digits_sgd_lion.py                        # SGD, int8 momentum
    python examples/digits_sgd_lion.py --optimizer lion --format bf16 --epochs 5

``configure_optimizers`` returns a ``BlockwiseSGD`` (torch's SGD with momentum and Nesterov; in fp32 it
steps exactly as ``torch.optim.SGD``) or a ``BlockwiseLion`` whose one state, the momentum buffer, is
held in ``--format`` (``fp32``, ``bf16``, ``int8`` or ``none``). After training it prints the buffer's
bytes per parameter (measured from the optimizer's storage) and the test accuracy.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
from digits_common import DigitsMLP, digits_loaders
from rich.console import Console

from lightning_baoc import MOMENTUM_FORMATS, BlockwiseLion, BlockwiseSGD


class DigitsMomentum(DigitsMLP):
    """A 2-hidden-layer MLP trained by SGD (lr 0.05, momentum 0.9, Nesterov) or Lion (lr 2e-4, weight decay 0.1)."""

    def __init__(self, optimizer: str, fmt: str, max_steps: int = 500) -> None:
        super().__init__(hidden_layers=2, lr=0.05 if optimizer == "sgd" else 2e-4, max_steps=max_steps)
        self.optimizer_name, self.fmt = optimizer, fmt

    def test_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.evaluate(batch, "test")

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            opt = BlockwiseSGD(self.named_parameters(), lr=self.lr, momentum=0.9, nesterov=True, weight_decay=5e-4,
                               state_format=self.fmt, min_8bit_numel=0)
        else:
            opt = BlockwiseLion(self.named_parameters(), lr=self.lr, weight_decay=0.1, state_format=self.fmt,
                                min_8bit_numel=0)
        return self.with_cosine_schedule(opt)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--optimizer", choices=["sgd", "lion"], default="sgd")
    parser.add_argument("--format", choices=list(MOMENTUM_FORMATS), default="int8")
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args(argv)
    L.seed_everything(0, verbose=False)
    train, test = digits_loaders()
    model = DigitsMomentum(args.optimizer, args.format, max_steps=args.epochs * len(train))
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False)
    trainer.fit(model, train)
    opt = trainer.optimizers[0]
    per_param = opt.state_bytes() / sum(p.numel() for p in model.parameters())
    Console().print(f"{type(opt).__name__}: momentum buffers {opt.formats()['net.0.weight']}, "
                    f"{per_param:.3f} bytes per parameter (fp32: 4)")
    metrics = trainer.test(model, test, verbose=False)[0]
    Console().print(f"test accuracy {metrics['test_acc']:.3f}")
    return {"bytes_per_param": per_param, **metrics}


if __name__ == "__main__":
    main()
