"""The rows of ``quality.py``'s table (an optimizer-state choice a user could make, and how to build its
optimizer for a workload), whether each can run here, the naive fp16 reference optimizer, and the optimizer
state measured on the optimizer's real tensors."""

from __future__ import annotations

import importlib
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch
from _report import examples_on_path
from torch import Tensor, nn

examples_on_path()

from workloads import Workload  # noqa: E402

from lightning_baoc import BlockwiseAdamW  # noqa: E402
from lightning_baoc.optim import BlockwiseOptimizer  # noqa: E402

BAOC_BUDGETS = {"baoc_0.5": 0.5, "baoc_0.35": 0.35, "baoc_0.25": 0.25}
# BAOC rows of past versions, kept beside today's: never trained again (the code that ran them is
# gone), read from the cache under their suffixed names. Suffix -> (cache version, label).
RECORDED_FAMILIES = {
    "fp32_warmup": (2, "fp32 warm-up (recorded)"),
    "eager_step": (3, "eager step (recorded)"),
}


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


#: BAOC budgets under quality.py's, trained by ``frontier.py`` only (rows of :data:`FRONTIER_ROWS`, not of
#: quality.py's tables): the allocation frontier down to 5% of fp32 AdamW's state.
FRONTIER_BAOC_BUDGETS = {"baoc_0.15": 0.15, "baoc_0.1": 0.1, "baoc_0.05": 0.05}

#: Rows of ``frontier.py`` that quality.py's tables leave out, trained through the same run function into
#: the same cache: the uniform AdamW formats of ``BlockwiseAdamW`` quality.py has no row of, and BAOC under
#: budget 0.25. ``offload`` has no row: its state is fp32 in host memory, the arithmetic of ``fp32``.
FRONTIER_ROWS: dict[str, Row] = {
    r.name: r
    for r in [
        Row("blockwise_fp32", "uniform fp32 (BlockwiseAdamW)", _blockwise("fp32")),
        Row("bf16_momentum", "uniform bf16 momentum, fp32 v (BlockwiseAdamW)", _blockwise("bf16_momentum")),
        Row("int8_factored", "uniform int8 momentum, factored v (BlockwiseAdamW)", _blockwise("int8_factored")),
        Row("nomomentum_int8", "uniform no momentum, int8 v (BlockwiseAdamW)", _blockwise("nomomentum_int8")),
        *(Row(name, f"BAOC, budget {b}", budget=b) for name, b in FRONTIER_BAOC_BUDGETS.items()),
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
