"""Quality of cheaper optimizer states on the three example workloads (the BAOC paper's table).

For each workload of ``examples/workloads.py`` (ViT on digits, character GPT, DDPM on digits), each
recipe (realistic: warm-up + cosine; stress: constant, higher learning rate) and each row (an
optimizer-state choice a user could make), train from the same seeds and report

- the optimizer-state bytes measured on the optimizer's real tensors at the end of training
  (:func:`measured_state_bytes`),
- the final quality (accuracy / perplexity / held-out denoising loss) as mean +- sample std over
  the seeds,
- the steps the row needs to reach fp32 AdamW's final quality (first validation step at which the
  seed-mean curve is at least as good as fp32's seed-mean final value; validation every
  ``steps / 10`` steps).

Rows: ``fp32`` (the module's own ``torch.optim.AdamW``); the uniform formats of
``BlockwiseAdamW`` (``bf16``, ``int8``, ``nomomentum``, ``factored``); ``fp16_nomomentum``, a naive
fp16-state AdamW without momentum (:class:`NaiveFP16AdamW`, defined here); the peers a user would
pick (bitsandbytes ``AdamW8bit``, torchao ``AdamW8bit``, Adam-mini), each ``unavailable: <reason>``
when it does not import or run on this machine; and the ``BAOC`` callback at budgets 0.5, 0.35 and
0.25 (``pending`` while ``lightning_baoc.BAOC`` does not import). Every run is cached as JSON under
``--results-dir`` (default ``benchmarks/runs/quality/``, tracked: the tables of ``docs/benchmarks/quality.md`` are
rebuilt from it), so an interrupted run resumes and a finished one is never trained again. Below each
workload's table the issue's targets are judged on the same runs (:func:`targets_table`).

Run from the repository root:

    python benchmarks/quality.py --docs                       # everything, 3 seeds (~5 hours on 2 CPUs)
    python benchmarks/quality.py --workloads vit_digits --recipes stress --seeds 3 4 5 6 7
    python benchmarks/quality.py --workloads vit_digits --rows fp32 int8 bf16 --steps 300 --results-dir /tmp/q
    python benchmarks/quality.py --report-only --docs         # tables from the cached runs only
    python benchmarks/quality.py --quick                      # smoke run: 1 workload, 2 rows, 6 steps
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import lightning as L
import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

from _report import DOCS, command, machine, markdown_table, write_docs_section  # noqa: E402
from lightning_baoc import BlockwiseAdamW  # noqa: E402
from lightning_baoc.optim import BlockwiseOptimizer  # noqa: E402
from workloads import RECIPES, WORKLOADS, Workload, build  # noqa: E402

HERE = Path(__file__).resolve().parent
PAGE = "benchmarks/quality.md"  # the docs page (under docs/) the tables go to
# Steps per run: long enough for the differences between rows to outgrow the seed spread on these
# small models (at 200-300 steps they did not); 12 rows x 2 recipes x 3 seeds take about 5 hours of
# 2 CPU cores, most of it the char GPT.
DEFAULT_STEPS = {"vit_digits": 1000, "char_gpt": 1000, "ddpm_digits": 1000}
RECIPE_NAMES = ("realistic", "stress")
BAOC_BUDGETS = {"baoc_0.5": 0.5, "baoc_0.35": 0.35, "baoc_0.25": 0.25}
CACHE_VERSION = 1  # bump when a change makes cached runs incomparable
# BAOC rows only: 2 since format conversions encode their pools in a fixed order (before, the
# stochastic-rounding noise of a conversion depended on the process's string-hash seed, so a BAOC
# run could not be reproduced bit for bit). Rows without a conversion are unaffected. 3 since the
# warm-up runs in the start allocation, within the budget (before, it held fp32 AdamW state). 4
# since the compiled CPU step and its numerics (stochastic rounding keyed by seed, name and step;
# a correctly rounded square root; two divisions as products by exact reciprocals).
BAOC_CACHE_VERSION = 4
# BAOC rows of past versions, kept beside today's: never trained again (the code that ran them is
# gone), read from the cache under their suffixed names. Suffix -> (cache version, label).
RECORDED_FAMILIES = {
    "fp32_warmup": (2, "fp32 warm-up (recorded)"),
    "eager_step": (3, "eager step (recorded)"),
}
RECORDED_BAOC = {f"{name}_{suffix}": suffix for name in BAOC_BUDGETS for suffix in RECORDED_FAMILIES}
#: Lightning's accelerator of the runs (``--accelerator``); runs elsewhere than the CPU record it in
#: their config, so a cache never mixes devices.
ACCELERATOR = "cpu"


def set_accelerator(name: str) -> None:
    """Train the next runs on ``name`` (``"cpu"`` or ``"cuda"``; tables of cached runs need no device)."""
    global ACCELERATOR
    ACCELERATOR = name


def parse_table_arguments(parser: argparse.ArgumentParser, page: str) -> argparse.Namespace:
    """Add the arguments of a table of cached runs beside this one (``bf16_weights.py``, ``sgd_lion.py``:
    recipes, seeds, steps, threads, accelerator, report only, the docs ``page``), parse the command
    line, and set the threads and the accelerator."""
    parser.add_argument("--recipes", nargs="+", default=list(RECIPE_NAMES), choices=list(RECIPE_NAMES))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu",
                        help="where the runs train (default: cpu); cuda runs, their reference's included, are cached apart")
    parser.add_argument("--report-only", action="store_true", help="tables from the cached runs only")
    parser.add_argument("--docs", action="store_true", help=f"write the table into docs/{page}")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    set_accelerator(args.accelerator)
    return args


def machine_of(results: Iterable[dict[str, Any]]) -> str:
    """The machine the cached ``results`` were trained on, as they recorded it (this one where none did)."""
    seen = sorted({r["machine"] for r in results if r.get("machine")})
    return "; ".join(seen) if seen else machine()


# ------------------------------------------------------------------------ reference optimizer


class NaiveFP16AdamW(torch.optim.Optimizer):
    """AdamW as a naive user would shrink it: no momentum, second moment stored in fp16.

    The reference for the paper's "uniform low precision (FP16 / no momentum)" row, 2 bytes per
    parameter. Per step, with ``g`` the gradient and ``v`` the fp16 state:

        v <- fp16_round_to_nearest(beta2 * v + (1 - beta2) * g^2)
        p <- p * (1 - lr * weight_decay) - lr * g / (sqrt(v / (1 - beta2^t)) + eps)

    The math runs in fp32; only the stored ``v`` is fp16 (round to nearest, as ``Tensor.half()``),
    so ``g^2`` under fp16's smallest subnormal (6e-8, i.e. ``|g|`` < 2.4e-4) is lost and the update
    divides a raw gradient by little more than ``eps``. ``betas[0]`` is accepted for AdamW's
    signature and ignored. Slow, readable, not for production.

    Args:
        params: Parameters or param groups.
        lr: Learning rate (default: 1e-3).
        betas: ``(beta1, beta2)``; beta1 is unused (default: (0.9, 0.999)).
        eps: Added to the denominator (default: 1e-8).
        weight_decay: Decoupled weight decay (default: 1e-2).

    Example:
        >>> opt = NaiveFP16AdamW(nn.Linear(4, 4).parameters(), lr=1e-3)
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ) -> None:
        if not 0.0 <= lr:
            raise ValueError(f"Invalid learning rate: {lr=}")
        if not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid beta2 parameter: {betas[1]=}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (_, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float16)
                state["step"] += 1
                g = p.grad.float()
                v = state["exp_avg_sq"].float().mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                state["exp_avg_sq"].copy_(v)  # round to nearest fp16: the naive part
                denom = (state["exp_avg_sq"].float() / (1.0 - beta2 ** state["step"])).sqrt_().add_(eps)
                p.mul_(1.0 - lr * wd)
                p.add_((g / denom).to(p.dtype), alpha=-lr)
        return loss


