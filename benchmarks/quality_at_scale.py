"""Quality at scale beside the 8-bit peers: a byte-level GPT at ~40M and ~124M parameters trained through
Lightning, BAOC at several budgets against fp32 AdamW, our uniform ``int8`` and the peers' 8- and 4-bit AdamWs.

The text is the Python standard library's own source (every ``.py`` file under the running interpreter's
``stdlib``, in sorted order, up to ``--corpus-mb``), read as bytes (vocabulary 256), split 95% / 5% into
training and held-back validation text. Each run trains ``steps`` optimizer steps of ``batch`` windows of
``block`` bytes, linear warm-up over the first 5% of the steps then cosine decay to 10% of the peak learning
rate, with ``precision="bf16-mixed"`` on a GPU (``32-true`` on the CPU, where bf16 matrix products are slow),
and reports the validation loss over fixed windows of the held-back text, the optimizer state it held
(measured: ``_quality_rows.measured_state_bytes``, the storages of the peers' states), the whole run's peak memory
(``torch.cuda.max_memory_allocated``, reset per run; on the CPU the process's peak resident set, which the runs
of one call share) and tokens per second.

Sizes (``--size``): ``40m`` (8 layers x 640, 39.4M parameters in the blocks) and ``124m`` (12 layers x 928,
124.0M: GPT-2-small's count at a byte vocabulary; 29 heads of 32), 2,000 steps, context 256; ``2m`` (4 x 192,
300 steps) for the CPU; ``tiny`` for the test that keeps the script from rotting.

Rows: ``fp32`` (torch AdamW, fused on a GPU), ``baoc_0.5``, ``baoc_0.25``, ``baoc_0.15`` (the callback with its
defaults but the budget and a warm-up of 10% of the steps, sampled at least 10 times), ``int8`` (BlockwiseAdamW, uniform int8),
``bnb_8bit`` (bitsandbytes ``AdamW8bit``), ``torchao_8bit`` / ``torchao_4bit`` (torchao ``AdamW8bit`` /
``AdamW4bit``), ``flashoptim`` (FlashOptim's AdamW). A peer
that is not installed is a row that says so, never a failure.

GPU time comes in slices: every finished run is written to ``benchmarks/runs/quality_at_scale/<size>/`` at
once, a later call skips what is there, and ``--max-seconds`` stops before a run that would not finish in
time (from the step times measured so far). Runs go in the order of :data:`PLAN`: the 40M rows fp32, BAOC 0.25,
BAOC 0.15, int8, bitsandbytes and torchao 8-bit with 2 seeds; then 124M with fp32, BAOC 0.25 and 0.15; then the
rest. ``--report-only`` prints the table (mean and standard error over the seeds, the paired difference to fp32
on the same seeds) without training.

    python benchmarks/quality_at_scale.py --device cuda --max-seconds 540   # a slice of the plan on a GPU
    python benchmarks/quality_at_scale.py --size 2m --rows fp32 baoc_0.25 int8 --seeds 0   # on the CPU
    python benchmarks/quality_at_scale.py --report-only --docs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package

from _models import CharGPT  # noqa: E402
from _quality_rows import measured_state_bytes  # noqa: E402
from _report import command, machine, markdown_table, write_docs_section  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "runs" / "quality_at_scale"

#: Size -> the model and the recipe.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, block=64, batch=8, steps=30, lr=3e-3, eval_windows=16),
    "2m": dict(n_layer=4, n_embd=192, n_head=6, block=256, batch=16, steps=300, lr=2e-3, eval_windows=64),
    "40m": dict(n_layer=8, n_embd=640, n_head=10, block=256, batch=32, steps=2000, lr=6e-4, eval_windows=256),
    "124m": dict(n_layer=12, n_embd=928, n_head=29, block=256, batch=32, steps=2000, lr=6e-4, eval_windows=256),
}

#: Row -> what it is.
ROWS: dict[str, str] = {
    "fp32": "torch AdamW, fp32 states (fused on a GPU)",
    "baoc_0.5": "BAOC(memory_budget=0.5), its defaults",
    "baoc_0.25": "BAOC(memory_budget=0.25), its defaults",
    "baoc_0.15": "BAOC(memory_budget=0.15), its defaults",
    "int8": "BlockwiseAdamW, uniform int8",
    "bnb_8bit": "bitsandbytes AdamW8bit",
    "torchao_8bit": "torchao AdamW8bit",
    "torchao_4bit": "torchao AdamW4bit",
    "flashoptim": "FlashOptim AdamW",
}

#: The runs in the order of their value: (size, row, seed).
PLAN: list[tuple[str, str, int]] = (
    [("40m", r, s) for s in (0, 1) for r in ("fp32", "baoc_0.25", "baoc_0.15", "int8", "bnb_8bit", "torchao_8bit")]
    + [("124m", r, 0) for r in ("fp32", "baoc_0.25", "baoc_0.15")]
    + [("40m", r, s) for s in (0, 1) for r in ("baoc_0.5", "torchao_4bit", "flashoptim")]
    + [("124m", r, 1) for r in ("fp32", "baoc_0.25", "baoc_0.15")]
    + [("40m", r, 2) for r in ROWS]
)


def corpus(megabytes: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The standard library's source as bytes: (training, validation) uint8 tensors, 95% / 5%."""
    root = Path(sysconfig.get_paths()["stdlib"])
    limit = int(megabytes * (1 << 20))
    chunks, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    text = torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8)
    cut = int(0.95 * text.numel())
    return text[:cut], text[cut:]


