"""BlockwiseAdamW: AdamW whose state format is chosen per parameter.

Every parameter's state is held in one of the formats of :data:`lightning_baoc.FORMATS`. The
format is stored per parameter (a param group's ``state_format`` key is only the default), so
param groups stay one-to-one with the user's: LR schedulers, ``LearningRateMonitor`` and code that
indexes ``param_groups`` keep working.

:class:`BlockwiseOptimizer` validates, names the parameters, resolves their formats and delegates to
its parts, each a class of its own over the one records table (parameter ->
:class:`~lightning_baoc.optim.pools.Record`):

- :class:`~lightning_baoc.optim.pools.StatePools`: one contiguous pool per format and device, with
  per-parameter views, the accounting, conversions;
- :class:`~lightning_baoc.optim.stepping.StepDispatcher`: the step, each parameter sent to the kernel of
  its format and device (compiled CPU, Triton and torch's fused kernel on a GPU, the eager reference);
- :class:`~lightning_baoc.optim.masters.MasterWeights`: the master-weight corrections of 16-bit weights;
- :class:`~lightning_baoc.optim.gradient_release.ReleaseHooks`: gradient release, each parameter stepped in backward;
- :class:`~lightning_baoc.optim.checkpoint.codec.CheckpointCodec`: state dicts, loads, copies and pickles;
- :class:`~lightning_baoc.optim.placement.Placements`: where its tensors lie in their parameters (whole, FSDP2's
  shards, DeepSpeed's fragments), the shape each format is decided on.

torch-compatible arguments: :mod:`lightning_baoc.optim.args`.

The state is kept outside ``optimizer.state`` on purpose: Lightning moves every tensor found there
to the root device after a restore, which would silently pull host-offloaded states onto the
accelerator (Lightning 2.6's ``Strategy.load_optimizer_state_dict`` calls ``_optimizer_to_device``).
"""

from __future__ import annotations

import os
import warnings
from typing import IO, Any, Callable, Iterable, Mapping

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from lightning_baoc import kernels as _kernels
from lightning_baoc.formats import (
    DEFAULT_MIN_8BIT_NUMEL,
    FORMATS,
    Canonical,
    StateFormat,
    StepHyper,
    check_format_name,
    resolve_in,
)
from lightning_baoc.formats.base import DEFAULT_CHUNK
from lightning_baoc.optim.amp import scaler_inputs, unscale_
from lightning_baoc.optim.args import PERFORMANCE_HINTS, check_torch_options
from lightning_baoc.optim.args import to_float as _float
from lightning_baoc.optim.args import validate_hyper as _validate_hyper
from lightning_baoc.optim.checkpoint.codec import CheckpointCodec
from lightning_baoc.optim.checkpoint.layout import CheckpointError, load_checkpoint
from lightning_baoc.optim.checkpoint.validate import LoadTarget, plan_load
from lightning_baoc.optim.convert import StateSlices
from lightning_baoc.optim.deepspeed import become_client
from lightning_baoc.optim.gradient_release import ReleaseHooks
from lightning_baoc.optim.masters import MasterWeights
from lightning_baoc.optim.offload_schedule import OffloadSchedule, OffloadScheduler, resolve_schedule
from lightning_baoc.optim.placement import Placements
from lightning_baoc.optim.pools import Record, StatePools
from lightning_baoc.optim.sharding import check_placements
from lightning_baoc.optim.stepping import StepDispatcher, StepSettings

#: Mixed into the rounding key of a conversion, so that it never reuses a step's noise.
_CONVERSION_SALT = 0x5A17C0DE
#: The attributes holding the optimizer's parts: built again in a copy, never copied.
_PARTS = ("_pools", "_stepper", "_masters", "_release", "_codec", "_offload")


