"""BAOC under Lightning's and Fabric's ``DeepSpeedStrategy`` (ZeRO stages 1-3): what the callback's DeepSpeed
branch and Fabric's ``BAOCStrategy(base="deepspeed")`` use.

DeepSpeed builds its engine from the optimizer ``configure_optimizers`` returns, inside the
strategy's ``setup``, before any ``on_fit_start``: the optimizer cannot be replaced afterwards.

- :func:`wrap_configure_optimizers` (the callback's ``setup``): the module's ``configure_optimizers``
  hands DeepSpeed a :class:`~lightning_baoc.optim.deepspeed.ZeroClient` over a fp32
  :class:`~lightning_baoc.BlockwiseAdamW` (``from_optimizer``: the user's groups and hyperparameters; a
  blockwise optimizer is kept), its LR schedulers rebound to the client;
- :func:`client_of`: the client that replaces one optimizer (Fabric's ``BAOCStrategy(base="deepspeed")``
  hands it to ``deepspeed.initialize`` in ``fabric.setup``);
- :func:`zero_client_of` (``on_fit_start``, after ``fabric.setup``): the engine's client, bound to
  DeepSpeed's partitions;
- :func:`fragment_module`: a stand-in module of the model's structure whose parameters are the
  client's fragments, under the model's names: the controller partitions it into blocks, samples its
  gradients and counts its bytes per rank (each tensor at the most any rank holds of it);
- :func:`check_offload`: DeepSpeed's optimizer offload combined with BAOC's formats (the flat fp32
  partitions and their states in host memory), or refused with the reason.

The gradients are observed where DeepSpeed hands them to the client (inside its ``step``, through the
optimizer's gradient observers): the callback opens a step's observation before the batch and
closes it after the step, as under gradient release.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from lightning_baoc.optim.deepspeed import ZeroClient, zero_client
from lightning_baoc.optim.swap import convert_optimizer, rebind_scheduler


def check_offload(config: dict[str, Any]) -> None:
    """Refuse what BAOC cannot combine with DeepSpeed's optimizer offload (the strategy's ``config``):
    NVMe, and a config that makes DeepSpeed refuse any client optimizer under offload."""
    zero = config.get("zero_optimization") or {}
    offload = zero.get("offload_optimizer") or {}
    device = offload.get("device", "none") if isinstance(offload, dict) else "none"
    if device == "nvme":
        raise RuntimeError(
            "BAOC cannot run with DeepSpeed's offload_optimizer device 'nvme': its swapped optimizer states are "
            "DeepSpeed's own buffers, not the client's formats. Offload to 'cpu' (BAOC's formats then hold the "
            "offloaded states in host memory), or use BAOC's 'offload' format without DeepSpeed's offload_optimizer.")
    if device == "cpu" and config.get("zero_force_ds_cpu_optimizer", True):
        raise RuntimeError(
            "BAOC under DeepSpeed's optimizer offload (offload_optimizer device 'cpu') needs "
            "\"zero_force_ds_cpu_optimizer\": false in the DeepSpeed config: DeepSpeed otherwise refuses every client "
            "optimizer but its own CPU Adam. Set it (BAOC's formats then hold the offloaded states in host memory), or "
            "drop offload_optimizer.")


def client_of(optimizer: Any, module: nn.Module, min_8bit_numel: int, seed: int) -> Any:
    """The ZeRO client DeepSpeed is built over in place of ``optimizer`` (a torch AdamW/Adam/SGD converted
    as the callback converts it: ``optim.swap.convert_optimizer``; a client is kept)."""
    if isinstance(optimizer, ZeroClient):
        return optimizer
    return zero_client(convert_optimizer(optimizer, module, min_8bit_numel, seed))


def _swap(out: Any, module: nn.Module, min_8bit_numel: int, seed: int) -> Any:
    """``configure_optimizers``' output with each optimizer replaced by its client, the schedulers rebound."""
    swapped: dict[int, Any] = {}

    def optimizer(o: Any) -> Any:
        if id(o) not in swapped:
            swapped[id(o)] = client_of(o, module, min_8bit_numel, seed)
        return swapped[id(o)]

    def walk(x: Any) -> Any:
        if isinstance(x, torch.optim.Optimizer):
            return optimizer(x)
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v) for v in x)
        return x

    result = walk(out)

    def rebind(x: Any) -> None:
        scheduler = x.get("scheduler") if isinstance(x, dict) else x
        bound = getattr(scheduler, "optimizer", None)
        if bound is not None and id(bound) in swapped:
            rebind_scheduler(scheduler, swapped[id(bound)])
        if isinstance(x, dict):
            for v in x.values():
                if isinstance(v, (dict, list, tuple)) or hasattr(v, "optimizer"):
                    rebind(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                rebind(v)

    rebind(result)
    return result


def wrap_configure_optimizers(module: nn.Module, min_8bit_numel: int, seed: int) -> Callable[[], None]:
    """Make ``module.configure_optimizers`` (on this instance) return the client of what it returns (a
    torch AdamW/Adam/SGD converted as the callback converts it: ``optim.swap.convert_optimizer``);
    returns the function that undoes it."""
    original = module.configure_optimizers

    def configure_optimizers() -> Any:
        return _swap(original(), module, min_8bit_numel, seed)

    module.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return lambda: vars(module).pop("configure_optimizers", None)


def zero_client_of(engine: Any) -> Any:
    """The ZeRO client of a DeepSpeed engine, bound to its partitions (on every rank)."""
    client = getattr(engine, "basic_optimizer", None)
    if not isinstance(client, ZeroClient):
        raise RuntimeError(
            f"DeepSpeed's engine holds a {type(client).__name__} as its optimizer, not BAOC's client: the DeepSpeed "
            f"config names an 'optimizer' of its own, or the optimizer was changed after setup. Drop the "
            f"config's 'optimizer' and hand DeepSpeed a torch.optim.AdamW (configure_optimizers, fabric.setup)")
    client.bind()
    return client


def fragment_module(model: nn.Module, client: Any) -> nn.Module:
    """A module of ``model``'s structure (its submodules' names, each a plain ``nn.Module``) whose parameters
    are ``client``'s fragments under the model's parameter names.

    Its submodules are none of torch's containers, so the partition's ``"layer"`` granularity (repeated
    layers: the children of a ``Sequential``, ``ModuleList`` or ``ModuleDict``) finds none in it: blocks
    are its modules'."""
    named = client.named_params
    root = nn.Module()
    made: dict[str, nn.Module] = {"": root}
    for name, _ in model.named_modules():
        if not name:
            continue
        parent, _, leaf = name.rpartition(".")
        holder = nn.Module()
        made[parent].add_module(leaf, holder)
        made[name] = holder
    for name, _ in model.named_parameters():
        if name in named:
            parent, _, leaf = name.rpartition(".")
            made[parent].register_parameter(leaf, named[name])
    return root


__all__ = ["check_offload", "client_of", "fragment_module", "wrap_configure_optimizers", "zero_client_of"]