# ------------------------------------------------------------------------------ measurement


def _leaf_tensors(value: Any) -> Iterator[Tensor]:
    """Plain tensors inside a state value, through tensor subclasses (torchao's 8-bit states)."""
    if not isinstance(value, Tensor):
        return
    if type(value) is not Tensor and hasattr(value, "__tensor_flatten__"):
        names, _ = value.__tensor_flatten__()
        for name in names:
            yield from _leaf_tensors(getattr(value, name))
    else:
        yield value


def measured_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state really allocated by ``optimizer``.

    ``BlockwiseAdamW``: its ``state_bytes()`` (tested to equal its pools' storage). Any other
    optimizer: the sum of ``untyped_storage().nbytes()`` over the unique storages of the tensors in
    ``optimizer.state`` (tensor subclasses flattened to their inner tensors; tensors sharing a
    storage, e.g. a quantization map, counted once). The per-tensor ``step`` counters are left out,
    as ``BlockwiseAdamW.state_bytes()`` leaves them out: they are bookkeeping of a few bytes per
    tensor, not per element. So fp32 ``torch.optim.AdamW`` measures exactly 8 bytes per parameter.
    """
    if isinstance(optimizer, BlockwiseOptimizer):  # BlockwiseAdamW, BlockwiseSGD, BlockwiseLion
        return int(optimizer.state_bytes())
    storages: dict[tuple[str, int], int] = {}
    for state in optimizer.state.values():
        for key, value in state.items():
            if key == "step":
                continue
            for t in _leaf_tensors(value):
                storage = t.untyped_storage()
                if storage.nbytes():
                    storages[(str(t.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


# -------------------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class Row:
    """One optimizer-state choice.

    Attributes:
        name: Key on the command line and in the cache.
        label: Text in the table.
        make: Builds the optimizer for a module (None: the module's own ``torch.optim.AdamW``).
        budget: BAOC's memory budget (BAOC rows only).
        module: Python package the row needs, for the availability check and its version.
        recorded: the row is read from the cache only, never trained (a past version's runs).
        precision: Lightning's ``precision`` of the run (``"bf16-true"``: bf16 weights and gradients).
        baoc: More keyword arguments of ``BAOC`` as ``(name, value)`` pairs (BAOC rows only).
    """

    name: str
    label: str
    make: Callable[[Workload], torch.optim.Optimizer] | None = None
    budget: float | None = None
    module: str | None = None
    recorded: bool = False
    precision: str = "32-true"
    baoc: tuple[tuple[str, Any], ...] = ()  # more arguments of BAOC (BAOC rows only)


def _adamw_kwargs(module: Workload) -> dict[str, Any]:
    r = module.recipe
    return dict(lr=r.lr, betas=r.betas, eps=r.eps, weight_decay=r.weight_decay)


def _blockwise(fmt: str) -> Callable[[Workload], torch.optim.Optimizer]:
    def make(module: Workload) -> torch.optim.Optimizer:
        return BlockwiseAdamW(module.param_groups(), **_adamw_kwargs(module), state_format=fmt, param_names=module)

    return make


def _naive_fp16(module: Workload) -> torch.optim.Optimizer:
    return NaiveFP16AdamW(module.param_groups(), **_adamw_kwargs(module))


def _bnb(module: Workload) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(module.param_groups(), **_adamw_kwargs(module))  # default min_8bit_size=4096


def _torchao(module: Workload) -> torch.optim.Optimizer:
    from torchao.optim import AdamW8bit

    return AdamW8bit(module.param_groups(), **_adamw_kwargs(module))  # block 256; < 4096 elements stay fp32


def _adam_mini(module: Workload) -> torch.optim.Optimizer:
    from adam_mini import Adam_mini

    # Adam-mini finds blocks by parameter names; its README asks users to add their own names. It
    # takes named parameters, not groups, and picks weight decay by name (none for norm/ln/bias),
    # so the ViT's cls_token / pos_embed are decayed here, unlike in the AdamW groups.
    # dim / n_heads: the transformer's width and heads (unused by the conv UNet: no q/k names).
    hp = module.hparams
    dim = int(hp.get("dim", hp.get("n_embd", 64)))
    heads = int(hp.get("heads", hp.get("n_head", 1)))
    opt = Adam_mini(module.named_parameters(), **_adamw_kwargs(module), dim=dim, n_heads=heads, verbose=False)
    opt.wqk_names.add("qkv")  # fused q, k, v: one second moment per head of each
    opt.embd_names.add("wpe")  # the GPT's position embedding
    return opt


ROWS: dict[str, Row] = {
    r.name: r
    for r in [
        Row("fp32", "fp32 AdamW (torch)"),
        Row("bf16", "uniform bf16 (BlockwiseAdamW)", _blockwise("bf16")),
        Row("fp16_nomomentum", "uniform fp16 v, no momentum (naive reference)", _naive_fp16),
        Row("int8", "uniform int8 (BlockwiseAdamW)", _blockwise("int8")),
        Row("nomomentum", "uniform no momentum (BlockwiseAdamW)", _blockwise("nomomentum")),
        Row("factored", "uniform factored (BlockwiseAdamW)", _blockwise("factored")),
        Row("bnb_adamw8bit", "bitsandbytes AdamW8bit", _bnb, module="bitsandbytes"),
        Row("torchao_adamw8bit", "torchao AdamW8bit", _torchao, module="torchao"),
        Row("adam_mini", "Adam-mini", _adam_mini, module="adam_mini"),
        *(row for name, b in BAOC_BUDGETS.items()  # each beside its runs recorded by past versions
          for row in (Row(name, f"BAOC, budget {b}", budget=b),
                      *(Row(f"{name}_{suffix}", f"BAOC, budget {b}, {label}", budget=b, recorded=True)
                        for suffix, (_, label) in RECORDED_FAMILIES.items()))),
    ]
}


def _baoc_class() -> Any:
    from lightning_baoc import BAOC  # raises ImportError while the callback does not exist

    return BAOC


def availability(row: Row) -> str | None:
    """None if ``row`` can run here, else ``"unavailable: <reason>"`` / ``"pending: <reason>"``.

    A peer must import and take a few steps on the CPU over a 128 x 128 ``Linear`` (big enough for
    its 8-bit path) with finite results.
    """
    if row.recorded:
        return None
    if row.budget is not None:
        try:
            _baoc_class()
        except ImportError as err:
            return f"pending: lightning_baoc.BAOC does not import yet ({err})"
        return None
    if row.module is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module(row.module)
            probe = _Probe()
            opt = row.make(probe)  # type: ignore[misc]
            for _ in range(3):
                opt.zero_grad()
                probe.net(torch.randn(8, 128)).square().mean().backward()
                opt.step()
        if not all(torch.isfinite(p).all() for p in probe.parameters()):
            return "unavailable: non-finite parameters after 3 CPU steps"
    except Exception as err:  # any failure to import or run makes the row unavailable, with its reason
        return f"unavailable: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
    return None


class _Probe(Workload):
    """A 128 x 128 Linear with the ViT's recipe, for :func:`availability`."""

    name = "vit_digits"

    def __init__(self) -> None:
        super().__init__("realistic", 10)
        self.net = nn.Linear(128, 128)


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module.replace("_", "-"))
    except PackageNotFoundError:
        return "not installed"


# ------------------------------------------------------------------------------------ one run


class _Recorder(L.Callback):
    """Records ``(global_step, quality)`` at every validation; stops a run that went non-finite."""

    def __init__(self, metric: str) -> None:
        self.metric = metric
        self.curve: list[tuple[int, float]] = []
        self.diverged = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if isinstance(loss, Tensor) and not torch.isfinite(loss).all():
            self.diverged = True
            trainer.should_stop = True

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        value = float(metrics[self.metric])
        finite = math.isfinite(value) and all(math.isfinite(float(v)) for k, v in metrics.items() if k.startswith("val_"))
        if not finite:
            self.diverged = True
            trainer.should_stop = True
        if self.curve and self.curve[-1][0] == trainer.global_step:
            self.curve[-1] = (trainer.global_step, value)
        else:
            self.curve.append((trainer.global_step, value))


def _install_optimizer(module: Workload, make: Callable[[Workload], torch.optim.Optimizer]) -> None:
    """Make ``module.configure_optimizers`` return ``make(module)`` with the module's own schedule."""

    def configure_optimizers() -> dict[str, Any]:
        opt = make(module)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, module.lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    module.configure_optimizers = configure_optimizers  # type: ignore[method-assign]


def run_config(workload: str, recipe: str, row: str, seed: int, steps: int) -> dict[str, Any]:
    """What identifies a run in the cache; a cached run with another config is run again."""
    config = dict(version=CACHE_VERSION, workload=workload, recipe=recipe, row=row, seed=seed, steps=steps,
                  eval_every=eval_every(steps), torch=torch.__version__)
    if ACCELERATOR != "cpu":
        config["accelerator"] = ACCELERATOR
    if row in BAOC_BUDGETS:
        config["baoc_version"] = BAOC_CACHE_VERSION
    elif row in RECORDED_BAOC:
        config["baoc_version"] = RECORDED_FAMILIES[RECORDED_BAOC[row]][0]
    return config


def eval_every(steps: int) -> int:
    """Validation interval: ten validations per run (the last at ``steps``)."""
    return max(1, steps // 10)


def result_path(results_dir: Path, config: dict[str, Any]) -> Path:
    """Cache file of one run."""
    c = config
    return results_dir / c["workload"] / c["recipe"] / f"{c['row']}-seed{c['seed']}-steps{c['steps']}.json"


def train_one(workload: str, recipe: str, row: Row, seed: int, steps: int) -> dict[str, Any]:
    """Train one run and return its result (curve, final quality, state bytes, seconds, status)."""
    if ACCELERATOR == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--accelerator cuda: no CUDA device is visible to torch here")
    module, data = build(workload, recipe, steps, seed)
    callbacks: list[L.Callback] = []
    recorder = _Recorder(module.quality_metric)
    if row.budget is not None:
        BAOC = _baoc_class()
        # The runs here are a few hundred steps: BAOC's warm-up is scaled to a fifth of the run.
        callbacks.append(BAOC(memory_budget=row.budget, warmup_steps=max(20, steps // 5), seed=seed, report=False,
                              **dict(row.baoc)))
    elif row.make is not None:
        _install_optimizer(module, row.make)
    trainer = L.Trainer(
        max_steps=steps,
        accelerator=ACCELERATOR,
        devices=1,
        val_check_interval=eval_every(steps),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, recorder],
        precision=row.precision,
    )
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*non-finite gradient.*")
        trainer.fit(module, data)
        if not recorder.diverged and (not recorder.curve or recorder.curve[-1][0] != trainer.global_step):
            trainer.validate(module, data, verbose=False)
    seconds = time.perf_counter() - start
    optimizer = trainer.optimizers[0]
    # the allocation BAOC ended with: parameters per format
    formats = dict(Counter(optimizer.formats().values())) if isinstance(optimizer, BlockwiseOptimizer) else {}
    return dict(
        formats=formats,
        status="diverged" if recorder.diverged else "ok",
        curve=recorder.curve,
        final=recorder.curve[-1][1] if recorder.curve and not recorder.diverged else None,
        steps_done=trainer.global_step,
        state_bytes=measured_state_bytes(optimizer),
        params=module.num_parameters(),
        optimizer=f"{type(optimizer).__module__}.{type(optimizer).__name__}",
        seconds=round(seconds, 2),
        machine=machine(),
    )


def run_cached(results_dir: Path, workload: str, recipe: str, row: Row, seed: int, steps: int, rerun: bool = False) -> dict[str, Any]:
    """One run, from the cache if it holds it with the same config, else trained and cached."""
    config = run_config(workload, recipe, row.name, seed, steps)
    path = result_path(results_dir, config)
    if row.recorded:  # never trained again: the cached run, or a row marked missing
        found = load_cached(results_dir, workload, recipe, row.name, seed, steps)
        return found if found is not None else {"config": config, "status": "not recorded"}
    if path.exists() and not rerun:
        cached = json.loads(path.read_text())
        if cached.get("config") == config:
            return cached
    try:
        result = train_one(workload, recipe, row, seed, steps)
    except Exception as err:  # a peer failing mid-run is a result ("error: ..."), not a crash of the table
        traceback.print_exc()
        result = dict(status="error", error=f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}")
    result = {"config": config, **result}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)
    return result


def load_cached(
    results_dir: Path, workload: str, recipe: str, row: str, seed: int, steps: int, any_torch: bool = False
) -> dict[str, Any] | None:
    """A cached run, or None; ``any_torch``: whatever torch version trained it (tables of runs made
    on another machine, whose line in the table names its torch)."""
    config = run_config(workload, recipe, row, seed, steps)
    path = result_path(results_dir, config)
    if not path.exists():
        return None
    cached = json.loads(path.read_text())
    found = dict(cached.get("config", {}))
    if any_torch:
        found["torch"] = config["torch"]
    return cached if found == config else None


# -------------------------------------------------------------------------------- summarizing


@dataclass
class Summary:
    """The seeds of one (workload, recipe, row) reduced to table cells."""

    runs: int = 0
    finals: list[float] | None = None
    diverged: int = 0
    errors: list[str] | None = None
    state_bytes: list[int] | None = None
    params: int | None = None
    curve: list[tuple[int, float]] | None = None
    seconds: list[float] | None = None


def summarize(results: list[dict[str, Any]]) -> Summary:
    """Final qualities, divergences, state bytes and the seed-mean curve of a row's runs."""
    s = Summary(runs=len(results), finals=[], errors=[], state_bytes=[], seconds=[])
    curves = []
    for r in results:
        if r["status"] == "error":
            s.errors.append(r["error"])
            continue
        s.params = r["params"]
        s.state_bytes.append(r["state_bytes"])
        s.seconds.append(r["seconds"])
        if r["status"] == "diverged":
            s.diverged += 1
        else:
            s.finals.append(r["final"])
            curves.append({step: value for step, value in r["curve"]})
    if curves:
        common = sorted(set.intersection(*(set(c) for c in curves)))
        s.curve = [(step, statistics.fmean(c[step] for c in curves)) for step in common]
    return s


def steps_to_reach(curve: list[tuple[int, float]] | None, target: float, higher_is_better: bool) -> int | None:
    """First step of ``curve`` at least as good as ``target``; None if never."""
    for step, value in curve or []:
        if (value >= target) if higher_is_better else (value <= target):
            return step
    return None


def _num(value: float, digits: int) -> str:
    return f"{value:.3g}" if abs(value) >= 1e4 else f"{value:.{digits}f}"


def _fmt_quality(s: Summary, label: str) -> str:
    if s.runs == 0:
        return "not run"
    if s.errors and len(s.errors) == s.runs:
        return f"error: {s.errors[0]}"
    parts = []
    if s.finals:
        digits = 2 if label == "accuracy" else (3 if label == "perplexity" else 4)
        scale = 100.0 if label == "accuracy" else 1.0
        unit = "%" if label == "accuracy" else ""
        values = [v * scale for v in s.finals]
        std = f" ± {_num(statistics.stdev(values), digits)}{unit}" if len(values) > 1 else ""
        parts.append(f"{_num(statistics.fmean(values), digits)}{unit}{std} (n={len(values)})")
    if s.diverged:
        parts.append(f"diverged in {s.diverged}/{s.runs - len(s.errors or [])}")
    if s.errors:
        parts.append(f"error in {len(s.errors)}")
    return "; ".join(parts)


def _fmt_bytes(values: list[int] | None, params: int | None) -> tuple[str, str]:
    if not values or not params:
        return "-", "-"
    lo, hi = min(values), max(values)
    fp32 = 8 * params
    if lo == hi:
        return f"{lo:,}", f"{lo / fp32:.3f}"
    mean = statistics.fmean(values)
    return f"{mean:,.0f} ({lo:,}-{hi:,})", f"{mean / fp32:.3f}"


#: A row "fits" a BAOC budget when its measured state is at most this much over the budget.
FIT_TOLERANCE = 0.01
#: Rows that are one format for every tensor (what "uniform formats that fit" means).
_UNIFORM = ("bf16", "fp16_nomomentum", "int8", "nomomentum", "factored")
#: Where int8 has not been measured: the budget below which uniform int8 does not fit.
INT8_RATIO = 0.27


def _mean_sd(s: Summary) -> tuple[float, float, int] | None:
    """Mean, sample std and count of a row's finite finals; None without finals (or with a diverged seed)."""
    if not s.finals or s.diverged:
        return None
    return statistics.fmean(s.finals), statistics.stdev(s.finals) if len(s.finals) > 1 else 0.0, len(s.finals)


def _noise(a: tuple[float, float, int], b: tuple[float, float, int]) -> float:
    """Two standard errors of the difference of two seed means."""
    return 2.0 * math.sqrt(a[1] ** 2 / a[2] + b[1] ** 2 / b[2])


def targets_table(w: str, sums: dict[tuple[str, str], Summary], rows: list[str], recipes: list[str]) -> str:
    """The quality targets, judged on the cached runs of one workload.

    * parity: BAOC at 0.35 worse than fp32 AdamW by at most one fp32 std and 0.5% (relative);
    * at each budget: BAOC no worse than the best uniform format or peer that fits the budget
      (measured state <= budget x (1 + FIT_TOLERANCE)) beyond noise (two standard errors of the
      difference of the seed means);
    * below uniform int8's measured state (budget 0.25): better than each fitting uniform format
      that is worse than fp32 beyond noise.

    "Worse" is signed by the workload's direction (lower accuracy, higher loss or perplexity).
    """
    cls = WORKLOADS[w]
    scale = 100.0 if cls.quality_label == "accuracy" else 1.0
    unit = " pt" if scale != 1.0 else ""

    def worse(a: float, b: float) -> float:  # how much worse a is than b
        return (b - a) if cls.higher_is_better else (a - b)

    def ratio(row: str) -> float | None:
        byts = [b for r in recipes for b in (sums[r, row].state_bytes or [])]
        params = next((sums[r, row].params for r in recipes if sums[r, row].params), None)
        return statistics.fmean(byts) / (8 * params) if byts and params else None

    ratios = {r: x for r in rows if ROWS[r].budget is None and r != "fp32" and (x := ratio(r)) is not None}
    int8_ratio = ratios.get("int8", INT8_RATIO)
    lines = []
    for recipe in recipes:
        ref = _mean_sd(sums[recipe, "fp32"]) if "fp32" in rows else None
        if ref is None:
            continue
        if "baoc_0.35" in rows and (b := _mean_sd(sums[recipe, "baoc_0.35"])) is not None:
            d = worse(b[0], ref[0])
            ok = d <= ref[1] and d <= 0.005 * abs(ref[0])
            tail = ""
            a_curve, r_curve = sums[recipe, "baoc_0.35"].curve or [], sums[recipe, "fp32"].curve or []
            if len(a_curve) >= 3 and len(r_curve) >= 3:  # the same, on the mean of the last 3 validations
                d3 = worse(statistics.fmean(v for _, v in a_curve[-3:]), statistics.fmean(v for _, v in r_curve[-3:]))
                tail = f"; over the last 3 validations {d3 * scale:+.4g}{unit}"
            lines.append([recipe, "BAOC 0.35 no worse than fp32 AdamW by 1 std or 0.5%",
                          f"{d * scale:+.4g}{unit} ({d / abs(ref[0]):+.2%}); fp32 std {ref[1] * scale:.3g}{unit}{tail}",
                          "met" if ok else "missed"])
        for name, budget in BAOC_BUDGETS.items():
            if name not in rows or (b := _mean_sd(sums[recipe, name])) is None:
                continue
            fits = [r for r, x in ratios.items() if x <= budget * (1 + FIT_TOLERANCE)]
            fitting = [(r, m) for r in fits if (m := _mean_sd(sums[recipe, r])) is not None]
            dead = [r for r in fits if sums[recipe, r].diverged]
            if fitting:
                best_row, best = min(fitting, key=lambda rm: worse(rm[1][0], 0.0))
                d, n = worse(b[0], best[0]), _noise(b, best)
                lines.append([recipe, f"BAOC {budget} vs best that fits ({ROWS[best_row].label})",
                              f"{d * scale:+.4g}{unit} (noise {n * scale:.3g}{unit})",
                              "met" if d <= n else "missed"])
            if budget < int8_ratio:  # below int8: only formats without an 8-bit momentum fit uniformly
                degraded = [(r, m) for r, m in fitting if r in _UNIFORM
                            and worse(m[0], ref[0]) > _noise(m, ref)]
                for r, m in degraded:
                    d, n = worse(m[0], b[0]), _noise(b, m)
                    lines.append([recipe, f"BAOC {budget} clearly better than {ROWS[r].label} (degraded)",
                                  f"{d * scale:+.4g}{unit} better (noise {n * scale:.3g}{unit})",
                                  "met" if d > n else "missed"])
                for r in dead:
                    lines.append([recipe, f"BAOC {budget} clearly better than {ROWS[r].label}",
                                  "that row diverged", "met"])
    if not lines:
        return ""
    return (f"Targets on {w} (from the runs above; noise = two standard errors of the difference of the seed "
            "means):\n\n" + markdown_table(["recipe", "target", "measured", "verdict"], lines))



def tables(results_dir: Path, workloads: list[str], rows: list[str], recipes: list[str], seeds: list[int],
           steps: dict[str, int], unavailable: dict[str, str]) -> tuple[str, dict[str, Any]]:
    """The markdown tables (one per workload) from the cached runs, and the data for the plot."""
    out, plot, not_run = [], {}, []
    for w in workloads:
        cls = WORKLOADS[w]
        sums: dict[tuple[str, str], Summary] = {}
        found_runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for recipe in recipes:
            for row in rows:
                found = [load_cached(results_dir, w, recipe, row, seed, steps[w]) for seed in seeds]
                found_runs[recipe, row] = [r for r in found if r is not None]
                sums[recipe, row] = summarize(found_runs[recipe, row])
        headers = ["row", "state bytes", "x fp32 AdamW"]
        for recipe in recipes:
            headers += [f"{recipe}: {cls.quality_label}", f"{recipe}: steps to fp32's final"]
        headers.append("s / run")
        table_rows = []
        for row in rows:
            label = ROWS[row].label
            if row in unavailable:
                table_rows.append([label, unavailable[row]] + ["-"] * (len(headers) - 2))
                continue
            if all(sums[recipe, row].runs == 0 for recipe in recipes):
                not_run.append(f"`{row}` on {w}")
            all_bytes = [b for recipe in recipes for b in (sums[recipe, row].state_bytes or [])]
            params = next((sums[recipe, row].params for recipe in recipes if sums[recipe, row].params), None)
            cells = [label, *_fmt_bytes(all_bytes, params)]
            for recipe in recipes:
                s, ref = sums[recipe, row], sums[recipe, "fp32"] if (recipe, "fp32") in sums else None
                cells.append(_fmt_quality(s, cls.quality_label))
                if ref is not None and ref.finals and s.curve:
                    target = statistics.fmean(ref.finals)
                    reached = steps_to_reach(s.curve, target, cls.higher_is_better)
                    cells.append(str(reached) if reached is not None else f"not in {steps[w]}")
                else:
                    cells.append("-")
                if s.finals and params:
                    plot.setdefault((w, recipe), []).append(
                        (label, statistics.fmean(all_bytes) / (8 * params), statistics.fmean(s.finals),
                         statistics.stdev(s.finals) if len(s.finals) > 1 else 0.0)
                    )
            secs = [x for recipe in recipes for x in (sums[recipe, row].seconds or [])]
            cells.append(f"{statistics.median(secs):.0f}" if secs else "-")
            table_rows.append(cells)
        params = next((s.params for s in sums.values() if s.params), None)
        recipe_text = "; ".join(
            f"{r}: {RECIPES[w][r].schedule} lr {RECIPES[w][r].lr:g}"
            + (f", {RECIPES[w][r].warmup_fraction:.0%} warm-up" if RECIPES[w][r].warmup_fraction else "")
            for r in recipes
        )
        found_seeds = sorted({r["config"]["seed"] for recipe in recipes for row in rows
                              for r in found_runs.get((recipe, row), [])})
        verdicts = targets_table(w, sums, rows, recipes)
        out.append(
            f"**{w}** ({params:,} parameters; {steps[w]} steps, validation every {eval_every(steps[w])}; "
            f"seeds {_seed_text(found_seeds)}; {recipe_text})\n\n" + markdown_table(headers, table_rows)
            + (f"\n\n{verdicts}" if verdicts else "")
            if params else f"**{w}**: no cached runs\n"
        )
    if not_run:
        out.append(
            "Not run in this measurement: " + ", ".join(not_run)
            + " (add them with `--rows NAME ...`; the cached runs are kept)."
        )
    return "\n\n".join(out), plot


def start_comparison(results_dir: Path, workloads: list[str], recipes: list[str], seeds: list[int],
                     steps: dict[str, int], suffix: str = "fp32_warmup") -> str:
    """Today's BAOC rows beside the same rows recorded by a past version (``suffix``, a key of
    :data:`RECORDED_FAMILIES`) and beside fp32 AdamW, on the same seeds: each difference with its
    noise (two standard errors of the difference of the seed means); "within noise" where both are
    inside it."""
    lines = []
    for w in workloads:
        cls = WORKLOADS[w]
        scale = 100.0 if cls.quality_label == "accuracy" else 1.0
        for recipe in recipes:
            def stats_of(row: str) -> tuple[float, float, int] | None:
                found = [load_cached(results_dir, w, recipe, row, seed, steps[w]) for seed in seeds]
                return _mean_sd(summarize([r for r in found if r is not None]))

            ref = stats_of("fp32")
            for name, budget in BAOC_BUDGETS.items():
                now, old = stats_of(name), stats_of(f"{name}_{suffix}")
                if now is None or old is None or ref is None or now[2] != old[2]:
                    continue
                d_old, n_old = now[0] - old[0], _noise(now, old)
                d_ref, n_ref = now[0] - ref[0], _noise(now, ref)
                cells = [f"{x[0] * scale:.4g} ± {x[1] * scale:.2g}" for x in (ref, old, now)]
                lines.append([w, recipe, budget, now[2], *cells, f"{d_old * scale:+.3g} ({n_old * scale:.2g})",
                              f"{d_ref * scale:+.3g} ({n_ref * scale:.2g})",
                              "yes" if abs(d_old) <= n_old and abs(d_ref) <= n_ref else "**no**"])
    if not lines:
        return ""
    label = RECORDED_FAMILIES[suffix][1]
    head = ["workload", "recipe", "budget", "seeds", "fp32 AdamW", f"BAOC, {label}", "BAOC, today",
            "today - recorded (noise)", "today - fp32 (noise)", "within noise of both"]
    intro = {
        "fp32_warmup": "The warm-up in the start allocation (BAOC rows since the budget holds from the first step)",
        "eager_step": "The compiled CPU step and its numerics (keyed stochastic rounding, correctly rounded square "
                      "root; BAOC rows since the kernels)",
    }[suffix]
    return (f"{intro} against the same rows recorded with the {label.replace(' (recorded)', '')} and against fp32 "
            "AdamW, seed means ± std (accuracy in %); noise = two standard errors of the difference:\n\n"
            + markdown_table(head, lines))


def paired_comparison(results_dir: Path, other_dir: Path, workloads: list[str], rows: list[str], recipes: list[str],
                      seeds: list[int], steps: dict[str, int]) -> str:
    """The runs of ``results_dir`` against those of ``other_dir`` (another version's cache), paired by
    seed: per row, the mean of the per-seed differences of the final quality with its standard error,
    and whether it lies within two of them."""
    lines = []
    for w in workloads:
        scale = 100.0 if WORKLOADS[w].quality_label == "accuracy" else 1.0
        for recipe in recipes:
            for row in rows:
                pairs = [(a["final"], b["final"]) for seed in seeds
                         if (a := load_cached(results_dir, w, recipe, row, seed, steps[w])) is not None
                         and (b := load_cached(other_dir, w, recipe, ROWS[row].name, seed, steps[w])) is not None
                         and a.get("final") is not None and b.get("final") is not None]
                if len(pairs) < 2:
                    continue
                diffs = [a - b for a, b in pairs]
                mean, sem = statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs))
                lines.append([w, recipe, ROWS[row].label, len(pairs), f"{statistics.fmean(b for _, b in pairs) * scale:.4g}",
                              f"{statistics.fmean(a for a, _ in pairs) * scale:.4g}", f"{mean * scale:+.3g} ± {sem * scale:.2g}",
                              "yes" if abs(mean) <= 2.0 * sem else "**no**"])
    if not lines:
        return ""
    head = ["workload", "recipe", "row", "seeds", "other runs: mean", "these runs: mean", "paired difference ± sem",
            "within 2 sem"]
    return (f"These runs against `{other_dir}`, paired by seed (accuracy in %):\n\n" + markdown_table(head, lines))