def _windows(data: torch.Tensor, count: int, block: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(data.numel() - block - 1, (count,), generator=generator)
    x = torch.stack([data[s : s + block] for s in starts]).long()
    y = torch.stack([data[s + 1 : s + 1 + block] for s in starts]).long()
    return x, y


def _peer(row: str, params: Any, lr: float) -> torch.optim.Optimizer:
    """A peer's optimizer (ImportError where it is not installed)."""
    if row == "bnb_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    if row in ("torchao_8bit", "torchao_4bit"):
        from torchao.optim import AdamW4bit, AdamW8bit

        return (AdamW8bit if row == "torchao_8bit" else AdamW4bit)(params, lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    if row == "flashoptim":
        from flashoptim import FlashAdamW  # type: ignore[import-not-found]

        return FlashAdamW(params, lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    raise ValueError(row)


def train(size: str, row: str, seed: int, device: str, corpus_mb: float) -> dict[str, Any]:
    """One run; its result (``status`` says why a row did not run)."""
    import lightning as L

    from lightning_baoc import BAOC, BlockwiseAdamW

    cfg = SIZES[size]
    train_text, val_text = corpus(corpus_mb)
    cuda = device == "cuda"
    if row not in ROWS:
        raise ValueError(f"Unknown row {row!r}; allowed: {list(ROWS)}")
    if row in ("bnb_8bit", "torchao_8bit", "torchao_4bit", "flashoptim"):
        try:
            _peer(row, [nn.Parameter(torch.zeros(1))], 1e-3)
        except Exception as err:  # noqa: BLE001 - not installed, or no kernel for this device
            return {"size": size, "row": row, "seed": seed, "status": f"not available: {type(err).__name__}: {str(err)[:120]}"}
    torch.manual_seed(seed)
    warmup = max(1, cfg["steps"] // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, cfg["steps"] - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    class GPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = CharGPT(256, cfg["block"], cfg["n_layer"], cfg["n_head"], cfg["n_embd"])
            self.generator = torch.Generator().manual_seed(seed + 1000)
            self.curve: list[tuple[int, float]] = []

        def train_dataloader(self) -> Any:
            return range(cfg["steps"])  # the batches are drawn in training_step from the generator

        def training_step(self, _: Any, batch_idx: int) -> torch.Tensor:
            x, y = _windows(train_text, cfg["batch"], cfg["block"], self.generator)
            loss = self.model(x.to(self.device), y.to(self.device))[1]
            if batch_idx % max(1, cfg["steps"] // 40) == 0:
                self.curve.append((batch_idx, float(loss.detach())))
            return loss

        def configure_optimizers(self) -> Any:
            decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
            rest = [p for n, p in self.model.named_parameters() if p.ndim < 2]
            groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
            if row == "int8":
                opt = BlockwiseAdamW(groups, lr=cfg["lr"], betas=(0.9, 0.95), state_format="int8")
            elif row in ROWS and row.startswith(("bnb", "torchao", "flash")):
                opt = _peer(row, groups, cfg["lr"])
            else:
                opt = torch.optim.AdamW(groups, lr=cfg["lr"], betas=(0.9, 0.95), fused=cuda)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, schedule),
                                                        "interval": "step"}}

    callbacks: list[Any] = []
    if row.startswith("baoc_"):
        baoc_warmup = max(16, cfg["steps"] // 10)
        callbacks.append(BAOC(memory_budget=float(row.split("_")[1]), warmup_steps=baoc_warmup,
                              sample_every=max(1, min(10, baoc_warmup // 10)), report=False))
    module = GPT()
    trainer = L.Trainer(accelerator=device, devices=1, max_steps=cfg["steps"], precision="bf16-mixed" if cuda else "32-true",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, gradient_clip_val=1.0)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.fit(module)
    seconds = time.perf_counter() - start
    module.eval()
    gen = torch.Generator().manual_seed(12345)
    x, y = _windows(val_text, cfg["eval_windows"], cfg["block"], gen)
    losses = []
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
        for i in range(0, x.shape[0], 32):
            losses.append(float(module.model(x[i : i + 32].to(module.device), y[i : i + 32].to(module.device))[1]))
    from lightning_baoc.report.memory import peak_resident_bytes

    n = sum(p.numel() for p in module.model.parameters())
    return {
        "size": size, "row": row, "seed": seed, "status": "ok", "params": n, "steps": trainer.global_step,
        "val_loss": statistics.fmean(losses), "state_bytes": measured_state_bytes(trainer.optimizers[0]),
        "peak_memory": int(torch.cuda.max_memory_allocated()) if cuda else peak_resident_bytes(),
        "peak_memory_kind": "max_memory_allocated" if cuda else "the process's peak resident set (runs in one process share it)",
        "tokens_per_second": cfg["steps"] * cfg["batch"] * cfg["block"] / seconds, "seconds": seconds,
        "curve": module.curve, "device": device, "machine": machine(), "torch": torch.__version__,
    }


def time_steps(size: str, device: str, steps: int = 5) -> float:
    """Seconds per training step of fp32 AdamW at ``size`` on ``device`` (forward, backward, step; bf16 autocast
    on a GPU), the median of ``steps`` after two untimed ones: how many runs a slice holds."""
    cfg = SIZES[size]
    model = CharGPT(256, cfg["block"], cfg["n_layer"], cfg["n_head"], cfg["n_embd"]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], fused=device == "cuda")
    x = torch.randint(0, 256, (cfg["batch"], cfg["block"]), device=device)
    times = []
    for i in range(steps + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(x, x)[1]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def result_path(size: str, row: str, seed: int) -> Path:
    return RESULTS / size / f"{row}_s{seed}.json"


def run_slice(runs: list[tuple[str, str, int]], device: str, max_seconds: float | None, corpus_mb: float) -> list[Path]:
    """Train the runs not on disk yet, in order, writing each when it ends; stop before one that would not
    finish within ``max_seconds`` (its size's longest run so far stands for it)."""
    start, longest, written = time.perf_counter(), {}, []
    for size, row, seed in runs:
        path = result_path(size, row, seed)
        if path.exists():
            continue
        left = None if max_seconds is None else max_seconds - (time.perf_counter() - start)
        if left is not None and (left <= 0 or longest.get(size, 0.0) > left):
            print(f"stopping: {size} runs take about {longest.get(size, 0.0):.0f} s, {max(left, 0.0):.0f} s left", flush=True)
            break
        began = time.perf_counter()
        result = train(size, row, seed, device, corpus_mb)
        longest[size] = max(longest.get(size, 0.0), time.perf_counter() - began)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)
        written.append(path)
        print(f"{size} {row} seed {seed}: {result['status']}"
              + (f", val loss {result['val_loss']:.4f}, {result['seconds']:.0f} s" if result["status"] == "ok" else ""), flush=True)
    return written


def load(size: str) -> dict[tuple[str, int], dict[str, Any]]:
    out = {}
    for path in sorted((RESULTS / size).glob("*.json")):
        r = json.loads(path.read_text())
        out[(r["row"], r["seed"])] = r
    return out


def report(size: str) -> str:
    """The table of ``size``'s runs on disk: per row the mean validation loss and its standard error over the
    seeds, the paired difference to fp32 on the same seeds, state bytes per parameter, peak memory, tokens/s."""
    runs = load(size)
    if not runs:
        return f"No runs of size {size} under {RESULTS / size}."
    fp32 = {s: r["val_loss"] for (row, s), r in runs.items() if row == "fp32" and r["status"] == "ok"}
    lines = []
    for row, what in ROWS.items():
        mine = [r for (name, _), r in sorted(runs.items()) if name == row]
        if not mine:
            continue
        ok = [r for r in mine if r["status"] == "ok"]
        if not ok:
            lines.append([row, what, "-", "-", "-", "-", "-", mine[0]["status"]])
            continue
        losses = [r["val_loss"] for r in ok]
        se = statistics.stdev(losses) / math.sqrt(len(losses)) if len(losses) > 1 else float("nan")
        diffs = [r["val_loss"] - fp32[r["seed"]] for r in ok if r["seed"] in fp32]
        paired = "-"
        if diffs and row != "fp32":
            dse = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else float("nan")
            paired = f"{statistics.fmean(diffs):+.4f} +- {dse:.4f} ({len(diffs)} seeds)"
        n = ok[0]["params"]
        lines.append([row, what, f"{statistics.fmean(losses):.4f} +- {se:.4f} ({len(ok)})", paired,
                      f"{statistics.fmean(r['state_bytes'] for r in ok) / n:.3f}",
                      f"{max(r['peak_memory'] for r in ok) / 2**30:.2f}",
                      f"{statistics.fmean(r['tokens_per_second'] for r in ok):,.0f}", "ok"])
    first = next(r for r in runs.values() if r["status"] == "ok") if any(r["status"] == "ok" for r in runs.values()) else None
    where = f"{first['machine']}; peak memory: {first['peak_memory_kind']}" if first else ""
    head = ["row", "what", "val loss (mean +- SE, seeds)", "vs fp32 (paired)", "state B/param", "peak memory (GiB)",
            "tokens/s", "status"]
    return f"**{size}** ({where})\n\n" + markdown_table(head, lines)


def plot(size: str) -> Path | None:
    """The training-loss curves of ``size``'s runs (every row, each seed a line) as
    ``docs/benchmarks/quality-at-scale-<size>.png``; ``None`` without matplotlib or runs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = [r for r in load(size).values() if r["status"] == "ok"]
    if not runs:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {row: f"C{i}" for i, row in enumerate(ROWS)}
    for r in sorted(runs, key=lambda r: (list(ROWS).index(r["row"]), r["seed"])):
        steps, losses = zip(*r["curve"])
        ax.plot(steps, losses, color=colours[r["row"]], alpha=0.8, lw=1,
                label=r["row"] if r["seed"] == min(x["seed"] for x in runs if x["row"] == r["row"]) else None)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats per byte)")
    ax.set_title(f"{size}: {runs[0]['params']:,} parameters, {runs[0]['device']}")
    ax.legend(fontsize=8)
    path = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / f"quality-at-scale-{size}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=list(SIZES), help="only runs of this size (default: the plan's order)")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), help="only these rows")
    parser.add_argument("--seeds", nargs="+", type=int, help="only these seeds")
    parser.add_argument("--max-seconds", type=float, help="stop before a run that would not finish in this time")
    parser.add_argument("--corpus-mb", type=float, default=32.0, help="megabytes of the standard library's source")
    parser.add_argument("--report-only", action="store_true", help="print the tables of the runs on disk")
    parser.add_argument("--time-steps", action="store_true", help="only time one training step of each size here")
    parser.add_argument("--docs", action="store_true", help="write the tables into docs/benchmarks/quality-at-scale.md")
    args = parser.parse_args()
    if args.time_steps:
        for size in ([args.size] if args.size else [z for z in SIZES if z != "tiny"]):
            seconds = time_steps(size, args.device)
            print(f"{size}: {seconds * 1e3:.1f} ms per step, {seconds * SIZES[size]['steps'] / 60:.1f} min per run of "
                  f"{SIZES[size]['steps']} steps", flush=True)
        return
    if not args.report_only:
        if args.size is not None:
            runs = [(args.size, r, s) for s in (args.seeds or [0, 1]) for r in (args.rows or list(ROWS))]
        else:
            runs = [(z, r, s) for z, r, s in PLAN if (args.rows is None or r in args.rows) and (args.seeds is None or s in args.seeds)]
        run_slice(runs, args.device, args.max_seconds, args.corpus_mb)
    sizes = [args.size] if args.size else [z for z in SIZES if (RESULTS / z).is_dir()]
    parts = []
    for z in sizes:
        parts.append(report(z))
        picture = plot(z) if args.docs else None
        if picture is not None:
            parts.append(f"![Training loss of the {z} runs]({picture.name})")
    body = f"Machine and torch per table. Command: `{command()}`\n\n" + "\n\n".join(parts)
    print(body)
    if args.docs:
        write_docs_section("benchmarks/quality-at-scale.md", "quality_at_scale", body)


if __name__ == "__main__":
    main()
