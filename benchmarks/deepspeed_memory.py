"""BAOC under Lightning's ``DeepSpeedStrategy`` against plain DeepSpeed AdamW: peak memory and state bytes of a
small GPT trained at ZeRO stages 2 and 3 on one device.

Each run is a fresh process (:func:`_report.run_child`): a byte-level GPT (``benchmarks/_models.py``'s
``CharGPT``) on the standard library's source, ``--steps`` steps, with ``configure_optimizers`` returning
``torch.optim.AdamW`` (DeepSpeed wraps it: its ZeRO optimizer holds fp32 moments) or the same with
``BAOC(memory_budget=...)`` (DeepSpeed's client is then ``BlockwiseAdamW``'s ZeRO client,
``lightning_baoc/optim/deepspeed.py``). On a GPU the figure is ``torch.cuda.max_memory_allocated`` over the
run and the optimizer's state bytes on the device; on the CPU (``--accelerator cpu``: a dry run, Lightning's
strategy made to run on CPU ranks with gloo, as the tests do) the process's peak resident set. Prints a table
with the machine, torch version and the command; ``--docs`` writes it into ``docs/deepspeed.md``.

    python benchmarks/deepspeed_memory.py --accelerator cuda --docs        # on a GPU
    python benchmarks/deepspeed_memory.py --accelerator cpu --size tiny    # the dry run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package

from _report import command, machine, markdown_table, run_child, write_docs_section  # noqa: E402

SIZES = {
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, block=64, batch=8),
    "40m": dict(n_layer=8, n_embd=640, n_head=10, block=256, batch=16),
}
ROWS = ("adamw", "baoc")


def run(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """One run (in its own process): ``config`` holds the size, stage, row, steps, accelerator and budget."""
    import lightning as L
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from _models import CharGPT
    from lightning_baoc import BAOC

    cfg = SIZES[config["size"]]
    accelerator = config["accelerator"]
    torch.manual_seed(0)
    data = torch.frombuffer(bytearray(_corpus()), dtype=torch.uint8).long()

    class GPT(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = CharGPT(256, cfg["block"], cfg["n_layer"], cfg["n_head"], cfg["n_embd"])
            self.generator = torch.Generator().manual_seed(1)

        def train_dataloader(self) -> Any:
            return range(config["steps"])

        def training_step(self, _: Any, batch_idx: int) -> torch.Tensor:
            starts = torch.randint(0, data.numel() - cfg["block"] - 1, (cfg["batch"],), generator=self.generator)
            x = torch.stack([data[s : s + cfg["block"]] for s in starts.tolist()])
            y = torch.stack([data[s + 1 : s + cfg["block"] + 1] for s in starts.tolist()])
            return self.model(x.to(self.device), y.to(self.device))[1]

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.model.parameters(), lr=1e-3, betas=(0.9, 0.95))

    strategy: Any
    zero = {"stage": config["stage"]}
    settings = {"zero_optimization": zero, "zero_allow_untested_optimizer": True,
                "train_micro_batch_size_per_gpu": cfg["batch"]}
    if accelerator == "cpu":
        strategy = _cpu_strategy(DeepSpeedStrategy)(config=settings)
    else:
        strategy = DeepSpeedStrategy(config=settings)
    warmup = max(4, config["steps"] // 5)
    callbacks = [BAOC(memory_budget=config["budget"], warmup_steps=warmup, sample_every=max(1, warmup // 4),
                      report=False)] if config["row"] == "baoc" else []
    module = GPT()
    trainer = L.Trainer(accelerator=accelerator, devices=1, strategy=strategy, max_steps=config["steps"],
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    if accelerator == "cuda":
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module)
    optimizer = trainer.strategy.deepspeed_engine.optimizer
    state = _state_bytes(optimizer)
    return {"params": sum(p.numel() for p in module.model.parameters()), "state_bytes": state,
            "peak_allocated": int(torch.cuda.max_memory_allocated()) if accelerator == "cuda" else None,
            "steps": trainer.global_step, "formats": sorted(set(callbacks[0].allocation.values())) if callbacks else []}


def _state_bytes(optimizer: Any) -> int:
    """The optimizer state's bytes: BAOC's client's own count, else the tensors in DeepSpeed's optimizer's state."""
    inner = getattr(optimizer, "optimizer", optimizer)
    if hasattr(inner, "state_bytes"):
        return int(inner.state_bytes())
    total = 0
    for state in getattr(inner, "state", {}).values():
        total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1)
    return total


