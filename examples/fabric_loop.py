"""BAOC in a Lightning Fabric training loop: the same lifecycle as the callback, via BAOCStrategy.

An MLP on scikit-learn's digits (embedded, no download), AdamW with two param groups, a cosine
LambdaLR, gradient accumulation 2 and clipping, written as a plain Fabric loop. The only BAOC
lines are the strategy, the two trigger calls and the ``"baoc"`` entry of the checkpoint.

    python examples/fabric_loop.py                       # budget 0.3, warm-up 60 steps
    python examples/fabric_loop.py --budget 0.2 --epochs 12 --out lightning_logs/fabric_0.2

It prints the allocation table at warm-up end, writes ``baoc_allocation.json``/``.png`` and a
checkpoint into ``--out`` (default ``lightning_logs/fabric_loop``: beside Lightning's own runs, out of
git's view), resumes from that checkpoint into a fresh model (the strategy says it resumed, into which
phase and allocation) and checks that the optimizer comes back in the same formats.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_baoc import BAOCStrategy

#: Where the reports and the checkpoint go by default: beside Lightning's own runs, which git ignores.
OUT = "lightning_logs/fabric_loop"


def digits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits, scaled to [0, 1], split 1400 / 397."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit('examples/fabric_loop.py trains on scikit-learn\'s digits: pip install "lightning_baoc[examples]"') from None

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    return x[order][:1400], y[order][:1400], x[order][1400:], y[order][1400:]


def build(lr: float, total_steps: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The model, AdamW (decay on matrices only) and a per-step cosine schedule."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 256), nn.LayerNorm(256), nn.GELU(), nn.Linear(256, 10))
    groups = [
        {"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.05},
        {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr)
    cosine = lambda step: 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps))  # noqa: E731
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, [cosine, cosine])


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default="0.3", help="memory budget: fraction of fp32 AdamW state or size (default: 0.3)")
    parser.add_argument("--warmup", type=int, default=60, help="fp32 warm-up, optimizer steps (default: 60)")
    parser.add_argument("--epochs", type=int, default=8, help="epochs (default: 8)")
    parser.add_argument("--out", default=OUT, help=f"reports and checkpoint (default: {OUT}, which git ignores)")
    args = parser.parse_args(argv)
    budget = float(args.budget) if args.budget.replace(".", "", 1).isdigit() else args.budget
    out = Path(args.out)

    accumulate, batch = 2, 32
    xtr, ytr, xte, yte = digits()
    train = DataLoader(TensorDataset(xtr, ytr), batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    steps_per_epoch = len(train) // accumulate
    total = steps_per_epoch * args.epochs

    # BAOC: the strategy (single device; base="ddp" for DDP), also registered as a Fabric callback
    # so that fabric.call(...) reaches its epoch/validation triggers and its scalars reach the loggers.
    strategy = BAOCStrategy(
        memory_budget=budget, warmup_steps=args.warmup, sample_every=10, monitor="val_loss", patience=3, report_dir=out
    )
    fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, callbacks=[strategy])
    model, optimizer, scheduler = build(lr=3e-3, total_steps=total)
    model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
    train = fabric.setup_dataloaders(train)

    for epoch in range(args.epochs):
        model.train()
        for i, (x, y) in enumerate(train):
            last_of_window = (i + 1) % accumulate == 0
            with fabric.no_backward_sync(model, enabled=not last_of_window):
                loss = nn.functional.cross_entropy(model(x), y) / accumulate
                fabric.backward(loss)
            if last_of_window:
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()  # BAOC samples before it and allocates after it
                optimizer.zero_grad()
                scheduler.step()
        model.eval()
        with torch.no_grad():
            val = nn.functional.cross_entropy(model(xte), yte).item()
        fabric.call("on_validation_end", value=val)  # plateau trigger
        fabric.call("on_train_epoch_end", epoch=epoch)  # every-N-epochs trigger
        s = strategy.summary()  # the run's figures: state bytes against AdamW's, formats, corrections, peaks
        fabric.print(f"epoch {epoch}: val loss {val:.4f}, lr {scheduler.get_last_lr()[0]:.2e}, phase {s.phase}, "
                     f"optimizer state {s.state_fraction:.3f} of AdamW's")

    ckpt = out / "checkpoint.pt"
    fabric.save(ckpt, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "baoc": strategy.controller})

    # Resume into fresh objects: formats and state bytes come back as saved.
    strategy2 = BAOCStrategy(memory_budget=budget, warmup_steps=args.warmup, sample_every=10, report=False)
    fabric2 = Fabric(accelerator="cpu", devices=1, strategy=strategy2)
    model2, optimizer2, scheduler2 = build(lr=3e-3, total_steps=total)
    model2, optimizer2, scheduler2 = fabric2.setup(model2, optimizer2, scheduler=scheduler2)
    fabric2.load(ckpt, {"model": model2, "optimizer": optimizer2, "scheduler": scheduler2, "baoc": strategy2.controller})
    s, resumed = strategy.summary(), strategy2.summary()
    same = resumed.formats == s.formats and resumed.state_bytes == s.state_bytes
    fabric.print(
        f"optimizer state {s.state_bytes:,} of AdamW's {s.baseline_state_bytes:,} bytes ({s.state_fraction:.3f}); "
        f"final val loss {val:.4f}; resumed in the same formats: {same}; reports in {out}"
    )
    return {"val_loss": val, "state_bytes": float(s.state_bytes), "baseline_state_bytes": float(s.baseline_state_bytes),
            "resumed_same": float(same)}


if __name__ == "__main__":
    main()
