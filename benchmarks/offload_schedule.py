"""The interleaved offload schedule against static (host-only) offload, measured: the optimizer step of offloaded
parameters, and the iterations of a Lightning GPT whose fp32 states do not fit beside it.

Two parts, each for the schedules ``host`` (every subgroup updated on the CPU: ZeRO-Offload's static offload),
``interleaved`` (the model's choice per subgroup) and ``device`` (every subgroup on the GPU's path), beside the
plain ``fp32`` step with the states on the GPU where they fit:

1. **step**: ``--params`` parameters (1.2B by default) in tensors of ``--tensor`` elements, all ``offload``, with
   random gradients: the mean time of ``--steps`` optimizer steps after two warm-up steps (synchronized), the
   share of subgroups the model sent to the GPU, and the model's prediction of the update phase (at the rates
   measured during the warm-up: ``OffloadScheduler.measured``) beside the measured step.
2. **train**: a character GPT (``benchmarks/_models.py``, ``--layers`` x ``--width``) trained by a Lightning
   ``Trainer`` for ``--iterations`` iterations with every state offloaded: the median iteration time (after two),
   the peak GPU memory allocated, and the last loss.

Results: ``OUT/offload_schedule.json`` (every figure, the machine, torch's version and the command) and
``OUT/offload_schedule.md`` (the tables, also printed). Run from the repository root:

    python benchmarks/offload_schedule.py --out OUT          # on one GPU: 1.2B parameters, a 300M-parameter GPT
    python benchmarks/offload_schedule.py --tiny --out OUT   # a smoke run on the CPU (the CPU stands in for the GPU)

``benchmarks/cuda_offload.sh OUT`` runs the GPU command with its logs, under ten minutes on an H100 or H200.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import command, machine, markdown_table  # noqa: E402

from lightning_baoc import BlockwiseAdamW  # noqa: E402
from lightning_baoc.optim.offload_schedule import OffloadSchedule  # noqa: E402

SCHEDULES = ("host", "interleaved", "device")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _schedule(mode: str, subgroup_bytes: int) -> OffloadSchedule:
    return OffloadSchedule(mode, subgroup_bytes=subgroup_bytes)  # type: ignore[arg-type]


def step_part(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Part 1: the optimizer step of ``args.params`` offloaded parameters, per schedule."""
    sizes = [args.tensor] * (args.params // args.tensor) + ([args.params % args.tensor] if args.params % args.tensor else [])
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n, device=device) * 0.02) for n in sizes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    rows = []
    for mode in ("fp32",) + SCHEDULES:
        row: dict[str, Any] = {"schedule": mode, "params": args.params}
        opt = None
        try:
            if mode == "fp32":
                opt = BlockwiseAdamW([(f"p{i}", p) for i, p in enumerate(params)], state_format="fp32")
            else:
                opt = BlockwiseAdamW([(f"p{i}", p) for i, p in enumerate(params)], state_format="offload",
                                     offload_schedule=_schedule(mode, args.subgroup_bytes))
            for _ in range(2):  # states made, rates measured
                opt.step()
            _sync(device)
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                opt.step()
                _sync(device)
                times.append(time.perf_counter() - t0)
            row["step_s"] = statistics.mean(times)
            last = opt._offload.last.get(str(device))  # noqa: SLF001 - the schedule's own record of the step
            if last is not None:
                row["device_share"] = sum(last["on_device"]) / len(last["on_device"])
                row["subgroups"] = last["subgroups"]
                row["predicted_s"] = last["predicted_s"]["chosen"]
                row["predicted_host_s"] = last["predicted_s"]["host"]
                row["update_s"] = last["measured_s"]
                row["staging_bytes"], row["host_bytes"] = last["staging_bytes"], last["host_bytes"]
                row["rates"] = dict(opt._offload.measured)  # noqa: SLF001
        except (RuntimeError, torch.cuda.OutOfMemoryError) as err:  # fp32 or device that does not fit
            row["error"] = str(err).splitlines()[0][:200]
        finally:
            del opt
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    host = next((r["step_s"] for r in rows if r["schedule"] == "host" and "step_s" in r), None)
    for r in rows:
        if host and "step_s" in r:
            r["vs_host"] = r["step_s"] / host
        if "predicted_s" in r and r.get("update_s"):
            r["prediction_error"] = r["predicted_s"] / r["update_s"] - 1.0
    return rows