def _cpu_strategy(base: type) -> type:
    """Lightning's DeepSpeed strategy on a CPU rank with gloo (it refuses every accelerator but CUDA): the dry run."""
    import argparse as _argparse

    from lightning.fabric.utilities.seed import reset_seed
    from lightning.pytorch.strategies import DDPStrategy

    class CPUDeepSpeed(base):  # type: ignore[misc, valid-type]
        def setup_environment(self) -> None:
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:
            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        def _get_process_group_backend(self) -> str:
            return "gloo"

        def _setup_model_and_optimizer(self, model: Any, optimizer: Any, lr_scheduler: Any = None) -> Any:
            import deepspeed

            engine, optimizer, _, _ = deepspeed.initialize(
                args=_argparse.Namespace(device_rank=self.local_rank), config=self.config, model=model,
                model_parameters=filter(lambda p: p.requires_grad, model.parameters()), optimizer=optimizer,
                lr_scheduler=lr_scheduler, dist_init_required=False)
            return engine, optimizer

    return CPUDeepSpeed


def _corpus() -> bytes:
    """About 1 MB of the standard library's source."""
    import sysconfig

    out = bytearray()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        out += path.read_bytes()
        if len(out) > 1 << 20:
            break
    return bytes(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--accelerator", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--size", default="40m", choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--budget", type=float, default=0.25, help="BAOC's memory budget, a share of AdamW's state")
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for the results")
    parser.add_argument("--docs", action="store_true", help="write the table into docs/deepspeed.md")
    args = parser.parse_args()
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--accelerator cuda: no CUDA device is visible to torch here (--accelerator cpu: the dry run)")
    results = []
    for stage in args.stages:
        for row in ROWS:
            config = dict(size=args.size, stage=stage, row=row, steps=args.steps, accelerator=args.accelerator,
                          budget=args.budget)
            env_port = str(29500 + 10 * stage + ROWS.index(row))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=env_port)
            result = run_child("deepspeed_memory", "run", f"zero{stage}-{row}", config)
            results.append({**config, **result})
            print(json.dumps(results[-1]), flush=True)
    peak = "peak allocated (MiB)" if args.accelerator == "cuda" else "peak resident set (MiB)"
    rows = []
    for r in results:
        value = r["peak_allocated"] if args.accelerator == "cuda" else r["peak_rss"]
        rows.append([f"ZeRO-{r['stage']}", "BAOC(memory_budget=%.2f)" % r["budget"] if r["row"] == "baoc"
                     else "DeepSpeed AdamW", f"{r['params'] / 1e6:.1f}M", f"{r['state_bytes'] / 2**20:.1f}",
                     f"{value / 2**20:.1f}", ", ".join(r["formats"]) or "fp32"])
    table = markdown_table(["stage", "optimizer", "parameters", "state (MiB)", peak, "formats"], rows)
    text = (f"{args.size} GPT, {args.steps} steps under Lightning's DeepSpeedStrategy on one "
            f"{'GPU' if args.accelerator == 'cuda' else 'CPU rank (the dry run)'}.\n\nMachine: {machine()}. "
            f"Command: `{command()}`\n\n{table}")
    print(text)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    if args.docs:
        write_docs_section("deepspeed.md", f"deepspeed_memory_{args.accelerator}", text)


if __name__ == "__main__":
    main()
