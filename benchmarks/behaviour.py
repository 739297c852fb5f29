"""Does a change of the code's layout keep every result to the bit? Short runs recorded and compared.

A move of modules, a split of classes or a renamed helper must not change what the library computes.
This script records, through the public API only (``lightning_baoc`` and ``lightning_baoc.optim``),
the results of a fixed set of short runs:

- ``BlockwiseAdamW``: every format x every CPU backend (the eager step, the compiled step, the Triton
  step in Triton's interpreter where triton is installed), started in the format and converted into it
  from fp32 after 3 steps, with a non-finite gradient skipped: the parameters, each parameter's decoded
  state (``param_state``), the compact state dict;
- ``BlockwiseSGD`` and ``BlockwiseLion``: every momentum format x eager and compiled;
- bf16 weights with their master-weight corrections (``ecc8``, ``ecc16``);
- the callback (``BAOC``) in a Lightning fit: fp32 AdamW, SGD, bf16-true with corrections, a crash and
  resume from the checkpoint; ``BAOCStrategy`` in a Fabric loop; DDP and FSDP2
  (``ModelParallelStrategy``) on 2 gloo ranks: the parameters, formats, allocation, history and the
  report JSON (``baoc_allocation.json``).

``record OUT`` writes them to a ``torch.save`` file; ``compare A B`` says, per artifact, whether two
records are identical (tensors by ``torch.equal``, everything else by ``==``) and exits 1 if any
differs. ``--before COMMIT`` records the library as it was at ``COMMIT`` (a temporary git worktree)
and as it is in this checkout, on this machine (records from different CPUs can differ in float
reductions), and compares them::

    python benchmarks/behaviour.py --before a828927          # before the move against this checkout
    python benchmarks/behaviour.py record /tmp/now.pt --only optimizer
    python benchmarks/behaviour.py compare /tmp/before.pt /tmp/now.pt

Every run is on one intra-op thread, seeded, on the CPU, with ``calibration="prior"`` (the measured
calibration times differ from run to run by nature).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from _report import checkout
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ("optimizer", "momentum", "corrections", "callback", "fabric", "ddp", "fsdp2")
WORLD = 2
# the internal switches of the Triton step on the CPU: where they live (the first module found is used)
_TRITON_SERVES = ("lightning_baoc.optim.stepping", "lightning_baoc.optim.step", "lightning_baoc.optim.dispatch")



# ---------------------------------------------------------------------------- the optimizer alone


def _params(shapes: list[tuple[int, ...]], dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(shape, generator=gen).to(dtype)) for shape in shapes]


def _grads(params: list[nn.Parameter], step: int, gen: torch.Generator, nonfinite_at: int | None) -> None:
    for i, p in enumerate(params):
        g = torch.randn(p.shape, generator=gen) * (1.0 + 0.1 * step)
        if step == nonfinite_at and i == 0:
            g.view(-1)[0] = math.inf
        p.grad = g.to(p.dtype)


def _optimizer_record(opt: Any, params: list[nn.Parameter]) -> dict[str, Any]:
    return {"params": [p.detach().clone() for p in params], "formats": dict(opt.formats()),
            "state_bytes": opt.state_bytes(), "decoded": _decoded(opt), "state_dict": opt.state_dict()}


def _decoded(opt: Any) -> dict[str, Any]:
    """Each parameter's state decoded to fp32 (of a shard: this rank's; a factored one's expansion is a
    collective, asked on every rank in the same order)."""
    decoded = {}
    for name in sorted(opt.formats()):
        state = opt.param_state(name)
        if state is None:
            continue
        decoded[name] = {"exp_avg": None if state.exp_avg is None else state.exp_avg.clone(),
                         "v": state.dense_v().clone() if _has_v(state) else None}
    return decoded


def _has_v(state: Any) -> bool:
    return state.exp_avg_sq is not None or (state.row is not None and state.col is not None)


@contextlib.contextmanager
def _backend(name: str) -> Iterator[str]:
    """The ``kernels=`` policy for a backend; ``"triton"`` also routes CPU tensors to the Triton step."""
    if name != "triton":
        yield name
        return
    kernels = importlib.import_module("lightning_baoc.kernels")
    module = next(m for m in (_try_import(n) for n in _TRITON_SERVES) if m is not None and hasattr(m, "kernel_serves"))
    saved = kernels.TRITON_DEVICES, module.kernel_serves
    kernels.TRITON_DEVICES = {"cuda", "cpu"}
    module.kernel_serves = lambda *args: False
    try:
        yield "auto"  # the device step's policy: the Triton kernels where they serve
    finally:
        kernels.TRITON_DEVICES, module.kernel_serves = saved


def _try_import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _backends() -> list[str]:
    """The CPU backends: the eager and compiled steps, and the Triton step in Triton's interpreter where
    triton is installed (``record`` sets ``TRITON_INTERPRET=1`` before triton is imported)."""
    found = ["eager", "compiled"]
    if os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available() and _try_import("triton") is not None:
        found.append("triton")
    return found


SHAPES = [(37, 101), (64,), (3, 11), (256, 33)]


def scenario_optimizer() -> dict[str, Any]:
    from lightning_baoc import FORMATS, BlockwiseAdamW

    out: dict[str, Any] = {}
    for backend in _backends():
        for fmt in FORMATS:
            for start in ("direct", "converted"):
                with _backend(backend) as policy:
                    params = _params(SHAPES)
                    opt = BlockwiseAdamW([(f"w{i}", p) for i, p in enumerate(params)], lr=1e-2, weight_decay=0.05,
                                         state_format=fmt if start == "direct" else "fp32", min_8bit_numel=0,
                                         kernels=policy)
                    gen = torch.Generator().manual_seed(1)
                    for step in range(6):
                        if step == 3 and start == "converted":
                            opt.set_formats({f"w{i}": fmt for i in range(len(params))})
                        _grads(params, step, gen, nonfinite_at=4)
                        opt.step()
                    out[f"{backend}/{fmt}/{start}"] = _optimizer_record(opt, params)
    return out


def scenario_momentum() -> dict[str, Any]:
    from lightning_baoc import MOMENTUM_FORMATS, BlockwiseLion, BlockwiseSGD

    out: dict[str, Any] = {}
    for backend in ("eager", "compiled"):
        for cls, kwargs in ((BlockwiseSGD, {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-3}),
                            (BlockwiseLion, {"lr": 1e-3, "weight_decay": 0.1})):
            for fmt in MOMENTUM_FORMATS:
                params = _params(SHAPES)
                opt = cls([(f"w{i}", p) for i, p in enumerate(params)], state_format=fmt, min_8bit_numel=0,
                          kernels=backend, **kwargs)
                gen = torch.Generator().manual_seed(1)
                for step in range(6):
                    _grads(params, step, gen, nonfinite_at=4)
                    opt.step()
                record = {"params": [p.detach().clone() for p in params], "formats": dict(opt.formats()),
                          "state_bytes": opt.state_bytes(), "state_dict": opt.state_dict()}
                out[f"{backend}/{cls.__name__}/{fmt}"] = record
    return out


def scenario_corrections() -> dict[str, Any]:
    from lightning_baoc import BlockwiseAdamW

    out: dict[str, Any] = {}
    for backend in _backends():
        for fmt in ("fp32", "bf16", "int8", "int8_factored"):
            for correction in ("none", "ecc8", "ecc16"):
                with _backend(backend) as policy:
                    params = _params(SHAPES, torch.bfloat16)
                    opt = BlockwiseAdamW([(f"w{i}", p) for i, p in enumerate(params)], lr=3e-4, state_format=fmt,
                                         min_8bit_numel=0, weight_correction=correction, kernels=policy)
                    gen = torch.Generator().manual_seed(1)
                    for step in range(6):
                        _grads(params, step, gen, nonfinite_at=4)
                        opt.step()
                    out[f"{backend}/{fmt}/{correction}"] = _optimizer_record(opt, params)
    return out


# ---------------------------------------------------------------------------- Lightning and Fabric


def _data(n: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=gen)
    y = (x[:, :10] * torch.linspace(0.5, 2.0, 10)).argmax(1)
    return x, y


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 96), nn.LayerNorm(96), nn.GELU(), nn.Linear(96, 96), nn.LayerNorm(96), nn.GELU(),
                         nn.Linear(96, 10))


def _module(optimizer: str = "adamw", sharded: bool = False) -> Any:
    import lightning as L

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()
            self.losses: list[float] = []

        def configure_model(self) -> None:
            if not sharded:
                return
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x.to(next(self.parameters()).dtype)), y)
            self.losses.append(float(loss))
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.log("val_loss", nn.functional.cross_entropy(self.net(x.to(next(self.parameters()).dtype)), y))

        def configure_optimizers(self) -> Any:
            decay = [p for p in self.parameters() if p.dim() > 1]
            rest = [p for p in self.parameters() if p.dim() <= 1]
            groups = [{"params": decay, "weight_decay": 0.05}, {"params": rest, "weight_decay": 0.0}]
            if optimizer == "sgd":
                opt = torch.optim.SGD(groups, lr=0.05, momentum=0.9)
            else:
                opt = torch.optim.AdamW(groups, lr=3e-3)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, [lambda s: 1.0 / (1 + 0.02 * s)] * 2)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Module()


def _loaders(batch: int = 16) -> tuple[Any, Any]:
    from torch.utils.data import DataLoader, TensorDataset

    x, y = _data()
    xv, yv = _data(64, seed=1)
    return DataLoader(TensorDataset(x, y), batch_size=batch), DataLoader(TensorDataset(xv, yv), batch_size=64)


def _crash(at: int) -> Any:
    from lightning.pytorch.callbacks import Callback

    class Crash(Callback):
        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            if trainer.current_epoch == at:
                raise RuntimeError("planned crash")

    return Crash()


def _fit(root: Path, *, optimizer: str = "adamw", precision: str = "32-true", baoc_kwargs: dict[str, Any] | None = None,
         crash_at: int | None = None, ckpt_path: str | None = None, strategy: Any = "auto", devices: int = 1,
         sharded: bool = False, epochs: int = 4) -> dict[str, Any]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_baoc import BAOC

    L.seed_everything(0, verbose=False)
    settings = dict(memory_budget=0.3, warmup_steps=8, sample_every=2, reevaluate_every_n_epochs=2,
                    calibration="prior")
    settings.update(baoc_kwargs or {})
    baoc = BAOC(**settings)
    callbacks: list[Any] = [baoc, ModelCheckpoint(dirpath=root / "ckpt", save_last=True, save_top_k=-1,
                                                  every_n_epochs=1, save_on_train_epoch_end=True)]
    if crash_at is not None:
        callbacks.append(_crash(crash_at))
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision=precision, max_epochs=epochs,
                        accumulate_grad_batches=2, gradient_clip_val=1.0, callbacks=callbacks, deterministic=True,
                        logger=L.pytorch.loggers.CSVLogger(root, name="logs", version=0), enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(root))
    if precision == "bf16-true":
        with trainer.init_module():
            model = _module(optimizer, sharded)
    else:
        model = _module(optimizer, sharded)
    train, val = _loaders()
    try:
        trainer.fit(model, train, val, ckpt_path=ckpt_path)
    except RuntimeError as error:
        if crash_at is None or "planned crash" not in str(error):
            raise
        return {}
    opt = trainer.optimizers[0]
    report = Path(trainer.log_dir) / "baoc_allocation.json"
    params = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        params[name] = local.detach().clone()
    return {
        "losses": list(model.losses),
        "params": params,
        "formats": dict(opt.formats()),
        "state_bytes": opt.state_bytes(),
        "decoded": _decoded(opt),
        "allocation": _plain(baoc.allocation),
        "history": _plain(baoc.controller.history),
        "report": _report(report),
        "state_dict": _plain(opt.state_dict()) if not sharded else None,
    }


def _report(path: Path) -> Any:
    """The report JSON (``None`` where none was written)."""
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def _plain(value: Any) -> Any:
    """``value`` as JSON-like primitives (dataclasses, mappings and sequences walked)."""
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return _plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value


def scenario_callback() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        out["adamw"] = _fit(base / "adamw")
        out["sgd"] = _fit(base / "sgd", optimizer="sgd")
        out["bf16_corrections"] = _fit(base / "bf16", precision="bf16-true",
                                       baoc_kwargs={"corrections": ["none", "ecc8", "ecc16"], "memory_budget": 0.25})
        _fit(base / "resume", crash_at=3)
        out["resumed"] = _fit(base / "resume", ckpt_path=str(base / "resume" / "ckpt" / "last.ckpt"))
    return out


def scenario_fabric() -> dict[str, Any]:
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_baoc import BAOCStrategy

    with tempfile.TemporaryDirectory() as tmp:
        strategy = BAOCStrategy(memory_budget=0.3, warmup_steps=8, sample_every=2, calibration="prior", report_dir=tmp)
        fabric = Fabric(accelerator="cpu", devices=1, strategy=strategy, callbacks=[strategy])
        fabric.seed_everything(0, verbose=False)
        model = _mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
        model, optimizer = fabric.setup(model, optimizer)
        x, y = _data()
        train = fabric.setup_dataloaders(DataLoader(TensorDataset(x, y), batch_size=16))
        losses = []
        for epoch in range(3):
            for xb, yb in train:
                loss = nn.functional.cross_entropy(model(xb), yb)
                fabric.backward(loss)
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad()
                losses.append(float(loss))
            fabric.call("on_train_epoch_end", epoch=epoch)
        report = _report(Path(tmp) / "baoc_allocation.json")
        return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "formats": dict(optimizer.formats()), "state_bytes": optimizer.state_bytes(),
                "decoded": _decoded(optimizer), "history": _plain(strategy.controller.history), "report": report,
                "state_dict": _plain(optimizer.state_dict())}


# ---------------------------------------------------------------------------- 2 gloo ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, kind: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(WORLD), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    root = Path(out) / kind
    if kind == "ddp":
        result = _fit(root, strategy=DDPStrategy(), devices=WORLD, epochs=3)
    else:
        result = _fit(root, strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
                      devices=WORLD, sharded=True, epochs=3)
    torch.save(result, Path(out) / f"{kind}_rank{rank}.pt")
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # past torch's C++ teardown, which can abort a finished rank (tests/support_distributed.py)


def _on_ranks(kind: str) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(_free_port(), kind, tmp), nprocs=WORLD, join=True)
        return {f"rank{r}": torch.load(Path(tmp) / f"{kind}_rank{r}.pt", weights_only=False) for r in range(WORLD)}


def scenario_ddp() -> dict[str, Any]:
    return _on_ranks("ddp")


def scenario_fsdp2() -> dict[str, Any]:
    return _on_ranks("fsdp2")


# ---------------------------------------------------------------------------- record and compare


def record(path: Path, only: list[str]) -> None:
    if not torch.cuda.is_available() and "triton" not in sys.modules:  # CPU tensors through Triton's interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    warnings.filterwarnings("ignore")  # the runs' own warnings (a non-finite gradient skipped, Lightning's hints)
    torch.set_num_threads(1)
    result: dict[str, Any] = {}
    for name in only:
        print(f"recording {name} ...", flush=True)
        result[name] = globals()[f"scenario_{name}"]()
    torch.save(result, path)
    print(f"recorded {', '.join(only)} in {path}")


def _differences(a: Any, b: Any, where: str) -> Iterator[str]:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            yield f"{where}: a tensor against {type(b).__name__ if isinstance(a, torch.Tensor) else type(a).__name__}"
        elif a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            yield f"{where}: tensors differ ({a.dtype} {tuple(a.shape)} / {b.dtype} {tuple(b.shape)})"
    elif isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                yield f"{where}/{key}: only in {'the second' if key not in a else 'the first'}"
            else:
                yield from _differences(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            yield f"{where}: {len(a)} entries against {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            yield from _differences(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return
    elif a != b:
        yield f"{where}: {a!r} != {b!r}"


def compare(first: Path, second: Path) -> int:
    a, b = torch.load(first, weights_only=False), torch.load(second, weights_only=False)
    rows, failed = [], 0
    for scenario in sorted(set(a) & set(b)):
        for key in sorted(set(a[scenario]) | set(b[scenario])):
            found = list(_differences(a[scenario].get(key), b[scenario].get(key), f"{scenario}/{key}"))
            failed += bool(found)
            rows.append((f"{scenario}/{key}", "identical" if not found else f"differs: {found[0]} (+{len(found) - 1})"))
    width = max(len(r[0]) for r in rows) if rows else 10
    print(f"| {'run'.ljust(width)} | result |\n|{'-' * (width + 2)}|--------|")
    for run, result in rows:
        print(f"| {run.ljust(width)} | {result} |")
    missing = sorted(set(a) ^ set(b))
    print(f"\n{len(rows) - failed} of {len(rows)} runs identical" + (f"; scenarios in one record only: {missing}" if missing else ""))
    return 1 if failed or missing else 0


def _record_at(commit: str, out: Path, only: list[str]) -> None:
    """Record the library as it was at ``commit``, with this version of the script."""
    with checkout(commit) as tree:
        env = dict(os.environ, PYTHONPATH=str(tree))
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "record", str(out), "--only", *only], check=True,
                       env=env, cwd=str(tree))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", nargs="?", choices=("record", "compare"), help="record one file, or compare two")
    parser.add_argument("paths", nargs="*", help="record: the file written; compare: the two files")
    parser.add_argument("--before", help="a commit: record it and this checkout, and compare them")
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, default=list(SCENARIOS), help="the scenarios run")
    args = parser.parse_args(argv)
    if args.before:
        with tempfile.TemporaryDirectory() as tmp:
            before, after = Path(tmp) / "before.pt", Path(tmp) / "after.pt"
            _record_at(args.before, before, args.only)
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "record", str(after), "--only", *args.only],
                           check=True, env=env, cwd=str(ROOT))
            return compare(before, after)
    if args.action == "record" and len(args.paths) == 1:
        record(Path(args.paths[0]), args.only)
        return 0
    if args.action == "compare" and len(args.paths) == 2:
        return compare(Path(args.paths[0]), Path(args.paths[1]))
    parser.error("say 'record OUT', 'compare A B' or '--before COMMIT'")
    return 2


if __name__ == "__main__":
    sys.exit(main())