def train_part(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Part 2: a Lightning GPT with every state offloaded, per schedule (and fp32 states on the device)."""
    import lightning as L
    from _models import CharGPT

    class GPT(L.LightningModule):
        def __init__(self, fmt: str, schedule: OffloadSchedule | None) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = CharGPT(vocab_size=256, block_size=args.block, n_layer=args.layers, n_head=max(args.width // 64, 1),
                                 n_embd=args.width)
            self.fmt, self.schedule = fmt, schedule
            self.times: list[float] = []
            self.losses: list[float] = []
            self._t0 = 0.0

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            _, loss = self.model(batch[0], batch[1])
            return loss

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            _sync(device)
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            _sync(device)
            self.times.append(time.perf_counter() - self._t0)
            self.losses.append(float(outputs["loss"]))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return BlockwiseAdamW(self.model.named_parameters(), lr=3e-4, state_format=self.fmt,
                                  offload_schedule=self.schedule)

    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (args.iterations * args.batch, args.block + 1), generator=gen)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]), batch_size=args.batch)
    rows = []
    for mode in ("fp32",) + SCHEDULES:
        row: dict[str, Any] = {"schedule": mode}
        try:
            module = GPT("fp32" if mode == "fp32" else "offload", None if mode == "fp32" else _schedule(mode, args.subgroup_bytes))
            row["params"] = module.model.num_parameters()
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, max_steps=args.iterations,
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, precision="32-true")
            trainer.fit(module, loader)
            row["iteration_s"] = statistics.median(module.times[2:] or module.times)
            row["last_loss"] = module.losses[-1]
            if device.type == "cuda":
                row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            opt = trainer.optimizers[0]
            last = opt._offload.last.get(str(device))  # noqa: SLF001
            if last is not None:
                row["device_share"] = sum(last["on_device"]) / len(last["on_device"])
                row["predicted_update_s"] = last["predicted_s"]["chosen"]
                row["update_s"] = last["measured_s"]
            del trainer, module, opt
        except (RuntimeError, torch.cuda.OutOfMemoryError) as err:
            row["error"] = str(err).splitlines()[0][:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
    host = next((r["iteration_s"] for r in rows if r["schedule"] == "host" and "iteration_s" in r), None)
    for r in rows:
        if host and "iteration_s" in r:
            r["vs_host"] = r["iteration_s"] / host
    return rows


def _fmt(value: Any, spec: str) -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def tables(result: dict[str, Any]) -> str:
    """The markdown page of ``result``: machine, torch, command, then both parts' tables."""
    step_rows = [[r["schedule"], _fmt(r.get("step_s"), ".4g"), _fmt(r.get("vs_host"), ".2f"),
                  _fmt(r.get("device_share"), ".0%"), _fmt(r.get("predicted_s"), ".4g"), _fmt(r.get("update_s"), ".4g"),
                  _fmt(r.get("prediction_error"), "+.0%"), r.get("error", "")] for r in result["step"]]
    train_rows = [[r["schedule"], _fmt(r.get("iteration_s"), ".4g"), _fmt(r.get("vs_host"), ".2f"),
                   _fmt(r.get("peak_gib"), ".2f"), _fmt(r.get("device_share"), ".0%"),
                   _fmt(r.get("predicted_update_s"), ".4g"), _fmt(r.get("update_s"), ".4g"), _fmt(r.get("last_loss"), ".3f"),
                   r.get("error", "")] for r in result["train"]]
    params = result["step"][0]["params"] if result["step"] else 0
    gpt = result["train"][0].get("params", 0) if result["train"] else 0
    return "\n\n".join([
        f"Machine: {result['machine']}; torch {result['torch']}.\nCommand: `{result['command']}`",
        f"Optimizer step, {params / 1e6:.1f}M parameters offloaded (fp32 row: states on the device):",
        markdown_table(["schedule", "step s", "vs host", "on GPU", "predicted s", "update s", "prediction", "note"], step_rows),
        f"Lightning GPT, {gpt / 1e6:.1f}M parameters, every state offloaded (fp32 row: states on the device):",
        markdown_table(["schedule", "iteration s", "vs host", "peak GiB", "on GPU", "predicted update s", "update s",
                        "last loss", "note"], train_rows),
    ])


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="folder the JSON and markdown results are written to")
    parser.add_argument("--tiny", action="store_true", help="a smoke run on the CPU: 2M parameters, a 0.2M GPT")
    parser.add_argument("--params", type=int, default=1_200_000_000, help="offloaded parameters of the step part")
    parser.add_argument("--tensor", type=int, default=1 << 24, help="elements per tensor of the step part")
    parser.add_argument("--subgroup-bytes", type=int, default=64 << 20, help="fp32 bytes per subgroup")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps per schedule")
    parser.add_argument("--layers", type=int, default=24, help="GPT layers")
    parser.add_argument("--width", type=int, default=1024, help="GPT width")
    parser.add_argument("--block", type=int, default=256, help="GPT context")
    parser.add_argument("--batch", type=int, default=8, help="GPT batch")
    parser.add_argument("--iterations", type=int, default=8, help="GPT iterations per schedule")
    parser.add_argument("--skip-train", action="store_true", help="the step part only")
    args = parser.parse_args(argv)
    if args.tiny:
        args.params, args.tensor, args.subgroup_bytes, args.steps = 2_000_000, 1 << 18, 1 << 20, 2
        args.layers, args.width, args.block, args.batch, args.iterations = 2, 64, 32, 4, 4
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = _arguments(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"machine": machine(), "torch": torch.__version__, "device": str(device),
                              "command": command() if argv is None else "python benchmarks/offload_schedule.py " + " ".join(argv),
                              "step": step_part(args, device)}
    result["train"] = [] if args.skip_train else train_part(args, device)
    (out / "offload_schedule.json").write_text(json.dumps(result, indent=1))
    page = tables(result)
    (out / "offload_schedule.md").write_text(page + "\n")
    print(page)
    return result


if __name__ == "__main__":
    main()
