"""The blocks the controller manages: the model partitioned, matched to the optimizer's parameters.

:class:`Blocks` partitions the model (:func:`lightning_baoc.sampling.blocks.partition`) and keeps the
parameters the optimizer holds, matched by identity (whatever names the optimizer gives them), under
the optimizer's names. It also notices parameters that join the optimizer after install
(``add_param_group``, ``BackboneFinetuning``, a held parameter unfrozen) so the controller can take
them in.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_baoc.config.settings import BAOCConfig
from lightning_baoc.optim import BlockwiseOptimizer
from lightning_baoc.sampling.blocks import partition


def _stepped(optimizer: BlockwiseOptimizer, param: torch.Tensor) -> bool:
    """Whether ``param`` holds optimizer state (it has stepped, or state was loaded for it)."""
    try:
        return optimizer.step_count(param) > 0
    except KeyError:  # in a param group but never registered (param_groups assigned directly)
        return False


def _stateful(optimizer: BlockwiseOptimizer, param: torch.Tensor) -> bool:
    """Whether ``param`` can hold state (not in a group of SGD without momentum: no format there
    holds a byte, so the blocks and the budget leave it out)."""
    try:
        return optimizer.holds_state(param)
    except KeyError:  # never registered: as _stepped
        return True


class Blocks:
    """The partition of the model into blocks, in the optimizer's names of the parameters.

    A held parameter is in a block if it is trainable or holds state: one already in a block, or
    frozen with state loaded from a checkpoint, still takes memory the budget must count. A
    parameter that can hold no state (SGD without momentum in its group) is in no block.

    Args:
        config: the settings; :meth:`build` reads ``granularity`` and ``blocks`` (the glob patterns).

    Attributes:
        params: block -> the optimizer's names of its parameters (empty before :meth:`build`).
        model_names: the optimizer's name of a parameter -> the model's.

    Example:
        >>> from lightning_baoc import BlockwiseAdamW
        >>> model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        >>> opt = BlockwiseAdamW(model.parameters())
        >>> blocks = Blocks(BAOCConfig(memory_budget=0.5))
        >>> blocks.build(opt, model)
        >>> blocks.params, blocks.new_parameters(opt)
        ({'0': ['0', '1'], '1': ['2', '3']}, False)
    """

    def __init__(self, config: BAOCConfig) -> None:
        self.config = config
        self.params: dict[str, list[str]] = {}
        self.model_names: dict[str, str] = {}
        self._managed: set[int] = set()  # ids of the parameters in the blocks
        self._held_frozen: list[torch.Tensor] = []  # held by the optimizer, frozen, in no block
        self._group_sizes: tuple[int, ...] = ()

    @property
    def size(self) -> int:
        """The parameter tensors in the blocks."""
        return len(self._managed)

    def forget(self) -> None:
        """Drop the record of the parameters managed (a new optimizer is taken over)."""
        self._managed = set()

    def build(self, opt: BlockwiseOptimizer, module: nn.Module) -> None:
        """Partition ``module`` and keep the parameters ``opt`` holds, by identity, in its names.

        Raises:
            ValueError: ``opt`` holds parameters ``module`` does not have, parameters put into its
                ``param_groups`` without ``add_param_group``, or no trainable parameter.
        """
        model_named = dict(module.named_parameters())
        model_name = {id(p): n for n, p in model_named.items()}
        held = opt.named_params
        foreign = [n for n, p in held.items() if id(p) not in model_name]
        if foreign:
            raise ValueError(
                f"the optimizer holds {len(foreign)} parameter(s) that are not parameters of the model "
                f"(e.g. {foreign[:3]}); BAOC partitions the model's parameters into blocks: give the "
                f"optimizer the model's parameters only"
            )
        opt_name = {id(p): n for n, p in held.items()}
        unnamed = sum(1 for g in opt.param_groups for p in g["params"] if id(p) not in opt_name)
        if unnamed:
            raise ValueError(
                f"{unnamed} parameter(s) were put into optimizer.param_groups without add_param_group() "
                f"(param_groups assigned or appended to directly), so the optimizer holds no record of "
                f"them and cannot step them; add them with add_param_group() on the optimizer BAOC "
                f"installed ({type(opt).__name__} at {hex(id(opt))})"
            )
        keep = {model_name[id(p)] for p in held.values() if id(p) in self._managed or _stepped(opt, p)}
        trainable = [
            n for n, p in model_named.items()
            if id(p) in opt_name and (p.requires_grad or n in keep) and _stateful(opt, p)
        ]
        if not trainable:
            raise ValueError(
                f"the optimizer holds no trainable parameter of the model ({len(held)} held, all frozen "
                f"(requires_grad=False)): nothing to allocate; give the optimizer trainable parameters"
            )
        raw = partition(module, self.config.granularity, self.config.blocks, keep=keep)
        chosen = set(trainable)
        blocks = {b: [opt_name[id(model_named[n])] for n in names if n in chosen] for b, names in raw.items()}
        self.params = {b: names for b, names in blocks.items() if names}
        self.model_names = {opt_name[id(model_named[n])]: n for n in trainable}
        self._managed = {id(held[n]) for names in self.params.values() for n in names}
        self._held_frozen = [p for p in held.values() if id(p) not in self._managed]
        self._group_sizes = tuple(len(g["params"]) for g in opt.param_groups)

    def model_params(self) -> dict[str, list[str]]:
        """Block -> the model's names of its parameters (what the reports show)."""
        return {b: [self.model_names.get(n, n) for n in names] for b, names in self.params.items()}

    def names(self) -> list[str]:
        """The optimizer's names of every parameter in the blocks, block by block."""
        return [n for names in self.params.values() for n in names]

    def new_parameters(self, opt: BlockwiseOptimizer) -> bool:
        """Whether ``opt`` now trains or holds state for parameters outside the blocks
        (``add_param_group``; a held parameter unfrozen, or given state by a checkpoint loaded after
        install). Cheap when nothing changed: group sizes and the held frozen ones."""
        sizes = tuple(len(g["params"]) for g in opt.param_groups)
        if sizes == self._group_sizes and not any(self._joins(opt, p) for p in self._held_frozen):
            return False
        self._group_sizes = sizes
        # a group of frozen parameters added now is watched from now on, in case it is unfrozen
        self._held_frozen = [p for g in opt.param_groups for p in g["params"] if id(p) not in self._managed]
        return any(self._joins(opt, p) for p in self._held_frozen)

    @staticmethod
    def _joins(opt: BlockwiseOptimizer, param: torch.Tensor) -> bool:
        """Whether a parameter outside the blocks now belongs in one."""
        return _stateful(opt, param) and (param.requires_grad or _stepped(opt, param))


__all__ = ["Blocks"]
