"""The blocks the controller manages: the model partitioned and matched to the optimizer's
parameters by identity, their tables (shapes, the user's baseline, the
:class:`~lightning_baoc.costs.AllocationProblem`), the gradient sampler over them, the warm-up
formats, and parameters that join the optimizer after install.

A mixin of :class:`~lightning_baoc.control.controller.BAOCController`: the lifecycle owns the attributes.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any, Callable

import torch
from torch import nn

from lightning_baoc.config.budget import format_bytes
from lightning_baoc.control.protocol import Broadcast
from lightning_baoc.costs import AllocationProblem, baseline_state_bytes
from lightning_baoc.costs.calibration import withheld_formats
from lightning_baoc.costs.instruments import InstrumentSizes
from lightning_baoc.formats import RULE_NAMES, formats_of
from lightning_baoc.formats.correction import corrections_refused
from lightning_baoc.optim import BlockwiseOptimizer
from lightning_baoc.optim.sharding import shard_shape
from lightning_baoc.risk.momentum import shadow_betas
from lightning_baoc.risk.shadow import ShadowMoments
from lightning_baoc.sampling import GradientSampler
from lightning_baoc.sampling.blocks import partition

log = logging.getLogger("lightning_baoc.control.controller")


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


class BlocksMixin:
    """Blocks, tables, sampler and late parameters of the controller (see the module docstring)."""

    # provided by the controller this is mixed into
    config: Any
    phase: str
    pending: str | None
    block_params: dict[str, list[str]]
    sampler: GradientSampler | None
    shadow: ShadowMoments | None
    instruments: InstrumentSizes
    _betas_cache: tuple[Any, dict[str, tuple[float, float]]] | None
    optimizer: BlockwiseOptimizer | None
    ring_samples: int
    _module: nn.Module | None
    _managed: set[int]
    _held_frozen: list[torch.Tensor]
    _group_sizes: tuple[int, ...]
    _model_names: dict[str, str]
    _shapes: dict[str, list[tuple[int, ...]]]
    _dtypes: dict[str, list[torch.dtype]]
    _numel: dict[str, int]
    _baseline: int
    _device: torch.device
    _problem: AllocationProblem | None
    _withheld: dict[str, str]
    _offered: list[str]
    _memory: dict[str, dict[str, int]]
    baseline_state_bytes: int
    check_feasible: Callable[..., None]
    shadow: ShadowMoments | None
    _start_within_budget: Callable[[], None]

    def _build_blocks(self, opt: BlockwiseOptimizer, module: nn.Module) -> None:
        """Partition the model and keep the parameters ``opt`` holds, by identity, in its names.

        A held parameter is in a block if it is trainable or holds state: one already in a block,
        or frozen with state loaded from a checkpoint, still takes memory the budget must count.
        A parameter that can hold no state (SGD without momentum in its group) is in no block.
        """
        cfg = self.config
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
        raw = partition(module, cfg.granularity, cfg.blocks, keep=keep)
        chosen = set(trainable)
        blocks = {b: [opt_name[id(model_named[n])] for n in names if n in chosen] for b, names in raw.items()}
        self.block_params = {b: names for b, names in blocks.items() if names}
        self._model_names = {opt_name[id(model_named[n])]: n for n in trainable}
        self._managed = {id(held[n]) for names in self.block_params.values() for n in names}
        self._held_frozen = [p for p in held.values() if id(p) not in self._managed]
        self._group_sizes = tuple(len(g["params"]) for g in opt.param_groups)

    def _refresh_tables(self, opt: BlockwiseOptimizer) -> None:
        """Shapes, sizes, the user's baseline, the formats offered and the memory table of the blocks."""
        cfg = self.config
        named = opt.named_params
        registry = formats_of(opt.rule)
        # a sharded model (FSDP2) is budgeted per rank, on each tensor's largest shard (the most any rank
        # holds: met there, met on every rank), its formats decided on the whole tensor
        self._shapes = {b: [shard_shape(named[n]) for n in names] for b, names in self.block_params.items()}
        self._numel = {b: sum(math.prod(s) for s in shapes) for b, shapes in self._shapes.items()}
        foreign = [f for f in cfg.formats or () if f not in registry]
        if foreign:
            raise ValueError(
                f"BAOC(formats={list(cfg.formats)}): {foreign} are not formats of {RULE_NAMES[opt.rule]} "
                f"({type(opt).__name__}); its formats are {list(registry)}: name those"
            )
        wanted = list(cfg.formats) if cfg.formats is not None else list(registry)
        self._dtypes = dtypes = {b: [named[n].dtype for n in names] for b, names in self.block_params.items()}
        self._baseline = baseline_state_bytes(self._shapes, dtypes, opt.rule)  # torch's buffers, in each dtype
        refused = corrections_refused(dtypes.values()) if cfg.corrections is not None else None
        if refused:
            raise ValueError(
                f"BAOC(corrections={list(cfg.corrections)}): {refused}: train the weights in bf16 (precision='bf16-true'), "
                f"or leave corrections unset"
            )
        self._problem = AllocationProblem(
            self._shapes,
            self._device,
            wanted,
            timed=cfg.time_budget is not None,
            costs="prior" if cfg.calibration == "prior" else "calibrate",
            min_8bit_numel=opt.min_8bit_numel,
            baseline_bytes=self._baseline,
            cache_dir=cfg.calibration_cache_dir,
            rule=opt.rule,
            corrections=cfg.corrections,
            dtypes=dtypes,
        )
        self._withheld = dict(self._problem.withheld)
        self._offered = self._problem.allowed
        self._memory = self._problem.memory

    def _restart_sampler(self, module: nn.Module) -> None:
        """A new sampler over the blocks' trainable parameters (the model's names); empty ring."""
        cfg = self.config
        model_named = dict(module.named_parameters())
        sampled = {}
        for b, names in self.block_params.items():
            trainable = [self._model_names[n] for n in names if model_named[self._model_names[n]].requires_grad]
            if trainable:
                sampled[b] = trainable
        if self.sampler is not None:
            self.sampler.close()
        sizes = self.instruments = self._size_instruments()
        self.sampler = GradientSampler(module, sampled, cfg.sample_every, cfg.capacity, sizes.max_elements, seed=cfg.seed)
        self.ring_samples = 0

    def _size_instruments(self) -> InstrumentSizes:
        """The sampler's and the shadow's sizes within the instruments' allowance
        (:mod:`lightning_baoc.costs.instruments`)."""
        cfg = self.config
        return self.problem.instruments(cfg.capacity, cfg.max_elements, cfg.instrument_share)

    @property
    def instrument_bytes(self) -> int:
        """Bytes the sampler's buffers and the shadow moments hold now (outside the state budget)."""
        held = self.sampler.buffer_bytes() if self.sampler is not None else 0
        return held + (self.shadow.nbytes() if self.shadow is not None else 0)

    def _restart_shadow(self) -> None:
        """Shadow moments over the blocks' parameters (:mod:`lightning_baoc.risk.shadow`); tensors
        already shadowed keep theirs."""
        assert self.optimizer is not None
        named = self.optimizer.named_params
        old = self.shadow
        params = {n: named[n] for names in self.block_params.values() for n in names}
        self.shadow = ShadowMoments(params, self.instruments.shadow_elements, seed=self.config.seed)
        if old is not None:
            self.shadow.load_state_dict(old.state_dict())

    def _betas(self) -> dict[str, tuple[float, float]]:
        """Parameter name -> the betas of its shadow moments (as floats): its group's for AdamW;
        for SGD and Lion the buffer's own average and 0.999
        (:func:`~lightning_baoc.risk.momentum.shadow_betas`)."""
        assert self.optimizer is not None
        opt = self.optimizer
        groups = opt.param_groups
        key = tuple((str(g.get("betas", g.get("momentum"))), len(g["params"]), id(g)) for g in groups)
        cached = self._betas_cache
        if cached is not None and cached[0] == key:  # rebuilt only when a group or its betas change
            return cached[1]
        if opt.rule != "adamw":
            out = shadow_betas(opt)
        else:
            out = {}
            for group in groups:
                betas = (float(group["betas"][0]), float(group["betas"][1]))
                for p in group["params"]:
                    out[opt.param_name(p)] = betas
        self._betas_cache = (key, out)
        return out

    def _warmup_formats(self) -> None:
        """Warm-up state no larger than the user's AdamW: ``bf16`` for 2-byte parameters.

        torch's AdamW holds bf16/fp16 moments on such parameters (4 bytes per element); ``fp32``
        state (8) would double the user's optimizer memory. Only plain ``fp32`` requests change.
        """
        assert self.optimizer is not None
        named = self.optimizer.named_params
        small = [
            n
            for names in self.block_params.values()
            for n in names
            if named[n].element_size() < 4 and self.optimizer.requested_format(named[n]) == "fp32"
        ]
        if not small:
            return
        masked = withheld_formats(self._device, True, ["bf16"])
        if masked:  # emulated bf16 would be slow: fp32, said aloud
            warnings.warn(
                f"BAOC: {len(small)} low-precision parameter tensor(s) warm up with fp32 state (8 bytes per "
                f"element, twice torch AdamW's): bf16 state is withheld on {self._device} ({masked['bf16']})",
                UserWarning,
                stacklevel=3,
            )
            return
        self.optimizer.set_formats({n: "bf16" for n in small})

    def _new_parameters(self) -> bool:
        """Whether the optimizer now trains or holds state for parameters outside the blocks
        (``add_param_group``; a held parameter unfrozen, or given state by a checkpoint loaded after
        install). Cheap when nothing changed: group sizes and the held frozen ones."""
        opt = self.optimizer
        assert opt is not None
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

    def _grow(self, broadcast: Broadcast | None, is_global_zero: bool) -> None:
        """Take parameters added after install into the blocks, tables and sampler.

        After the first allocation a re-allocation of every block is made due at once (reason
        ``"params"``), within the budget resolved against all parameters now trained; the new
        parameters have no state yet and get the planner's prior risk until they do. During
        warm-up the budget is checked again (an absolute one may no longer fit). The sampler is
        rebuilt over the new blocks: statistics start afresh (a warm-up ends two samples later).
        """
        assert self.optimizer is not None and self._module is not None
        before = len(self._managed)
        self._build_blocks(self.optimizer, self._module)
        self._refresh_tables(self.optimizer)
        self._restart_sampler(self._module)
        self._restart_shadow()
        log.info(
            f"BAOC: {len(self._managed) - before} parameter tensor(s) joined the optimizer after install; "
            f"{len(self.block_params)} blocks now, {RULE_NAMES[self.optimizer.rule]} state "
            f"{format_bytes(self.baseline_state_bytes)}"
        )
        if self.phase == "allocated":
            self.pending = "params"
        else:
            self._warmup_formats()
            self._start_within_budget()  # the new blocks start within the budget too
            self.check_feasible(broadcast, is_global_zero)


__all__ = ["BlocksMixin"]