class BlockwiseOptimizer(torch.optim.Optimizer):
    """The machinery of the blockwise optimizers: a state format per parameter, pools, conversions,
    checkpoints, master weights and gradient release (:class:`BlockwiseAdamW`,
    :class:`~lightning_baoc.optim.BlockwiseSGD`, :class:`~lightning_baoc.optim.BlockwiseLion`).

    A subclass sets :attr:`format_registry` and :attr:`rule`, builds its defaults, and says how a
    group's hyperparameters validate (:meth:`_validate_group`) and read (:meth:`_hyper`).
    """

    #: The formats this optimizer's parameters may be held in (name -> format).
    format_registry: Mapping[str, StateFormat] = FORMATS
    #: The update rule its formats run (``StepHyper.rule``).
    rule = "adamw"
    #: The name its messages use (the class installed in place of a user's optimizer, named like it, keeps it).
    label = "BlockwiseAdamW"
    #: The hyperparameters every param group of its state dicts carries.
    saved_group_keys: tuple[str, ...] = ("lr", "betas", "eps", "weight_decay", "state_format")

    def __init__(
        self,
        params: Iterable[Any],
        defaults: dict[str, Any],
        *,
        min_8bit_numel: int,
        skip_nonfinite: bool,
        seed: int,
        chunk_size: int,
        param_names: nn.Module | Iterable[tuple[str, Tensor]] | None,
        kernels: str | None,
        atomic_step: bool = False,
        placements: Placements | None = None,
    ) -> None:
        if not isinstance(min_8bit_numel, int) or min_8bit_numel < 0:
            raise ValueError(f"Invalid min_8bit_numel: {min_8bit_numel!r}; expected an int >= 0")
        if not isinstance(chunk_size, int) or chunk_size < 32:
            raise ValueError(f"Invalid chunk_size: {chunk_size!r}; expected an int >= 32")
        if not isinstance(seed, int):
            raise TypeError(f"Invalid seed: {seed!r}; expected an int")
        if not isinstance(atomic_step, bool):
            raise TypeError(f"Invalid atomic_step: {atomic_step!r}; expected True or False")
        if placements is not None and not isinstance(placements, Placements):
            raise TypeError(f"Invalid placements: {placements!r}; expected None or a lightning_baoc.optim.placement."
                            f"Placements")
        # where its tensors lie in their parameters (whole, FSDP2's shards, DeepSpeed's fragments): asked by the
        # records, the format decisions and the pools' conversion order
        self._placements = Placements() if placements is None else placements
        self._step_settings = StepSettings(seed, bool(skip_nonfinite), _kernels.resolve_policy(kernels), self.label,
                                           atomic_step)
        self.min_8bit_numel = min_8bit_numel
        self.chunk_size = chunk_size
        self._records: dict[Tensor, Record] = {}  # the table every part reads and writes
        self._names: dict[str, Tensor] = {}
        # decided once, not on every step: name -> (what the decision follows from, the format it resolves to)
        self._targets: dict[str, tuple[tuple, str]] = {}
        self._external_names: dict[int, str] = {}
        if param_names is not None:
            items = param_names.named_parameters() if isinstance(param_names, nn.Module) else param_names
            self._external_names = {id(p): n for n, p in items}
        if not isinstance(params, Tensor):  # (torch's error for a tensor) read once: generators are consumed
            params = [{**g, "params": _listed(g["params"])} if isinstance(g, Mapping) and "params" in g else g
                      for g in params]
        # names the given groups list more than once (two modules' named_parameters() both holding "0.weight",
        # which torch accepts): their parameters are named from ``param_names`` (the module) instead
        self._ambiguous = _repeated_names(params)
        self._build_parts()
        self._validate_group(defaults, "")
        super().__init__(params, defaults)
        # the list of the group dicts (add_param_group appends to it): DeepSpeed's ZeRO steps one group at a time
        # with a one-group list in its place, and the client this optimizer becomes under ZeRO needs them all
        self._own_groups = self.param_groups
        devices = {p.device for g in self.param_groups for p in g["params"]}
        if any(d.type == "cpu" for d in devices):
            _kernels.use_compiled(self.kernels)  # builds or loads them now, says which step runs
        for device in devices:  # a GPU's kernels: Triton imports now (or the error or warning comes now)
            _kernels.use_triton(self.kernels, device)

    def _build_parts(self) -> None:
        """Build the parts over the records table (at construction, and in a copy)."""
        self._stepper = StepDispatcher(self._records, self.format_registry, self._step_settings)
        self._pools = StatePools(self._records, self.format_registry, self._stepper.forget_plans, self._placements)
        self._masters = MasterWeights(self._records, self._stepper.forget_plans)
        self._release = ReleaseHooks(self._records)
        self._offload = OffloadScheduler(self._records, self._stepper, self.format_registry,
                                         getattr(self, "_offload_settings", None), self._step_settings.atomic,
                                         self._release)
        self._codec = CheckpointCodec(self._records, self._names, self._pools, self._stepper, self.format_registry,
                                      self.rule, self.label, self.min_8bit_numel)

    @property
    def seed(self) -> int:
        """The seed of the stochastic rounding."""
        return self._step_settings.seed

    @property
    def skip_nonfinite(self) -> bool:
        """Whether a parameter whose gradient holds inf or NaN skips its update."""
        return self._step_settings.skip_nonfinite

    @property
    def atomic_step(self) -> bool:
        """Whether a step that raises is undone whole (:mod:`lightning_baoc.optim.journal`)."""
        return self._step_settings.atomic

    @property
    def kernels(self) -> str:
        """The kernel policy: ``"auto"``, ``"compiled"`` or ``"eager"`` (:mod:`lightning_baoc.kernels`)."""
        return self._step_settings.kernels

    def _validate_group(self, group: Mapping[str, Any], where: str) -> None:
        """Validate a param group's hyperparameters (errors name ``where + key``)."""
        _validate_hyper(group, where)

    # ------------------------------------------------------------------ groups and names

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group (validated); its parameters get positional or given names.

        A parameter listed twice in the group (torch warns about it) is held once: two records of
        one tensor would update it twice per step.
        """
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        group = self.param_groups[index]
        first = {p: i for i, p in reversed(list(enumerate(group["params"])))}
        if len(first) != len(group["params"]):
            keep = sorted(first.values())
            group["params"] = [group["params"][i] for i in keep]
            if group.get("param_names"):
                group["param_names"] = [group["param_names"][i] for i in keep]
        try:
            self._validate_group(group, f"param_groups[{index}].")
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                if not p.is_floating_point() or p.is_complex():
                    raise TypeError(
                        f"{self.label} supports real floating-point parameters only; parameter "
                        f"{i} of group {index} has dtype {p.dtype}. Leave it out of the optimizer "
                        f"or give it a floating dtype."
                    )
                if p.is_sparse:
                    raise TypeError(f"sparse parameter {i} of group {index} is not supported")
                name = self._name_of(p, names[i] if names else None)
                if name in self._names:
                    raise ValueError(
                        f"Parameter name {name!r} appears twice; names key the checkpointed state and must be "
                        f"unique: give the optimizer unique names (prefix each module's named_parameters() with "
                        f"its name), or pass param_names=model to name the parameters from the model"
                    )
                check_placements(p, name)
                self._names[name] = p
                where = self._placements.of(p)
                self._records[p] = Record(name=name, group=index, shard_offset=where.shard_offset, frame=where.frame,
                                          row_shards=where.row_shards)
            self._release.extend(group["params"])  # release on: the new parameters are released too
        except (TypeError, ValueError):
            self.param_groups.pop()
            for p in group["params"]:
                rec = self._records.pop(p, None)
                if rec is not None:
                    self._names.pop(rec.name, None)
            raise

    def _name_of(self, p: Tensor, given: str | None) -> str:
        """The name ``p`` is held under: the one its group gives where it is unique, else its name in the
        module of ``param_names`` (matched by identity), else its position."""
        external = self._external_names.get(id(p))
        if given is not None and (external is None or (given not in self._ambiguous and given not in self._names)):
            return given
        return external if external is not None else str(len(self._records))

    def param_name(self, param: Tensor) -> str:
        """The name under which ``param``'s state is checkpointed."""
        return self._records[param].name

    @property
    def named_params(self) -> dict[str, Tensor]:
        """Parameter name -> parameter, in the optimizer's order (under ZeRO: this rank's fragments)."""
        if (zero := self._zero_client()) is not None:
            return zero.named_params
        return dict(self._names)

    def _param(self, name_or_param: str | Tensor) -> Tensor:
        return self._names[name_or_param] if isinstance(name_or_param, str) else name_or_param

    # ------------------------------------------------------------------ handed to DeepSpeed

    def _zero_client(self) -> Any:
        """The :class:`~lightning_baoc.optim.deepspeed.ZeroClient` this optimizer answers through since
        ``deepspeed.initialize(optimizer=self)`` partitioned it under ZeRO stage 1, 2 or 3, else ``None``.

        ZeRO rewrites its client's param groups to hold flat fp32 partitions (stages 1/2) or, at stage 3,
        nothing but the sub-group it steps: tensors this optimizer holds no record of. The first call that
        finds them makes the client :func:`~lightning_baoc.optim.deepspeed.zero_client` would have made
        (built locally, bound to the partitions at its first step or state dict, as that one is); the step,
        state dicts, accounting and conversions go to it from then on. Checked in O(groups), not per parameter,
        at every call: a ``None`` answer is not remembered, since ZeRO rewrites the groups' ``params`` in place
        (stages 1/2 at ``deepspeed.initialize``, stage 3 around each sub-group's step) without replacing
        ``param_groups``: only a look at the groups sees it.
        """
        client = self.__dict__.get("_deepspeed_client")
        if client is None and _holds_other_tensors(self.param_groups, self._records):
            client = self._deepspeed_client = become_client(self, self.__dict__.get("_own_groups", self.param_groups))
        return client

    # ------------------------------------------------------------------ formats

    def requested_format(self, param: Tensor) -> str:
        """The format asked for ``param``: its own request or its group's ``state_format``."""
        return self._requested(self._records[param])

    def _requested(self, rec: Record) -> str:
        """:meth:`requested_format` of ``rec``'s parameter (no tensor hashed: the step asks for every one)."""
        return rec.requested or self.param_groups[rec.group]["state_format"]

    def holds_state(self, param: Tensor) -> bool:
        """Whether ``param`` can hold optimizer state in some format (every parameter of AdamW and
        Lion; not one in a group of BlockwiseSGD without momentum)."""
        return True

    def target_format(self, param: Tensor) -> str:
        """The format ``param``'s state is (or will be) held in, after shape fallbacks: decided on the shape its
        placement gives (:meth:`Placements.decided_shape <lightning_baoc.optim.placement.Placements.decided_shape>`:
        its own; a ``DTensor``'s and a DeepSpeed fragment's, the whole parameter's)."""
        shape = self._placements.decided_shape(param)
        return resolve_in(self.format_registry, self.requested_format(param), shape, self.min_8bit_numel)

    def formats(self) -> dict[str, str]:
        """Parameter name -> effective format (held now, or on the first step for fresh ones)."""
        if (zero := self._zero_client()) is not None:
            return zero.formats()
        return {rec.name: rec.format or self.target_format(p) for p, rec in self._records.items()}

    def resolve_names(
        self, names: Iterable[str], blocks: Mapping[str, Iterable[str]] | None = None
    ) -> dict[str, list[Tensor]]:
        """Map parameter names, block names or module prefixes to parameters.

        A name is, in order: a block of ``blocks``; a parameter name; a module prefix (every
        parameter whose name starts with ``name + "."``).
        """
        out: dict[str, list[Tensor]] = {}
        for key in names:
            if not isinstance(key, str):
                raise TypeError(f"names must be str, got {key!r} of type {type(key).__name__}")
            if blocks is not None and key in blocks:
                params = []
                for member in blocks[key]:
                    if member not in self._names:
                        raise ValueError(
                            f"block {key!r} names parameter {member!r}, which this optimizer does not hold"
                        )
                    params.append(self._names[member])
            elif key in self._names:
                params = [self._names[key]]
            else:
                prefix = key + "."
                params = [p for n, p in self._names.items() if n.startswith(prefix)]
                if not params:
                    known = list(self._names)[:8]
                    raise ValueError(
                        f"{key!r} names no parameter, block or module of this optimizer; "
                        f"parameter names look like {known}"
                    )
            out[key] = params
        return out

    @torch.no_grad()
    def set_formats(
        self, formats: Mapping[str, str], blocks: Mapping[str, Iterable[str]] | None = None
    ) -> dict[str, tuple[str, str]]:
        """Convert the state of the named parameters or blocks to new formats, in place.

        State is inherited, never reset: quantize / dequantize, factor (row and column means of
        v) / expand (outer product), drop momentum / re-create it from the current gradient (as
        one EMA step, ``m = (1 - beta1) g``, with its own bias-correction count), move to / from
        host memory. Step counts are kept. Parameters convert one at a time, in slices, those whose
        device state shrinks first: at the peak the device holds the larger of the states before and
        after, plus the smaller of one parameter's old and new states, plus a few fp32 slices of
        scratch (see :mod:`lightning_baoc.optim.pools`).

        Args:
            formats: name -> format, where a name is a parameter name, a block of ``blocks`` or a
                module prefix (``"encoder.layer1"``).
            blocks: optional block name -> parameter names.

        Returns:
            parameter name -> (old format, new format) for every parameter whose format changed.

        Example:
            >>> opt.set_formats({"encoder": "int8", "head": "bf16"})  # doctest: +SKIP
        """
        if (zero := self._zero_client()) is not None:
            return zero.set_formats(formats, blocks)
        if not isinstance(formats, Mapping):
            raise TypeError(f"formats must be a mapping name -> format, got {type(formats).__name__}")
        resolved = self.resolve_names(formats.keys(), blocks)
        requests: dict[Tensor, str] = {}
        for key, fmt in formats.items():
            check_format_name(fmt, f"format of {key!r}", self.format_registry)
            for p in resolved[key]:
                requests[p] = fmt
        for p, fmt in requests.items():
            self._records[p].requested = fmt
        return self._sync_formats()

    def _sync_formats(self) -> dict[str, tuple[str, str]]:
        """Convert every initialized parameter whose target format differs from its held one."""
        changes: dict[Tensor, str] = {}
        targets = self._targets
        for p, rec in self._records.items():
            if rec.format is None:
                continue
            key = (self._requested(rec), self._placements.decided_shape(p), self.min_8bit_numel)
            known = targets.get(rec.name)
            if known is None or known[0] != key:  # resolved once per request, not on every step
                known = targets[rec.name] = (key, self.target_format(p))
            if known[1] != rec.format:
                changes[p] = known[1]
        if not changes:
            return {}
        report = {self._records[p].name: (self._records[p].format, fmt) for p, fmt in changes.items()}
        self._convert(changes)
        return report

    def _convert(self, changes: Mapping[Tensor, str]) -> None:
        """Move the parameters of ``changes`` to their formats (a fresh zero state where none is held)."""
        self._pools.rebuild(changes, self._hyper_for, self._mark_state)

    def _hyper_for(self, p: Tensor) -> StepHyper:
        """``p``'s group hyperparameters, keyed for the rounding of a conversion at its step count."""
        rec = self._records[p]
        return self._hyper(self.param_groups[rec.group], self._stepper.noise_key(rec, _CONVERSION_SALT))

    def _mark_state(self, p: Tensor) -> None:
        """Keep torch's ``optimizer.state`` saying which parameters hold state, and in which format.

        The states live in the pools, not in ``state``; but tools read ``state`` to learn whether an
        optimizer holds any: ``torch.distributed.checkpoint``'s state-dict functions take an empty one
        for a fresh optimizer and step it once with zero gradients to create its states, which here
        would advance the step counts and decay the moments of a trained one.
        """
        fmt = self._records[p].format
        if fmt is None:
            self.state.pop(p, None)
        else:
            self.state[p] = {"format": fmt}

    # ------------------------------------------------------------------ accounting

    def state_bytes(self, by_group: bool = False) -> int | list[int]:
        """Bytes of optimizer state held on the training devices.

        Equal to the storage really allocated (every pool counted once, codes, scales and factors
        included). Host-offloaded state of accelerator parameters is not device memory and is
        reported by :meth:`host_state_bytes`; when training runs on the CPU, ``offload`` states are
        on the training device and counted here in full.

        Args:
            by_group: return a list with the bytes of each param group instead of the total.
        """
        if (zero := self._zero_client()) is not None:
            return zero.state_bytes(by_group)
        return self._bytes(host=False, by_group=by_group)

    def host_state_bytes(self, by_group: bool = False) -> int | list[int]:
        """Bytes of state offloaded to host memory for parameters that train on an accelerator."""
        return self._bytes(host=True, by_group=by_group)

    def _bytes(self, host: bool, by_group: bool) -> int | list[int]:
        per_group = self._pools.held_bytes(host)
        counts = [per_group.get(i, 0) for i in range(len(self.param_groups))]
        return counts if by_group else sum(counts)

    def peak_state_bytes(self) -> int:
        """The most state bytes held on the training devices at any moment since construction or
        :meth:`reset_peak_state_bytes`, the transients of conversions and loads included.

        Counted where segments are allocated and released, so it is exact for the state itself;
        the fp32 scratch of a conversion (a few slices of ``chunk_size`` elements) is not state.
        """
        return self._pools.peak_bytes

    def reset_peak_state_bytes(self) -> None:
        """Start :meth:`peak_state_bytes` again from the state held now."""
        self._pools.reset_peak()

    def state_tensors(self) -> list[Tensor]:
        """Every tensor of optimizer state (views into the pools), for inspection and tests."""
        return self._pools.state_tensors()

    def pool_bytes(self) -> dict[tuple[str, str], int]:
        """(format, parameter device) -> bytes of that pool's storage (its segments, one per parameter)."""
        return self._pools.pool_bytes()

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def _initialize_new(self) -> None:
        fresh = {
            p: self.target_format(p)
            for p, rec in self._records.items()
            if rec.format is None and p.grad is not None
        }
        if fresh:
            self._convert(fresh)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Reset the gradients, as torch's ``zero_grad``; under ZeRO nothing (DeepSpeed owns its partitions'
        gradients, as :meth:`ZeroClient.zero_grad <lightning_baoc.optim.deepspeed.ZeroClient.zero_grad>` says)."""
        if (zero := self._zero_client()) is not None:
            zero.zero_grad(set_to_none)
            return
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D401 - torch's signature
        """Perform one optimization step (``closure`` re-evaluates the model, as in torch)."""
        if (zero := self._zero_client()) is not None:  # DeepSpeed's ZeRO steps its partitions through the client
            return zero.step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepper = self._stepper
        grad_scale, found_inf = scaler_inputs(self)  # AMP's scaler's, where amp_scaling is on (optim/amp.py)
        if stepper.graphs.current is not None:  # the captured step (optim/graph_step.py), where it holds
            if stepper.unread:
                stepper.apply_device_skips()
            scheduled = bool(self._offload.layouts or self._offload.handles)  # offload's subgroups step apart
            if stepper.graphs.replay(self.param_groups, self._hyper, stepper.generation, stepper.count_store.array,
                                     not (self._release.enabled or self.atomic_step or scheduled), found_inf, grad_scale):
                return loss
        if grad_scale is not None:
            unscale_([p.grad for group in self.param_groups for p in group["params"] if p.grad is not None],
                     grad_scale)
        batches = []  # per group: its index, the group, its parameters with gradients
        for index, group in enumerate(self.param_groups):
            with_grad = [p for p in group["params"] if p.grad is not None]
            for p in with_grad:
                if p.grad.is_sparse:
                    raise TypeError(
                        f"{self.label} does not support sparse gradients (parameter {self._records[p].name!r}); "
                        f"use torch.optim.SparseAdam for sparse embeddings"
                    )
            if with_grad:
                batches.append((index, group, with_grad))
        self._sync_formats()
        self._initialize_new()
        self._masters.sync(self.param_groups)
        waited = self._release.new_window()  # a new window: each parameter may release its gradient once again
        if self._offload.layouts or self._offload.handles or self._pools.holds_offloaded():
            # offloaded states by subgroups (offload_schedule.py); no walk over the parameters (nor a read of AMP's
            # found_inf) where no state is offloaded
            batches = self._offload.step(batches, self._hyper, found_inf)
        self._stepper.step(batches, self._hyper, None if self._release.enabled else self.param_groups, found_inf,
                           grad_scale is not None)
        for p in waited:  # gradients that waited for step() under release (reentrant checkpointing) go as released ones
            p.grad = None
        return loss

    @property
    def nonfinite_counts(self) -> dict[str, int]:
        """Parameter name -> number of steps skipped because its gradient was not finite."""
        return {rec.name: rec.nonfinite for rec in self._records.values() if rec.nonfinite}

    def param_state(self, name_or_param: str | Tensor) -> Canonical | None:
        """A parameter's state decoded to fp32 (``None`` before its first step).

        Of a sharded parameter (FSDP2): this rank's shard. A factored second moment of a shard
        expands over the whole parameter's row mean, summed over the shards: ``dense_v()`` is then a
        collective (call it on every rank)."""
        if (zero := self._zero_client()) is not None:
            return zero.param_state(name_or_param)
        return self._pools.decode(self._param(name_or_param))

    def state_slices(self, name_or_param: str | Tensor, shards: Any = None) -> StateSlices | None:
        """A parameter's state read in fp32 slices of ``chunk_size`` elements, never decoded whole
        (``None`` before its first step): its elements at given indices, the row and column means of
        its second moment (:class:`~lightning_baoc.optim.convert.StateSlices`). ``shards``: a shard's
        rows (``sharding.row_shards``), a factored state read over the whole parameter's (collectives);
        ``None``: this rank's rows alone."""
        return self._pools.slices(self._param(name_or_param), self.chunk_size, shards)

    def step_count(self, name_or_param: str | Tensor) -> int:
        """Number of steps taken by a parameter."""
        return self._records[self._param(name_or_param)].step

    def momentum_step_count(self, name_or_param: str | Tensor) -> int:
        """Steps since a parameter's momentum was (re)created: its own bias-correction count
        (equal to :meth:`step_count` unless a format without momentum was held in between)."""
        return self._records[self._param(name_or_param)].m_step

    def param_group_of(self, name_or_param: str | Tensor) -> dict[str, Any]:
        """The param group holding a parameter (its hyperparameters)."""
        return self.param_groups[self._records[self._param(name_or_param)].group]

    def _hyper(self, group: Mapping[str, Any], noise_key: int = 0) -> StepHyper:
        """The group's hyperparameters as a :class:`StepHyper` (plain floats)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ master weights

    def set_weight_corrections(
        self, corrections: Mapping[str, str], blocks: Mapping[str, Iterable[str]] | None = None
    ) -> dict[str, tuple[str, str]]:
        """Choose the master-weight correction of parameters (or blocks): ``{name: "ecc8"}``.

        Keys are parameter names, or block names of ``blocks`` (block -> parameter names), as in
        ``set_formats``. A parameter held in fp32 is its own master: asking it for a correction is
        an error naming it. Corrections already held convert at once (:mod:`lightning_baoc.optim.masters`).

        Returns:
            ``{parameter name: (old, new)}`` for every correction that changed.

        Raises:
            ValueError: an unknown correction, or one asked for an fp32 parameter.
        """
        if not isinstance(corrections, Mapping):
            raise TypeError(f"corrections must be a mapping name -> correction, got {type(corrections).__name__}")
        return self._masters.request(corrections, self.resolve_names(corrections.keys(), blocks), self.param_groups)

    def target_correction(self, p: Tensor) -> str:
        """The correction ``p`` holds from its next step: its request, else its group's default."""
        return self._masters.target(p, self.param_groups)

    def held_correction(self, name: str) -> Tensor | None:
        """The correction tensor parameter ``name`` holds now (``None``: none; a view, do not modify)."""
        return self._records[self._names[name]].master_correction

    @property
    def weight_corrections(self) -> dict[str, str]:
        """Parameter name -> correction held, for the parameters holding one."""
        return self._masters.held()

    def weight_correction_bytes(self, device: torch.device | str | None = None) -> int:
        """Bytes of storage the corrections hold (on ``device``, or everywhere): apart from the states'."""
        return self._masters.nbytes(device)

    def master_weights(self) -> dict[str, Tensor]:
        """Parameter name -> its fp32 master weight (a new tensor): the weight plus its correction,
        the weight itself where there is none. The export of a bf16 model trained with corrections."""
        return self._masters.master_weights()

    # ------------------------------------------------------------------ gradient release

    def add_gradient_observer(self, observer: Callable[[Tensor], None]) -> RemovableHandle:
        """Call ``observer(param)`` in the release hook, with ``param.grad`` complete, before the
        parameter steps and its gradient is freed; returns a handle whose ``remove()`` ends it.

        Observers run in the order added, only while release is on, and are not copied with the
        optimizer (like torch's hooks)."""
        return self._release.add_observer(observer)

    def release_gradients(self, enabled: bool = True) -> None:
        """Step each parameter in a post-accumulate-grad hook and free its gradient (``enabled``),
        or stop doing so (``False``). See :mod:`lightning_baoc.optim.gradient_release` for the contract."""
        if enabled:
            self._release.enable([p for g in self.param_groups for p in g["params"]], self._step_released)
        else:
            self._release.disable()

    @property
    def releases_gradients(self) -> bool:
        """Whether gradient release is on (:meth:`release_gradients`)."""
        return self._release.enabled

    def offload_working_bytes(self) -> int:
        """Device memory the ``offload`` states' update works in, at most (the schedule's staging buffers, bounded by
        ``OffloadSchedule.staging_bytes``; :meth:`OffloadScheduler.working_bytes
        <lightning_baoc.optim.offload_schedule.OffloadScheduler.working_bytes>`): BAOC's report counts it as
        working memory."""
        return self._offload.working_bytes(lambda p, rec: rec.format or self.target_format(p))

    @property
    def amp_scaling(self) -> bool:
        """Whether ``torch.amp.GradScaler`` hands this optimizer its scale and ``found_inf`` and calls ``step()``
        at every step, the step unscaling and skipping on the device (:mod:`lightning_baoc.optim.amp`; no host
        synchronisation), instead of unscaling itself and reading ``found_inf`` on the host. Off by default:
        Lightning refuses gradient clipping with it on, and BAOC (which samples the gradients before the step,
        unscaled only with it off) leaves it off."""
        return bool(self.__dict__.get("_step_supports_amp_scaling", False))

    @amp_scaling.setter
    def amp_scaling(self, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"amp_scaling must be True or False, got {enabled!r}")
        self._step_supports_amp_scaling = enabled

    @property
    def cuda_graphs(self) -> bool:
        """Whether a CUDA step whose parameters all take the device's plans is captured in a CUDA graph and
        replayed (:mod:`lightning_baoc.optim.graph_step`; on by default, off once a capture failed). Set it
        ``False`` to run the planned step at every step."""
        return self._stepper.graphs.on

    @cuda_graphs.setter
    def cuda_graphs(self, enabled: bool) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"cuda_graphs must be True or False, got {enabled!r}")
        graphs = self._stepper.graphs
        graphs.drop()
        graphs.policy = "auto" if enabled else "off"

    @torch.no_grad()
    def _step_released(self, p: Tensor) -> None:
        """Step ``p`` alone, its gradient complete (the release hook): its format and correction first
        brought to their targets, as ``step()`` does for every parameter."""
        if self._zero_client() is not None:  # (where DeepSpeed took it with release on, the call itself refuses it)
            raise ValueError(f"{self.label} releases its gradients under DeepSpeed's ZeRO, which steps its partitions "
                             f"after reducing the gradients: call release_gradients(False)")
        rec = self._records[p]
        target = self.target_format(p)
        if target != rec.format:
            self._convert({p: target})
        self._masters.sync(self.param_groups, [p])
        self._stepper.step([(rec.group, self.param_groups[rec.group], [p])], self._hyper)

    # ------------------------------------------------------------------ checkpoints and copies

    def state_dict(self) -> dict[str, Any]:
        """Compact state keyed by parameter name; loads under ``torch.load(weights_only=True)``.

        Layout and checksums: :mod:`lightning_baoc.optim.checkpoint.layout`. 8-bit states stay 8-bit. Tensors
        are copies (views of one pool in several dtypes cannot be serialized together). Handed to
        a plain ``torch.optim.AdamW``, the dict fails at load with a message that names BAOC and
        the fix (resume with the callback, or :func:`~lightning_baoc.export_adamw_state_dict`).
        Over sharded parameters (FSDP2's ``DTensor``) the dict is in the distributed layout
        (:mod:`lightning_baoc.optim.checkpoint.distributed`), which ``torch.distributed.checkpoint`` saves and
        loads whole: each rank's compact tensors as its row of a ``DTensor``.
        Hooks registered with torch's ``register_state_dict_pre_hook``/``post_hook`` run as in torch.
        """
        if (zero := self._zero_client()) is not None:
            return zero.state_dict()
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state_dict = self._codec.state_dict(self.param_groups)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        return state_dict

    def _local_state_dict(self) -> dict[str, Any]:
        """The state dict of this rank in the single-process layout (:mod:`lightning_baoc.optim.checkpoint.layout`)."""
        return self._codec.local_state_dict(self.param_groups)

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a state dict of this class (versions 1 and 2), or of ``torch.optim.AdamW``/``Adam``.

        The whole dict is validated first (groups, hyperparameters, every entry's format, counts,
        shape, tensors and checksum); only then is anything changed, so a refused
        dict leaves the optimizer exactly as it was. A BlockwiseAdamW state is matched by parameter
        name (order may differ); a torch state by position, its fp32 moments encoded into each
        parameter's target format. torch's own ``Optimizer.load_state_dict`` would cast every state
        tensor to the parameter's dtype (int8 codes would become floats): this is a full override.

        The stochastic rounding needs no saved state (it is keyed by seed, name and step count):
        the generator states that dicts of earlier releases carry are ignored (their checksum still
        covers them). Hooks registered with torch's
        ``register_load_state_dict_pre_hook``/``post_hook`` run as in torch.

        Raises:
            CheckpointError: the dict is damaged, invalid or of another model; the message names
                the parameter and the key.
        """
        if (zero := self._zero_client()) is not None:
            zero.load_state_dict(state_dict)
            return
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            state_dict = state_dict if result is None else result
        target = LoadTarget(self.param_groups, self._names, self._records, self.format_registry, self.rule, self.label,
                            self.saved_group_keys, self._validate_group)
        self._codec.load(state_dict, self.param_groups, lambda sd: plan_load(target, sd), self._hyper)
        for p in self._records:
            self._mark_state(p)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def load_checkpoint(self, path_or_file: str | os.PathLike[str] | IO[bytes]) -> None:
        """Load an optimizer state dict saved with ``torch.save`` (damaged files: CheckpointError).

        The file holds this optimizer's ``state_dict()``, or is a Lightning checkpoint with exactly
        one optimizer state (``"optimizer_states"``).

        Example:
            >>> opt.load_checkpoint("optimizer.pt")  # doctest: +SKIP
        """
        loaded = load_checkpoint(path_or_file)
        if isinstance(loaded, Mapping) and "optimizer_states" in loaded and "state" not in loaded:
            states = loaded["optimizer_states"]
            if not isinstance(states, (list, tuple)) or len(states) != 1:
                count = len(states) if isinstance(states, (list, tuple)) else type(states).__name__
                raise CheckpointError(
                    f"the checkpoint holds {count} optimizer states; load the one of this optimizer "
                    f"with load_state_dict(load_checkpoint(path)['optimizer_states'][i])"
                )
            loaded = states[0]
        self.load_state_dict(loaded)

    def to_adamw_state_dict(self) -> dict[str, Any]:
        """Export as a plain ``torch.optim.AdamW`` state dict (fp32, dequantized).

        Factored second moments are expanded; formats without momentum export a zero momentum with
        their own step count (documented loss: a plain AdamW resumes with a cold momentum there).
        Same as :func:`~lightning_baoc.export_adamw_state_dict` of :meth:`state_dict`. Over sharded
        parameters (FSDP2) it holds the whole moments, gathered from every rank: call it on every rank;
        it loads into a run of any world size, one process included (each rank takes its rows). Under ZeRO
        (handed to ``deepspeed.initialize``) the same, from DeepSpeed's partitions.
        """
        if (zero := self._zero_client()) is not None:
            return zero.to_adamw_state_dict()
        return self._codec.to_adamw_state_dict(self.param_groups)

    def to_torch_state_dict(self) -> dict[str, Any]:
        """Export as the plain optimizer's state dict (fp32, dequantized): ``torch.optim.AdamW``'s
        (:meth:`to_adamw_state_dict`), ``torch.optim.SGD``'s (``momentum_buffer``) or a Lion's
        (``exp_avg``, the key of lion-pytorch, timm and optimi). A parameter held without a momentum
        buffer (SGD's or Lion's format ``none``) exports no state: the plain optimizer starts it afresh.
        Over sharded parameters it gathers the whole buffers (call it on every rank).

        Example:
            >>> from lightning_baoc import BlockwiseSGD
            >>> model = nn.Linear(4, 4)
            >>> opt = BlockwiseSGD(model.named_parameters(), lr=0.1, momentum=0.9)
            >>> model(torch.randn(2, 4)).sum().backward(); opt.step()
            >>> plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            >>> plain.load_state_dict(opt.to_torch_state_dict())
            >>> sorted(plain.state[model.weight])
            ['momentum_buffer']
        """
        if self.rule == "adamw":
            return self.to_adamw_state_dict()
        return self._codec.to_momentum_state_dict(self.param_groups)

    def __getstate__(self) -> dict[str, Any]:
        """State for ``copy.deepcopy`` and ``pickle``: compact copies of the states, no pool views, no parts
        (:meth:`CheckpointCodec.copy_state <lightning_baoc.optim.checkpoint.codec.CheckpointCodec.copy_state>`)."""
        state = self._codec.copy_state({k: v for k, v in self.__dict__.items() if k not in _PARTS})
        state["_release_on"] = self._release.enabled  # the copy registers its own hooks
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild the parts and the pools from :meth:`__getstate__`'s compact copies."""
        copied = CheckpointCodec.take_copied(state)
        release_on = state.pop("_release_on")
        super().__setstate__(state)  # torch's: hooks, the profiled step
        self._build_parts()
        self._codec.restore(copied)
        if release_on:
            self.release_gradients()

    def _inherit_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Load a torch optimizer's state, matched by position (``from_optimizer``)."""
        if any(optimizer.state.values()):
            sd = optimizer.state_dict()
            self.load_state_dict({"state": sd["state"], "param_groups": [{"params": g["params"]} for g in sd["param_groups"]]})