def _seed_text(seeds: list[int]) -> str:
    """``[0, 1, 2, 3]`` -> ``"0-3"``; otherwise a comma list."""
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds)) or "none"


def save_plot(plot: dict[Any, Any], workloads: list[str], recipes: list[str], path: Path) -> None:
    """State bytes (x fp32 AdamW) against quality, one panel per workload and recipe.

    One colour per row across panels, error bars of one std. A row whose quality is far off fp32's
    (accuracy under half of it, loss or perplexity over 1.5 times it) is drawn at the panel's edge
    with a triangle, so it does not squash the others.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(label for points in plot.values() for label, *_ in points))
    colors = {label: plt.get_cmap("tab20")(i % 20) for i, label in enumerate(labels)}
    fig, axes = plt.subplots(len(recipes), len(workloads), figsize=(4.5 * len(workloads) + 3.4, 3.6 * len(recipes)),
                             squeeze=False)
    for j, w in enumerate(workloads):
        higher = WORKLOADS[w].higher_is_better
        scale = 100.0 if WORKLOADS[w].quality_label == "accuracy" else 1.0
        for i, recipe in enumerate(recipes):
            ax = axes[i][j]
            points = plot.get((w, recipe), [])
            ref = next((y for label, _, y, _ in points if label == ROWS["fp32"].label), None)
            def far(y: float) -> bool:
                return ref is not None and ((y < 0.5 * ref) if higher else (y > 1.5 * ref))

            near = [(y, err) for _, _, y, err in points if not far(y)]
            if near:
                lo, hi = min(y - e for y, e in near) * scale, max(y + e for y, e in near) * scale
                pad = 0.15 * (hi - lo) + 1e-3 * abs(hi)
                ax.set_ylim(lo - pad, hi + pad)
            for label, x, y, err in points:
                if far(y):
                    edge = ax.get_ylim()[0] if higher else ax.get_ylim()[1]
                    ax.plot(x, edge, "v" if higher else "^", color=colors[label], markersize=9, clip_on=False)
                    ax.annotate(f"{y * scale:.3g}", (x, edge), fontsize=7, xytext=(5, 4 if higher else -10),
                                textcoords="offset points")
                else:
                    ax.errorbar(x, y * scale, yerr=err * scale, fmt="o", color=colors[label], capsize=3)
            ax.set_title(f"{w}, {recipe}", fontsize=10)
            ax.set_xlabel("optimizer-state bytes / fp32 AdamW")
            ax.set_ylabel(WORKLOADS[w].quality_label + (" (%)" if scale != 1.0 else ""))
            ax.grid(alpha=0.3)
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=colors[label]) for label in labels]
    fig.legend(handles, labels, loc="center right", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 3.2 / fig.get_figwidth(), 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------- main


def parse_steps(items: list[str] | None, workloads: list[str]) -> dict[str, int]:
    """``["300"]`` or ``["vit_digits=400", "char_gpt=250"]`` -> steps per workload."""
    steps = dict(DEFAULT_STEPS)
    for item in items or []:
        name, _, value = item.rpartition("=")
        try:
            n = int(value)
        except ValueError:
            raise SystemExit(f"Invalid --steps item: {item!r}; expected N or WORKLOAD=N") from None
        if n < 1:
            raise SystemExit(f"Invalid --steps item: {item!r}; steps must be >= 1")
        if name and name not in WORKLOADS:
            raise SystemExit(f"Invalid --steps item: {item!r}; workloads are {sorted(WORKLOADS)}")
        for w in [name] if name else workloads:
            steps[w] = n
    return steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS),
                        help="(default: all)")
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="(default: all)")
    parser.add_argument("--recipes", nargs="+", choices=RECIPE_NAMES, default=list(RECIPE_NAMES), help="(default: both)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="(default: 0 1 2)")
    parser.add_argument("--steps", nargs="+", default=None,
                        help=f"N for all workloads or WORKLOAD=N (default: {DEFAULT_STEPS})")
    parser.add_argument("--results-dir", type=Path, default=HERE / "runs" / "quality",
                        help="cache of the runs' JSON results (default: benchmarks/runs/quality)")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default: docs/SECTION.png with --docs, else RESULTS_DIR/SECTION.png)")
    parser.add_argument("--docs", "--readme", dest="docs", action="store_true",
                        help=f"write the tables into docs/{PAGE} (section --section; --readme: former name)")
    parser.add_argument("--section", default="quality",
                        help=f"section of docs/{PAGE} the tables go to (default: quality)")
    parser.add_argument("--report-only", action="store_true", help="no training: tables from the cached runs")
    parser.add_argument("--rerun", action="store_true", help="train the rows named by --rows again, ignoring their cached runs (fp32, added "
                        "as the reference when not named, comes from the cache)")
    parser.add_argument("--paired-with", type=Path, default=None, metavar="DIR",
                        help="also compare these runs with another version's cached runs in DIR, paired by seed")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default: 1: on a shared CPU, threads of models this small wait more "
                        "for each other than they gain)")
    parser.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu",
                        help="where the runs train (default: cpu); cuda runs are cached under RESULTS_DIR_cuda")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: vit_digits, rows fp32 and int8, realistic recipe, seed 0, 6 steps, writes no docs page")
    args = parser.parse_args(argv)
    if args.accelerator != "cpu":
        args.results_dir = args.results_dir.with_name(f"{args.results_dir.name}_{args.accelerator}")
    if args.quick:
        explicit = set(a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:]))
        if "--workloads" not in explicit:
            args.workloads = ["vit_digits"]
        if "--rows" not in explicit:
            args.rows = ["fp32", "int8"]
        if "--recipes" not in explicit:
            args.recipes = ["realistic"]
        if "--seeds" not in explicit:
            args.seeds = [0]
        if "--steps" not in explicit:
            args.steps = ["6"]
        args.docs = False
    args.named_rows = list(args.rows)  # what --rerun trains again
    if "fp32" not in args.rows:
        args.rows = ["fp32", *args.rows]  # the reference of "steps to fp32's final"
    return args


def main(argv: list[str] | None = None) -> str:
    """Run (or resume) the benchmark; returns the report (markdown)."""
    args = parse_args(argv)
    steps = parse_steps(args.steps, args.workloads)
    torch.set_num_threads(args.threads)
    set_accelerator(args.accelerator)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")
    rows = [ROWS[r] for r in args.rows]
    unavailable = {r.name: reason for r in rows if (reason := availability(r)) is not None}
    for name, reason in unavailable.items():
        print(f"{name}: {reason}", flush=True)
    if not args.report_only:
        for w in args.workloads:
            for seed in args.seeds:
                for recipe in args.recipes:
                    for row in rows:
                        if row.name in unavailable:
                            continue
                        result = run_cached(args.results_dir, w, recipe, row, seed, steps[w],
                                            args.rerun and row.name in args.named_rows)
                        final = result.get("final")
                        print(f"{w} {recipe} {row.name} seed {seed}: {result['status']}"
                              + (f", {WORKLOADS[w].quality_metric} {final:.4f}" if final is not None else "")
                              + (f", {result['state_bytes']:,} state bytes, {result['seconds']:.0f} s" if "seconds" in result else ""),
                              flush=True)
    body, plot = tables(args.results_dir, args.workloads, args.rows, args.recipes, args.seeds, steps, unavailable)
    # today's rows beside the last version's (the fp32 warm-up rows were compared with version 3's,
    # now the 'eager step' rows: docs/benchmarks/quality.md keeps that comparison's findings)
    comparison = start_comparison(args.results_dir, args.workloads, args.recipes, args.seeds, steps, "eager_step")
    if comparison:
        body += "\n\n" + comparison
    if args.paired_with is not None:
        paired = paired_comparison(args.results_dir, args.paired_with, args.workloads, args.rows, args.recipes,
                                   args.seeds, steps)
        body += "\n\n" + (paired or f"No run of these rows and seeds in both `{args.results_dir}` and `{args.paired_with}`.")
    left_out = [name for name in BAOC_BUDGETS if name not in args.rows]
    if left_out:
        reason = availability(ROWS[left_out[0]])
        body += (f"\n\nBAOC rows {', '.join(f'`{n}`' for n in left_out)}: "
                 + (reason if reason else "not in this measurement; add them with `--rows " + " ".join(left_out) + "`")
                 + ".")
    plot_path = args.plot or (DOCS if args.docs else args.results_dir) / f"{args.section}.png"
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    save_plot(plot, args.workloads, args.recipes, plot_path)
    versions = ", ".join(f"{m} {_version(m)}" for m in ("bitsandbytes", "torchao", "adam_mini") if any(r.module == m for r in rows))
    title = ("Quality: cheaper optimizer states on three workloads" if args.section == "quality"
             else f"Quality, longer runs ({', '.join(f'{w} {steps[w]} steps' for w in args.workloads)})")
    report = (
        f"## {title}\n\n"
        f"Machine: {machine()}. Peers: {versions or 'none'}. Command: `{command()}`\n\n"
        "Every run trains the workload's unchanged LightningModule (`examples/workloads.py`) with the row's "
        "optimizer over the module's two param groups and LR schedule; BAOC rows keep the module's own AdamW and add "
        "`BAOC(memory_budget=B, warmup_steps=max(20, steps // 5), seed=seed)` (warm-up: a fifth of the run). "
        "State bytes: measured on the optimizer's "
        "real tensors after training (`BlockwiseAdamW.state_bytes()`; for other optimizers the unique storages of "
        "`optimizer.state`, per-tensor step counters left out, so fp32 AdamW is exactly 8 bytes per parameter). "
        "Quality: final validation value, mean ± sample std over seeds. Steps to fp32's final: first validation "
        "step at which the row's seed-mean curve is at least as good as fp32 AdamW's seed-mean final value (strict: "
        "no tolerance, so a row 0.01% behind reads 'not in N'). "
        "Diverged: a non-finite training or validation loss (the run is stopped there). s / run: median wall "
        "seconds per run on a shared machine (compile time of torchao's kernels included). "
        + ("These are short runs (a few hundred steps: what fits about an hour of 2 shared CPU cores): a difference"
           if max(steps[w] for w in args.workloads) < 500 else "A difference")
        + " smaller than the seed spread is no evidence either way.\n\n"
        f"{body}\n\n"
        + (f"![state bytes against quality]({Path(os.path.relpath(plot_path, (DOCS / PAGE).parent)).as_posix()})\n\n"
           f"Plot: `{os.path.relpath(plot_path, HERE.parent)}` (state bytes against quality, written by the command)."
           if args.docs else f"Plot: `{plot_path}` (state bytes against quality).")
    )
    print(report)
    if args.docs:
        write_docs_section(PAGE, args.section, report)
    return report


if __name__ == "__main__":
    main()
