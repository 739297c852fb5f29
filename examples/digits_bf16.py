"""Train the digits classifier in bf16 (``precision="bf16-true"``) at 5 bytes per parameter.

Runs on the CPU in well under a minute on scikit-learn's embedded 8x8 digits (no download):

    python examples/digits_bf16.py
    python examples/digits_bf16.py --correction none --no-release --epochs 5

The weights and gradients are bf16; ``BlockwiseAdamW`` keeps an 8-bit master-weight correction beside
each weight (``weight_correction="ecc8"``: the small updates bf16 weights lose are kept) and int8 states,
and the ``GradientRelease`` callback steps every parameter during backward and frees its gradient. After
training it prints what training holds per parameter (``lightning_baoc.training_memory``: weights,
corrections, gradients, states) and the test accuracy.
"""

from __future__ import annotations

import argparse
from typing import Any

import lightning as L
from digits_common import DigitsMLP, digits_loaders
from rich.console import Console

from lightning_baoc import BlockwiseAdamW, GradientRelease, training_memory


class DigitsBF16(DigitsMLP):
    """A 2-hidden-layer MLP; int8 states and a master-weight correction for its bf16 weights."""

    def __init__(self, correction: str, lr: float = 2e-3, max_steps: int = 500) -> None:
        super().__init__(hidden_layers=2, lr=lr, max_steps=max_steps)
        self.correction = correction

    def test_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        self.evaluate(batch, "test")

    def configure_optimizers(self) -> Any:
        opt = BlockwiseAdamW(self.named_parameters(), lr=self.lr, weight_decay=1e-2, state_format="int8",
                             min_8bit_numel=0, weight_correction=self.correction)
        return self.with_cosine_schedule(opt)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--correction", choices=["none", "ecc8", "ecc16"], default="ecc8")
    parser.add_argument("--no-release", action="store_true", help="keep the gradients until step()")
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args(argv)
    L.seed_everything(0, verbose=False)
    train, test = digits_loaders()
    model = DigitsBF16(args.correction, max_steps=args.epochs * len(train))
    callbacks = [] if args.no_release else [GradientRelease()]
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", precision="bf16-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, callbacks=callbacks)
    trainer.fit(model, train)
    memory = training_memory(model, trainer.optimizers[0])
    parts = ", ".join(f"{k} {memory.per_param(k):.2f}" for k in ("weights", "corrections", "gradients", "states"))
    Console().print(f"training holds {memory.per_param():.2f} bytes per parameter ({parts})")
    metrics = trainer.test(model, test, verbose=False)[0]
    Console().print(f"test accuracy {metrics['test_acc']:.3f}")
    return {"bytes_per_param": memory.per_param(), **metrics}


if __name__ == "__main__":
    main()