class BlockwiseAdamW(BlockwiseOptimizer):
    """AdamW (decoupled weight decay, bias correction) with a state format per parameter.

    With every parameter in ``fp32`` it behaves like ``torch.optim.AdamW`` (tested to 1e-6 over 200
    steps; bit for bit like ``AdamW(fused=True)``, whose kernel it runs). Cheaper formats hold the same state in fewer bytes; :meth:`set_formats` converts live
    state between any two formats (state inheritance) and keeps the step count.

    Args:
        params: parameters, ``(name, parameter)`` pairs (``model.named_parameters()``) or param
            groups; a group may carry ``state_format`` (the default of its parameters).
        lr: learning rate (default: 1e-3).
        betas: coefficients of the moment averages (default: (0.9, 0.999)).
        eps: added to the denominator (default: 1e-8).
        weight_decay: decoupled weight decay (default: 1e-2).
        amsgrad: torch's AMSGrad variant; not implemented: only ``False`` is accepted (default: False).
        maximize: maximize the objective (default: False).
        foreach: a hint choosing torch's kernels, accepted for drop-in compatibility with
            ``torch.optim.AdamW``; BlockwiseAdamW runs its own per-format kernels, so it changes
            nothing (default: None).
        capturable: CUDA-graph capture of the step; not implemented: only ``False`` (default: False).
        differentiable: autograd through the step; not implemented: only ``False`` (default: False).
        fused: a hint like ``foreach``, accepted and not needed (default: None).
        state_format: default format of every group (default: ``"fp32"``).
        weight_correction: default master-weight correction of the bf16 and fp16 parameters of every
            group: ``"none"``, ``"ecc8"`` or ``"ecc16"`` (:mod:`lightning_baoc.optim.masters`; fp32
            parameters are their own masters). Per parameter: :meth:`set_weight_corrections`
            (default: ``"none"``).
        decoupled_weight_decay: AdamW's decoupled decay; ``False`` gives Adam's L2 penalty
            (default: True).
        min_8bit_numel: tensors with fewer elements stay out of the 8-bit formats (int8 -> fp32,
            nomomentum_int8 -> nomomentum), as bitsandbytes does (default: 4096).
        skip_nonfinite: skip the update of a parameter whose gradient holds inf or NaN, leaving its
            state and value untouched and counting it in :attr:`nonfinite_counts`, instead of letting
            one bad value poison a whole quantization group forever (default: True).
        seed: seed of the stochastic rounding (bf16 states). The rounding of a parameter at a step
            is a function of the seed, the parameter's name and its step count
            (:func:`~lightning_baoc.formats.quant.stream_key`), so a resumed run rounds exactly as an
            uninterrupted one (default: 0).
        chunk_size: elements processed at once by chunked formats (default: 131072).
        param_names: names for plain parameters: a module, or ``(name, parameter)`` pairs
            (default: positional names ``"0"``, ``"1"``, ...), matched by identity; they also name the
            parameters whose given names repeat (two modules' ``named_parameters()`` both holding
            ``"0.weight"``, which torch accepts). Given names used once are kept.
        kernels: which step runs: ``"auto"`` (the compiled kernels, on the CPU where they build and
            on CUDA where Triton imports, else the eager step with one warning), ``"compiled"`` (the
            kernels or an error), ``"eager"`` (the reference, nothing built); default: the environment
            variable ``LIGHTNING_BAOC_KERNELS``, else ``"auto"`` (:mod:`lightning_baoc.kernels`). The
            CPU kernels are built on the first construction that needs them and cached; the CUDA ones
            (:mod:`lightning_baoc.kernels.triton_step`) compile at their first launch.
        atomic_step: undo a step that raises part-way, so that it changes nothing (default: False). It
            keeps a host copy of the stepped parameters and states during each step: a transient of
            their bytes, never on the accelerator (:mod:`lightning_baoc.optim.journal`).
        offload_schedule: how ``offload`` states are updated, by subgroups of about 64 MiB: ``"interleaved"``
            (each subgroup on the host or the device, as the performance model finds fastest, transfers on
            their own CUDA streams), ``"host"`` (all on the CPU: static offload) or ``"device"``; or an
            :class:`~lightning_baoc.optim.offload_schedule.OffloadSchedule` for the subgroup size, overlap
            with backward and the rates. Default: ``"interleaved"`` for CUDA parameters, and on the CPU the
            plain step (a given schedule runs there with the CPU standing in for the device; the states
            are counted as device memory either way) (:mod:`lightning_baoc.optim.offload_schedule`).
        placements: where the parameters lie in their whole parameters, for a caller that made them as views
            (:class:`~lightning_baoc.optim.placement.FragmentPlacements`: DeepSpeed's client passes its fragments';
            :mod:`lightning_baoc.optim.deepspeed`). Default: each parameter read off itself, whole or FSDP2's
            ``DTensor`` shard (:class:`~lightning_baoc.optim.placement.Placements`).

    Raises:
        ValueError: an invalid hyperparameter, or ``amsgrad``/``capturable``/``differentiable``
            set; the inputs ``torch.optim.AdamW`` rejects raise torch's error type (see
            :mod:`lightning_baoc.optim.args`).

    Copies: ``copy.deepcopy`` gives an independent optimizer (parameters mapped through the memo,
    as for torch's optimizers) and pickles load in a fresh process; hooks and an LR scheduler's
    wrapper of ``step`` are not copied, as with torch.

    Example:
        >>> model = nn.Linear(64, 64)
        >>> opt = BlockwiseAdamW(model.named_parameters(), lr=1e-3)
        >>> model(torch.randn(8, 64)).sum().backward(); opt.step()
        >>> opt.set_formats({"weight": "int8"})  # the formats each name moved from and to
        {'weight': ('fp32', 'int8')}
        >>> opt.state_bytes()  # int8 weight (4096 codes each moment, their scales, exponents) + fp32 bias (512)
        9224
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | Tensor = 1e-3,
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        state_format: str = "fp32",
        weight_correction: str = "none",
        decoupled_weight_decay: bool = True,
        min_8bit_numel: int = DEFAULT_MIN_8BIT_NUMEL,
        skip_nonfinite: bool = True,
        seed: int = 0,
        chunk_size: int = DEFAULT_CHUNK,
        param_names: nn.Module | Iterable[tuple[str, Tensor]] | None = None,
        kernels: str | None = None,
        atomic_step: bool = False,
        offload_schedule: str | OffloadSchedule | None = None,
        placements: Placements | None = None,
    ) -> None:
        check_torch_options(lr, betas, foreach, fused, capturable, differentiable)
        self._offload_settings = resolve_schedule(offload_schedule)
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            state_format=state_format,
            weight_correction=weight_correction,
            maximize=maximize,
            decoupled_weight_decay=decoupled_weight_decay,
            amsgrad=amsgrad,
            capturable=capturable,
            differentiable=differentiable,
        )
        super().__init__(
            params,
            defaults,  # refuses amsgrad, capturable, differentiable set to True
            min_8bit_numel=min_8bit_numel,
            skip_nonfinite=skip_nonfinite,
            seed=seed,
            chunk_size=chunk_size,
            param_names=param_names,
            kernels=kernels,
            atomic_step=atomic_step,
            placements=placements,
        )

    def _hyper(self, group: Mapping[str, Any], noise_key: int = 0) -> StepHyper:
        beta1, beta2 = group["betas"]
        return StepHyper(
            lr=_float(group["lr"]),
            beta1=_float(beta1),
            beta2=_float(beta2),
            eps=float(group["eps"]),
            weight_decay=float(group["weight_decay"]),
            decoupled_weight_decay=bool(group.get("decoupled_weight_decay", True)),
            maximize=bool(group.get("maximize", False)),
            chunk=self.chunk_size,
            noise_key=noise_key,
            kernels=self.kernels,
        )

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_optimizer(
        cls,
        optimizer: torch.optim.Optimizer,
        named_parameters: nn.Module | Iterable[tuple[str, Tensor]] | None = None,
        state_format: str | None = None,
        **kwargs: Any,
    ) -> "BlockwiseAdamW":
        """A BlockwiseAdamW over the same param groups and hyperparameters, state inherited.

        Args:
            optimizer: a ``torch.optim.AdamW`` or ``torch.optim.Adam`` (without amsgrad).
            named_parameters: a module or ``(name, parameter)`` pairs naming the parameters
                (default: the groups' ``param_names`` if present, else positional names).
            state_format: default format of every group (default: each group's ``state_format``,
                else ``"fp32"``).
            **kwargs: further constructor arguments (``min_8bit_numel``, ``seed``, ...).

        Example:
            >>> adamw = torch.optim.AdamW(model.parameters(), lr=3e-4)  # doctest: +SKIP
            >>> opt = BlockwiseAdamW.from_optimizer(adamw, model)  # doctest: +SKIP
        """
        if isinstance(optimizer, BlockwiseAdamW):
            return optimizer
        if not isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)):
            raise TypeError(
                f"from_optimizer supports torch.optim.AdamW and torch.optim.Adam, got "
                f"{type(optimizer).__name__}; build BlockwiseAdamW directly for other cases"
            )
        decoupled = isinstance(optimizer, torch.optim.AdamW)
        name = type(optimizer).__name__
        hints: dict[str, None] = {}  # ordered set: each hint named once, however many groups carry it
        groups = []
        for i, group in enumerate(optimizer.param_groups):
            for key in ("amsgrad", "capturable", "differentiable"):
                if group.get(key):
                    raise ValueError(
                        f"Invalid {name}({key}=True) (param group {i}): BlockwiseAdamW does not implement "
                        f"{key}; build the {name} with {key}=False"
                    )
            hints.update({f"{key}={group[key]!r}": None for key in PERFORMANCE_HINTS if group.get(key) is not None})
            new = {k: v for k, v in group.items() if k not in PERFORMANCE_HINTS + ("capturable", "differentiable")}
            new["decoupled_weight_decay"] = decoupled or bool(group.get("decoupled_weight_decay", False))
            if state_format is not None:
                new["state_format"] = state_format
            new["params"] = list(group["params"])
            groups.append(new)
        if hints:
            warnings.warn(
                f"{name}({', '.join(hints)}): performance hints choosing torch's own AdamW kernels. "
                f"BlockwiseAdamW runs its own per-format kernels, so they are not needed and not used "
                f"(the update is the same).",
                UserWarning,
                stacklevel=2,
            )
        new_opt = cls(groups, param_names=named_parameters, **kwargs)
        new_opt.defaults.update({k: v for k, v in optimizer.defaults.items() if k in ("lr", "betas", "eps", "weight_decay")})
        new_opt._inherit_state(optimizer)
        return new_opt


def _listed(params: Any) -> Any:
    """A param group's ``params`` as a list (a tensor kept as is: torch refuses it with its message)."""
    return params if isinstance(params, (Tensor, list)) else list(params)


def _repeated_names(params: Any) -> set[str]:
    """The parameter names that ``params`` (an optimizer's argument: tensors, ``(name, tensor)`` pairs or
    param groups, which may carry ``param_names``) gives more than once."""
    seen: set[str] = set()
    repeated: set[str] = set()
    if isinstance(params, Tensor):
        return repeated
    for item in params:
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            names: Iterable[Any] = [item[0]]
        elif isinstance(item, Mapping):
            listed = item.get("param_names")
            if listed is None:
                listed = [x[0] for x in item.get("params", ()) if isinstance(x, tuple) and len(x) == 2]
            names = listed
        else:
            continue
        for name in names:
            if isinstance(name, str):
                (repeated if name in seen else seen).add(name)
    return repeated


def _holds_other_tensors(groups: list[dict[str, Any]], records: Mapping[Tensor, Record]) -> bool:
    """Whether the param ``groups`` hold other tensors than the parameters of ``records``: what DeepSpeed's ZeRO
    leaves in its client's groups (stages 1/2: one flat partition per group; stage 3: none, or the stepped
    sub-group's). Each group's first tensor and the count, not every parameter: the step asks at every call."""
    held = 0
    for group in groups:
        params = group["params"]
        if params and params[0] not in records:
            return True
        held += len(params)
    return held != len(records)


# ---------------------------------------------------------------------------- public path

#: Where pickles find the optimizers: the public path, not this file's, so a
#: pickle survives a move of the implementation.
PUBLIC_MODULE = "lightning_baoc.optim"
BlockwiseOptimizer.__module__ = PUBLIC_MODULE
BlockwiseAdamW.__module__ = PUBLIC_MODULE

