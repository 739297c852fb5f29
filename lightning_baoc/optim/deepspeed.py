"""The blockwise optimizers as DeepSpeed's client optimizer under ZeRO stages 1, 2 and 3.

Under ZeRO the client optimizer never steps the model's parameters. DeepSpeed flattens each param
group and hands the client one flat fp32 partition per rank: stages 1 and 2 one per param group
(``single_partition_of_fp32_groups``, swapped into the client's groups), stage 3 one per sub-group
(``fp32_partitioned_groups_flat``, put into its group for the step of that sub-group and taken out
again). A parameter's elements lie in these flat tensors as *fragments*: a contiguous run of the
parameter's flat order, split between ranks wherever a partition ends (mid-row, mid-8-bit-group).

:func:`zero_client` wraps a :class:`~lightning_baoc.optim.BlockwiseOptimizer` (AdamW, SGD or Lion)
built over the model's parameters into a :class:`ZeroClient`, the optimizer handed to
``deepspeed.initialize`` (or the optimizer itself, handed as it is: see below). At its first use after
DeepSpeed's set-up it reads where every parameter's fragment lies, once (:func:`read_fragments`: stages
1/2 ``param._hp_mapping``, stage 3 ``param._z3_optimizer.grad_position[param.ds_id]``), checks the map
(the DeepSpeed version among :data:`SUPPORTED_DEEPSPEED`, fragments that tile each parameter in rank
order) and builds the inner optimizer, of the wrapped one's class and settings, over one view per
fragment into the flat tensors, each view's place in its parameter given to it as its
:class:`~lightning_baoc.optim.placement.FragmentPlacements` (the optimizer asks them for the shape a
format is decided on, the record's offset and shared edges, the order of conversions):

- every rank holds a fragment of every parameter, empty where another rank holds all of it, so
  that every rank's records are the same, in the same order, as under FSDP2 (``optim.sharding``);
- a fragment's format is decided on the whole parameter (its shape, ``min_8bit_numel``), never on
  the fragment, so every rank holds the format one process holds;
- the element-wise formats' stochastic rounding draws the whole parameter's bits for the same
  elements (the record's ``shard_offset`` is the fragment's place in the parameter);
- the 8-bit formats' groups of 32 and super-blocks of 1024 are the whole parameter's: a fragment
  starting or ending inside one is laid out in the whole parameter's frame, and the split group
  takes its scale from both parts through the edge exchange of ``optim.sharding.FlatShards`` (one
  all-reduce over the data-parallel group per such parameter and write), so codes, scales and
  exponents are the one-process ones, bit for bit;
- factored formats hold a fragment of whole rows (``optim.sharding.RowShards``: the column
  statistics summed over the ranks); where a partition cuts a parameter mid-row, the parameter is
  held as a 1-D tensor is, the format's documented fallback (``factored`` -> ``nomomentum``,
  ``int8_factored`` -> ``int8``), on every rank alike.

Every DeepSpeed call of the client's ``step()`` (one per param group at stages 1/2, one per sub-group
at stage 3) steps the fragments of the flat tensors in its groups, from views of the gradients
DeepSpeed set on them; the groups' hyperparameters (an LR scheduler's ``lr``) are read at each call.
``state_bytes()`` is this rank's state, equal to the storage allocated.

Handed as it is: a blockwise optimizer given to ``deepspeed.initialize`` itself, as torch's optimizers
are, becomes the client (:func:`become_client`). ZeRO rewrites its param groups in place to hold the flat
partitions (stages 1/2) or nothing but the sub-group being stepped (stage 3); the optimizer's first call
that finds tensors there it holds no record of (DeepSpeed's first ``step()``, ``load_state_dict`` of
``load_checkpoint``, the user's ``state_bytes()`` or ``set_formats()``) builds, locally, the client
:func:`zero_client` would have built of it, from its records and its own group dicts, and forwards that
call and every later one to it: the step, ``zero_grad``, the state dicts, ``state_bytes``, ``formats``,
``set_formats``, ``param_state``, ``named_params``, ``to_adamw_state_dict``. The two paths train the
same weights and states bit for bit, and their checkpoints load into each other; ``zero_client(opt)``
returns the client ``opt`` became (its :attr:`ZeroClient.inner`, :meth:`ZeroClient.bind`,
:meth:`ZeroClient.load_adamw_state_dict`). An optimizer that stepped before ``deepspeed.initialize``
(its state lies in the whole parameters) or releases its gradients is refused at that first call, the
message naming the way that works. At ZeRO stage 0 DeepSpeed leaves the groups as they are and the
optimizer steps the parameters itself, as the client's stage-0 map would.

Checkpoints: DeepSpeed's ``save_checkpoint`` stores each rank's ``state_dict()`` in its own file; it
holds the compact states (int8 stays int8) with the fragment map it was saved under, and
``load_state_dict`` (called by ``load_checkpoint``) takes it back at the same world size and ZeRO
configuration, bit-equal, or refuses it naming :meth:`ZeroClient.to_adamw_state_dict`, the export of
whole fp32 moments per parameter that loads at any rank count (:meth:`ZeroClient.load_adamw_state_dict`)
and into a plain ``torch.optim.AdamW``.

Not supported, refused by name: NVMe swapping of optimizer states, ZeRO's elastic checkpoints,
parameters partitioned over groups other than one data-parallel group spanning the world (MoE
experts, hierarchical partitioning).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import Tensor

from lightning_baoc.formats import Canonical, check_format_name
from lightning_baoc.formats.base import ShardShape
from lightning_baoc.formats.quant import SUPER
from lightning_baoc.optim.checkpoint.layout import CheckpointError
from lightning_baoc.optim.placement import FragmentPlacements, Placement
from lightning_baoc.optim.sharding import FlatShards, Piece, RowShards

#: The DeepSpeed releases whose internals (the fragment maps read here) this module was checked
#: against: ``>= SUPPORTED_DEEPSPEED[0]`` and ``< SUPPORTED_DEEPSPEED[1]`` (tested with 0.19.8).
SUPPORTED_DEEPSPEED = ("0.19", "0.20")
#: The version of :meth:`ZeroClient.state_dict`'s layout.
LAYOUT_VERSION = 1
#: The key of a :class:`ZeroClient` state dict's own entry.
KEY = "baoc_deepspeed"


def check_deepspeed_version(version: str) -> None:
    """Refuse a DeepSpeed release outside :data:`SUPPORTED_DEEPSPEED` (its ZeRO internals may differ)."""
    from packaging.version import Version

    low, high = (Version(v) for v in SUPPORTED_DEEPSPEED)
    if not low <= Version(Version(version).base_version) < high:
        raise RuntimeError(
            f"DeepSpeed {version} is not supported by lightning_baoc's ZeRO client: it reads ZeRO's fragment maps "
            f"(param._hp_mapping, the stage-3 grad_position), checked for DeepSpeed >={SUPPORTED_DEEPSPEED[0]},"
            f"<{SUPPORTED_DEEPSPEED[1]}. Install a supported release: pip install 'deepspeed>={SUPPORTED_DEEPSPEED[0]},"
            f"<{SUPPORTED_DEEPSPEED[1]}'"
        )


@dataclass(frozen=True)
class Fragment:
    """Where one parameter's elements on this rank lie in DeepSpeed's flat tensors."""

    name: str  # the parameter's name (the wrapped optimizer's)
    group: int  # the client's param group holding the parameter
    flat: int  # the flat tensor (:class:`FragmentMap` ``flats``) holding the fragment
    start: int  # the fragment's first element in the flat tensor
    offset: int  # the fragment's first element in the whole parameter's flat order
    numel: int  # the fragment's elements (0: other ranks hold all of the parameter)
    shape: tuple[int, ...]  # the whole parameter's shape


@dataclass
class FragmentMap:
    """Every fragment of this rank, the flat tensors they lie in, and the data-parallel group."""

    stage: int  # 0 (the parameters themselves), 1 (stages 1 and 2: one flat per group), 3 (one flat per sub-group)
    fragments: list[Fragment]  # in the client's order: group by group, the parameters in their order
    flats: list[Tensor]
    rank: int
    world: int
    process_group: Any  # None when world == 1
    #: name -> every rank's (offset, numel), in rank order (an empty fragment placed where it would start)
    spans: dict[str, tuple[tuple[int, int], ...]] | None = None

    @property
    def stage_name(self) -> str:
        """The ZeRO stage(s) the map's layout is: ``"0"``, ``"1/2"`` (the same layout) or ``"3"``."""
        return "1/2" if self.stage == 1 else str(self.stage)

    def starts(self, name: str, numel: int) -> tuple[int, ...]:
        """Every rank's first element of ``name``'s flat order, in rank order, then its numel."""
        return tuple(offset for offset, _ in self.spans[name]) + (numel,)

    def summary(self) -> dict[str, Any]:
        """What a state dict records of the map (primitives): the stage, world size, rank and fragments."""
        return {"stage": self.stage, "world": self.world, "rank": self.rank,
                "fragments": {f.name: [f.offset, f.numel] for f in self.fragments}}


def read_fragments(lp_groups: Sequence[Sequence[Tensor]], names: Sequence[Sequence[str]],
                   client_groups: Sequence[Mapping[str, Any]]) -> FragmentMap:
    """The :class:`FragmentMap` of the model parameters ``lp_groups`` (named ``names``), as DeepSpeed
    laid them out (read after ``deepspeed.initialize``; every rank calls it: a collective).

    ``client_groups``: the client's param groups, as DeepSpeed left them (stages 1/2: each holds its
    flat partition). Raises ``RuntimeError`` for a map it cannot read, naming what differs.
    """
    import deepspeed

    check_deepspeed_version(deepspeed.__version__)
    params = [p for group in lp_groups for p in group]
    if any(getattr(p, "_z3_optimizer", None) is not None for p in params):
        fmap = _read_stage3(lp_groups, names)
    elif any(hasattr(p, "_hp_mapping") for p in params):
        fmap = _read_stage12(lp_groups, names, client_groups)
    else:
        fmap = _read_plain(lp_groups, names, client_groups)
    fmap.spans = _gather_spans(fmap)
    return fmap


def _rank_in_every_rank_group(group: Any, stage: str) -> tuple[int, int]:
    """This rank and the size of DeepSpeed's data-parallel ``group``, which must hold every rank."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
    if world != dist.get_world_size():
        raise RuntimeError(f"{stage} partitions over a data-parallel group of {world} of the world's "
                           f"{dist.get_world_size()} ranks; lightning_baoc's client optimizer supports one group of "
                           f"every rank (no model or expert parallelism)")
    return rank, world


def _read_stage3(lp_groups: Sequence[Sequence[Tensor]], names: Sequence[Sequence[str]]) -> FragmentMap:
    zero = next(p._z3_optimizer for g in lp_groups for p in g if getattr(p, "_z3_optimizer", None) is not None)
    if getattr(zero, "swap_optimizer", False):
        raise RuntimeError("ZeRO-3 NVMe swapping of optimizer states (offload_optimizer.device='nvme') is not supported "
                           "with lightning_baoc's client optimizer; use device 'cpu' or 'none'")
    group = zero.dp_process_group
    rank, world = _rank_in_every_rank_group(group, "ZeRO-3")
    fragments = []
    for g, (params, group_names) in enumerate(zip(lp_groups, names)):
        for p, name in zip(params, group_names):
            if getattr(p, "_z3_optimizer", None) is not zero:
                raise RuntimeError(f"parameter {name!r} is not partitioned by the ZeRO-3 optimizer the others are")
            sub, start, partition = (int(v) for v in zero.grad_position[zero.get_param_id(p)])
            total = int(p.ds_numel)
            if partition != -(-total // world):
                raise RuntimeError(f"parameter {name!r}: ZeRO-3 partition of {partition} elements for {total} over "
                                   f"{world} ranks; expected ceil({total}/{world}): this DeepSpeed lays out partitions "
                                   f"otherwise than the supported releases")
            if int(zero.sub_group_to_group_id[sub]) != g:
                raise RuntimeError(f"parameter {name!r} lies in sub-group {sub} of param group "
                                   f"{zero.sub_group_to_group_id[sub]}; the client's group is {g}")
            offset = min(rank * partition, total)
            fragments.append(Fragment(name, g, sub, start, offset, max(0, min(partition, total - offset)),
                                      tuple(int(s) for s in p.ds_shape)))
    return FragmentMap(3, fragments, list(zero.fp32_partitioned_groups_flat), rank, world, group if world > 1 else None)


def _read_stage12(lp_groups: Sequence[Sequence[Tensor]], names: Sequence[Sequence[str]],
                  client_groups: Sequence[Mapping[str, Any]]) -> FragmentMap:
    flats = []
    for g, group in enumerate(client_groups):
        if len(group["params"]) != 1:
            raise RuntimeError(f"param group {g} holds {len(group['params'])} tensors after DeepSpeed's set-up; ZeRO "
                               f"stages 1/2 hand the client one flat partition per group")
        flats.append(group["params"][0])
    dp_groups = {id(getattr(p, "_dp_group", None)): getattr(p, "_dp_group", None) for g in lp_groups for p in g}
    if len(dp_groups) != 1:
        raise RuntimeError("the parameters are partitioned over several data-parallel groups (MoE experts); "
                           "lightning_baoc's client optimizer supports one group of every rank")
    group = next(iter(dp_groups.values()))
    rank, world = _rank_in_every_rank_group(group, "ZeRO")
    fragments = []
    for g, (params, group_names) in enumerate(zip(lp_groups, names)):
        flat = flats[g]
        for p, name in zip(params, group_names):
            mapping = p._hp_mapping
            if mapping is None:
                fragments.append(Fragment(name, g, g, 0, 0, 0, tuple(p.shape)))
                continue
            if int(mapping.param_group_index) != g:
                raise RuntimeError(f"parameter {name!r} is mapped to DeepSpeed's param group "
                                   f"{mapping.param_group_index}; the client's group is {g}")
            hp, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
            start, numel, offset = int(hp.start), int(hp.numel), int(lp.start)
            at = flat.data_ptr() + start * flat.element_size()
            if numel != int(lp.numel) or (numel and mapping.hp_fragment.data_ptr() != at) or start + numel > flat.numel():
                raise RuntimeError(f"parameter {name!r}: its ZeRO fragment ({start}, {numel}) does not lie in the flat "
                                   f"partition of group {g} ({flat.numel()} elements) as the supported releases lay it")
            fragments.append(Fragment(name, g, g, start, offset, numel, tuple(p.shape)))
    return FragmentMap(1, fragments, flats, rank, world, group if world > 1 else None)


def _read_plain(lp_groups: Sequence[Sequence[Tensor]], names: Sequence[Sequence[str]],
                client_groups: Sequence[Mapping[str, Any]]) -> FragmentMap:
    held = [p for group in client_groups for p in group["params"]]
    if len(held) != sum(len(g) for g in lp_groups) or any(a is not b for a, b in zip(held, (p for g in lp_groups for p in g))):
        raise RuntimeError("the client's param groups hold other tensors than the model's parameters, and no ZeRO "
                           "fragment map was found: call the client after deepspeed.initialize, with a supported "
                           "DeepSpeed (ZeRO stages 0-3)")
    fragments, flats = [], []
    for g, (params, group_names) in enumerate(zip(lp_groups, names)):
        for p, name in zip(params, group_names):
            fragments.append(Fragment(name, g, len(flats), 0, 0, p.numel(), tuple(p.shape)))
            flats.append(p)
    return FragmentMap(0, fragments, flats, 0, 1, None)


def _gather_spans(fmap: FragmentMap) -> dict[str, tuple[tuple[int, int], ...]]:
    """name -> every rank's (offset, numel), checked to tile the parameter in rank order."""
    mine = [(f.name, f.offset, f.numel) for f in fmap.fragments]
    if fmap.world > 1:
        import torch.distributed as dist

        every: list[Any] = [None] * fmap.world
        dist.all_gather_object(every, mine, group=fmap.process_group)
    else:
        every = [mine]
    if any([n for n, _, _ in table] != [n for n, _, _ in mine] for table in every):
        raise RuntimeError("the ranks' optimizers hold different parameters; build the same optimizer on every rank")
    spans = {}
    for i, f in enumerate(fmap.fragments):
        numel = math.prod(f.shape)
        placed, end = [], 0
        for table in every:
            _, offset, count = table[i]
            if count:
                if offset != end:
                    raise RuntimeError(f"parameter {f.name!r}: the ranks' ZeRO fragments do not follow each other in "
                                       f"rank order (one starts at {offset}, the one before ends at {end})")
                end = offset + count
            placed.append((offset if count else end, count))
        if end != numel:
            raise RuntimeError(f"parameter {f.name!r}: the ranks' ZeRO fragments hold {end} of its {numel} elements")
        spans[f.name] = tuple(placed)
    return spans


#: The constructor settings every blockwise optimizer takes, read from the wrapped one.
_SETTINGS = ("min_8bit_numel", "skip_nonfinite", "seed", "chunk_size", "kernels", "atomic_step")


def _is_blockwise(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a blockwise optimizer (BlockwiseAdamW, BlockwiseSGD, BlockwiseLion, or a class
    of theirs): a torch optimizer whose class names the formats its parameters may be held in, and that can
    become DeepSpeed's client. Read off the object: the optimizer imports this module (to become the client
    where it was handed to ``deepspeed.initialize`` itself), and this module does not import it back."""
    return (isinstance(optimizer, torch.optim.Optimizer) and hasattr(type(optimizer), "format_registry")
            and callable(getattr(optimizer, "_zero_client", None)))


def _check_wrappable(optimizer: Any, handed: bool) -> None:
    """Refuse an optimizer no client can be built from: not a blockwise one, holding state already, or
    stepping its parameters in backward (``handed``: given to ``deepspeed.initialize`` itself, not to
    :func:`zero_client`; the messages name the way that works)."""
    if not _is_blockwise(optimizer):
        raise TypeError(f"zero_client wraps a BlockwiseAdamW, BlockwiseSGD or BlockwiseLion, got "
                        f"{type(optimizer).__name__}; build one with BlockwiseAdamW.from_optimizer(...)")
    if optimizer.state:
        if handed:
            raise RuntimeError(
                f"the {optimizer.label} handed to deepspeed.initialize stepped before it: its state lies in the whole "
                f"parameters, which ZeRO has partitioned since. Hand DeepSpeed an optimizer without state, e.g. "
                f"zero_client({optimizer.label}(...)) built before the first step; to carry this state over, save "
                f"this one's to_adamw_state_dict() before deepspeed.initialize and load it after into the new one's "
                f"client: zero_client(new).load_adamw_state_dict(saved)")
        raise ValueError(f"the {optimizer.label} passed to zero_client holds state already; wrap it before its first "
                         f"step (DeepSpeed's partitions are made at deepspeed.initialize)")
    if optimizer.releases_gradients:
        raise ValueError(
            f"the {optimizer.label} {'handed to deepspeed.initialize' if handed else 'passed to zero_client'} releases "
            f"its gradients (each parameter stepped in backward); under ZeRO DeepSpeed steps its partitions after "
            f"reducing the gradients: call release_gradients(False) before deepspeed.initialize")


def become_client(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> ZeroClient | None:
    """The :class:`ZeroClient` that ``optimizer``, handed to ``deepspeed.initialize`` itself (without
    :func:`zero_client`), becomes: the one :func:`zero_client` would have made of it, over the group dicts
    DeepSpeed holds. Called by the optimizer at the first call that finds its param groups rewritten (a
    local step: the client binds to the partitions at its first step or state dict, on every rank alike).

    Args:
        optimizer: the blockwise optimizer DeepSpeed holds.
        groups: its group dicts as it built them (ZeRO puts a one-group list in place of its list
            around each group's step; the client needs every group).

    Returns:
        the client, or ``None`` where the parameters carry no ZeRO partitioning or the groups are not the
        optimizer's own (edited otherwise, or another optimizer's assigned to it): the optimizer then
        answers as itself, and its own checks speak.

    Raises:
        RuntimeError: the optimizer stepped before ``deepspeed.initialize`` (naming :func:`zero_client`).
        ValueError: it releases its gradients.
    """
    params = optimizer._records  # noqa: SLF001  (the parameters, whatever ZeRO left in the groups)
    if not any(getattr(p, "_z3_optimizer", None) is not None or hasattr(p, "_hp_mapping") for p in params):
        return None
    own = {id(g) for g in groups}
    if not all(id(g) in own for g in optimizer.param_groups):
        return None
    _check_wrappable(optimizer, handed=True)
    return ZeroClient(optimizer, groups)


class ZeroClient(torch.optim.Optimizer):
    """A blockwise optimizer as DeepSpeed's client optimizer (ZeRO stages 0-3): state per fragment of
    DeepSpeed's flat partitions, each in its parameter's format (see the module).

    Built by :func:`zero_client` from a :class:`~lightning_baoc.optim.BlockwiseOptimizer` over the
    model's parameters, before ``deepspeed.initialize``, or by the optimizer itself where it was handed to
    ``deepspeed.initialize`` as it is (:func:`become_client`). Its param groups are DeepSpeed's to rewrite;
    the optimizer doing the work, :attr:`inner`, is built at the first ``step()``, ``state_dict()``,
    ``load_state_dict()`` or :meth:`bind` after DeepSpeed's set-up. The inner optimizer's formats,
    accounting and conversions are those of the wrapped class: :meth:`set_formats`,
    :meth:`formats`, :meth:`state_bytes` and the others named here forward to it.

    Args:
        optimizer: a BlockwiseAdamW, BlockwiseSGD or BlockwiseLion without state yet.
        handed: the group dicts of ``optimizer`` where DeepSpeed holds ``optimizer`` itself and rewrote
            them (:func:`become_client`): the client's groups are those, stepped as DeepSpeed hands them to
            ``optimizer`` (default: ``None``, the client's own copies, handed to DeepSpeed in its place).

    Example:
        >>> opt = zero_client(BlockwiseAdamW(model.parameters(), state_format="int8", param_names=model))  # doctest: +SKIP
        >>> engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)  # doctest: +SKIP
    """

    def __init__(self, optimizer: torch.optim.Optimizer, handed: list[dict[str, Any]] | None = None) -> None:
        if handed is None:
            _check_wrappable(optimizer, handed=False)
        source = optimizer.param_groups if handed is None else handed
        self._wrapped_class = type(optimizer)
        self._settings = {k: getattr(optimizer, k) for k in _SETTINGS}
        # the parameters by group from the records (the groups themselves hold DeepSpeed's partitions once it
        # rewrote them): in the groups' order, the order add_param_group recorded them in
        records = optimizer._records  # noqa: SLF001
        self._lp_groups: list[list[Tensor]] = [[] for _ in source]
        for p, rec in records.items():
            self._lp_groups[rec.group].append(p)
        self._names = [[records[p].name for p in g] for g in self._lp_groups]
        self._requests = {records[p].name: records[p].requested for g in self._lp_groups for p in g
                          if records[p].requested}
        groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")} | {"params": params}
                  for g, params in zip(source, self._lp_groups)]
        super().__init__(groups, dict(optimizer.defaults))
        # the optimizer whose groups DeepSpeed rewrites and steps (ZeRO 1/2 put a one-group list in its
        # param_groups around each group's step): None, this one; or the optimizer handed to it itself
        self._host: torch.optim.Optimizer | None = None
        if handed is not None:
            self.param_groups, self._host = handed, optimizer
        self._outer = list(self.param_groups)  # the group dicts, which DeepSpeed keeps while it swaps lists
        self.inner: Any = None  # a blockwise optimizer of the wrapped one's class, over the fragments
        self.fragment_map: FragmentMap | None = None
        self._views: list[Tensor] = []  # per fragment: its view into its flat tensor (the inner optimizer's parameter)
        self._by_flat: dict[int, list[int]] = {}
        self._flat_ptrs: list[int] = []

    # ------------------------------------------------------------------ set-up

    def bind(self) -> Any:
        """Read DeepSpeed's fragment maps and build :attr:`inner` (once; later calls return it). Call it
        on every rank, after ``deepspeed.initialize`` (a collective)."""
        if self.inner is not None:
            return self.inner
        if len(self._outer) != len(self._lp_groups):
            raise RuntimeError(f"DeepSpeed kept {len(self._outer)} of the client's {len(self._lp_groups)} param groups "
                               f"(it drops groups without parameters): give every param group a parameter")
        fmap = read_fragments(self._lp_groups, self._names, self._outer)
        inner_groups = []
        table: dict[Tensor, Placement] = {}  # each fragment's view -> where it lies in its parameter
        for g, outer in enumerate(self._outer):
            hyper = {k: v for k, v in outer.items() if k != "params"}
            inner_groups.append({**hyper, "params": [], "param_names": []})
        with torch.no_grad():
            for i, f in enumerate(fmap.fragments):
                view, placement = self._fragment_view(fmap, f)
                table[view] = placement
                self._views.append(view)
                self._by_flat.setdefault(f.flat, []).append(i)
                inner_groups[f.group]["params"].append(view)
                inner_groups[f.group]["param_names"].append(f.name)
        # the wrapped optimizer's class and settings, its formats decided on the whole parameters
        inner = self._wrapped_class(inner_groups, placements=FragmentPlacements(table), **self._settings)
        if self._requests:
            inner.set_formats(self._requests)
        self._flat_ptrs = [t.data_ptr() for t in fmap.flats]
        self.fragment_map, self.inner = fmap, inner
        return inner

    @staticmethod
    def _fragment_view(fmap: FragmentMap, f: Fragment) -> tuple[Tensor, Placement]:
        """A fragment's view into its flat tensor, and where it lies in its parameter: the shape its format is
        decided on, its first element in the parameter, the 8-bit groups and rows it shares with other ranks."""
        flat = fmap.flats[f.flat].detach().reshape(-1)
        numel = math.prod(f.shape)
        starts = fmap.starts(f.name, numel)
        split = sum(1 for _, count in fmap.spans[f.name] if count) > 1
        cols = math.prod(f.shape[1:]) if len(f.shape) >= 2 else 0
        rows_whole = bool(cols) and all(s % cols == 0 for s in starts)
        view = flat.narrow(0, f.start, f.numel)
        if rows_whole:
            view = view.view(f.numel // cols, *f.shape[1:])
        elif f.numel == numel:
            view = view.view(f.shape)
        # a parameter of its own (sharing the flat tensor's storage), so that a stand-in module can hold it too
        view = torch.nn.Parameter(view, requires_grad=True)
        # what a budget counts (BAOC's tables, ``sharding.shard_shape``): per tensor, the most any rank holds
        shards = [((count // cols, *f.shape[1:]) if rows_whole else (count,), offset)
                  for offset, count in fmap.spans[f.name] if count]
        largest = max(shards, key=lambda s: math.prod(s[0]))[0]
        view.baoc_counted_shape = ShardShape(largest, f.shape if rows_whole or not split else (numel,), shards)
        # a split parameter cut mid-row has no factored form here: decided as a 1-D tensor of its numel
        decision = f.shape if rows_whole or not split else (numel,)
        frame = None
        if split and not all(a % SUPER == 0 for a in starts[1:-1] if a < starts[-1]):
            frame = FlatShards(f.offset if f.numel else fmap.spans[f.name][fmap.rank][0], f.numel, starts, fmap.rank,
                               fmap.process_group)
        row_shards = RowShards(int(f.shape[0]), fmap.process_group) if split and rows_whole else None
        if fmap.process_group is not None:  # on several ranks: what the sampler and the risk scores sum over them
            offset = f.offset if f.numel else fmap.spans[f.name][fmap.rank][0]
            view.baoc_piece = Piece(tuple(f.shape), tuple(decision), offset, fmap.process_group, row_shards)
        return view, Placement(tuple(decision), f.offset, frame, row_shards)

    def _rebind_moved(self) -> None:
        """Point the fragment views at the flat tensors' storage again where DeepSpeed replaced it."""
        fmap = self.fragment_map
        for j, flat in enumerate(fmap.flats):
            if flat.data_ptr() != self._flat_ptrs[j]:
                source = flat.detach().reshape(-1)
                for i in self._by_flat.get(j, ()):
                    f = fmap.fragments[i]
                    self._views[i].data = source.narrow(0, f.start, f.numel).view(self._views[i].shape)
                self._flat_ptrs[j] = flat.data_ptr()

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # noqa: D401 - torch's signature
        """Step the fragments of the flat tensors in the param groups now (DeepSpeed's call of one group or
        sub-group), from views of the gradients DeepSpeed set on them."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inner = self.bind()
        self._rebind_moved()
        fmap = self.fragment_map
        flat_index = {id(t): j for j, t in enumerate(fmap.flats)}
        stepped: list[int] = []
        for group in (self if self._host is None else self._host).param_groups:  # as DeepSpeed set them now
            g = next((k for k, outer in enumerate(self._outer) if outer is group), None)
            if g is None:
                raise RuntimeError("DeepSpeed stepped a param group the client did not hand it; the client's groups "
                                   "are fixed at deepspeed.initialize")
            _copy_hyper(group, inner.param_groups[g])
            for flat in group["params"]:
                j = flat_index.get(id(flat))
                if j is None:
                    raise RuntimeError(f"DeepSpeed stepped a tensor of {flat.numel()} elements that is none of the flat "
                                       f"partitions read at set-up")
                if flat.grad is None:
                    continue
                grad = flat.grad.detach().reshape(-1)
                for i in self._by_flat.get(j, ()):
                    f = fmap.fragments[i]
                    self._views[i].grad = grad.narrow(0, f.start, f.numel).view(self._views[i].shape)
                    stepped.append(i)
        try:
            self._agree_nonfinite(stepped)
            observers = list(inner._release.observers.values())  # noqa: SLF001  (BAOC's sampler: the gradients handed here)
            for i in stepped if observers else ():
                if self._views[i].grad is not None:
                    for observe in observers:
                        observe(self._views[i])
            inner.step()
        finally:
            for i in stepped:
                self._views[i].grad = None
        return loss

    def _agree_nonfinite(self, stepped: list[int]) -> None:
        """A split parameter whose gradient is not finite on some rank skips on every rank (one process
        skips the whole parameter; a rank stepping its fragment alone would also wait for the others'
        8-bit edges): its fragments' gradients are dropped for this step."""
        fmap = self.fragment_map
        if not self.inner.skip_nonfinite or fmap.world == 1:
            return
        split = [i for i in stepped if sum(1 for _, c in fmap.spans[fmap.fragments[i].name] if c) > 1]
        if not split:
            return
        import torch.distributed as dist

        flags = torch.tensor([int(bool(torch.isfinite(self._views[i].grad).all())) for i in split], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=fmap.process_group)
        for i, ok in zip(split, flags.tolist()):
            if not ok:
                self._views[i].grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: DeepSpeed owns the gradients of its flat partitions (the fragments' are views
        set for one step)."""

    # ------------------------------------------------------------------ the inner optimizer's API

    def _bound(self) -> Any:
        if self.inner is None:
            raise RuntimeError("the ZeroClient is not bound to DeepSpeed's partitions yet: call it after "
                               "deepspeed.initialize and its first step, or bind it first on every rank: client.bind() "
                               "(zero_client(optimizer).bind() for an optimizer handed to deepspeed.initialize itself)")
        return self.inner

    def state_bytes(self, by_group: bool = False) -> int | list[int]:
        """This rank's optimizer-state bytes on the training device, equal to the storage allocated."""
        return self._bound().state_bytes(by_group)

    def formats(self) -> dict[str, str]:
        """Parameter name -> effective format (every rank's the same)."""
        return self._bound().formats()

    def set_formats(self, formats: Mapping[str, str], blocks: Mapping[str, Iterable[str]] | None = None
                    ) -> dict[str, tuple[str, str]]:
        """Convert the named parameters' or blocks' states in place (call it on every rank with the same
        formats: a conversion of a split parameter into an 8-bit or factored format is a collective)."""
        if self.inner is None:
            for key, fmt in formats.items():  # before set-up: kept as requests, like the wrapped optimizer's
                check_format_name(fmt, f"format of {key!r}", self._wrapped_class.format_registry)
                for name in self._resolve_early(key, blocks):
                    self._requests[name] = fmt
            return {}
        return self.inner.set_formats(formats, blocks)

    def _resolve_early(self, key: str, blocks: Mapping[str, Iterable[str]] | None) -> list[str]:
        names = [n for g in self._names for n in g]
        if blocks is not None and key in blocks:
            return list(blocks[key])
        found = [n for n in names if n == key or n.startswith(key + ".")]
        if not found:
            raise ValueError(f"{key!r} names no parameter, block or module of this optimizer; names look like {names[:8]}")
        return found

    def param_state(self, name: str) -> Canonical | None:
        """This rank's fragment of a parameter's state, decoded to fp32 (``None`` before its first step)."""
        return self._bound().param_state(name)

    @property
    def named_params(self) -> dict[str, Tensor]:
        """Parameter name -> this rank's fragment (a view into DeepSpeed's flat partition)."""
        return self._bound().named_params

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: the inner optimizer's compact state dict (keyed by parameter name) and the
        fragment map it was saved under (what DeepSpeed's ``save_checkpoint`` stores per rank)."""
        inner = self.bind()
        return {"state": {}, "param_groups": [{k: v for k, v in g.items() if k != "params"} | {"params": []}
                                              for g in self._outer],
                KEY: {"version": LAYOUT_VERSION, "map": self.fragment_map.summary(), "optimizer": inner.state_dict()}}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a :meth:`state_dict` of this rank, saved at the same world size and ZeRO configuration (the
        compact states as they were: formats kept, dtypes kept). Another layout is refused with a
        :class:`~lightning_baoc.optim.CheckpointError` naming the export that moves between rank counts."""
        inner = self.bind()
        own = state_dict.get(KEY) if isinstance(state_dict, Mapping) else None
        if not isinstance(own, Mapping):
            raise CheckpointError(
                "this optimizer state was not saved by lightning_baoc's ZeRO client (no 'baoc_deepspeed' entry): a "
                "plain optimizer's ZeRO state cannot be read per fragment; resume it with that optimizer, or load its "
                "whole fp32 moments with load_adamw_state_dict()")
        if own.get("version") != LAYOUT_VERSION:
            raise CheckpointError(f"ZeRO client state of layout version {own.get('version')!r}; this release reads "
                                  f"version {LAYOUT_VERSION}")
        saved, now = own.get("map"), self.fragment_map.summary()
        if saved != now:
            what = (f"world size {saved.get('world')} (ZeRO layout {saved.get('stage')})" if isinstance(saved, Mapping)
                    else "an unknown layout")
            raise CheckpointError(
                f"this ZeRO client state was saved at {what} with other fragments than this run's (world size "
                f"{now['world']}, ZeRO stage {self.fragment_map.stage_name}, rank {now['rank']}): per-fragment state resumes at the same "
                f"world size and ZeRO configuration only. To move a run, save client.to_adamw_state_dict() (on every "
                f"rank) and load it with client.load_adamw_state_dict() at the new rank count")
        for g, outer in enumerate(self._outer):  # the groups' hyperparameters as saved (an LR scheduler's lr)
            saved_group = state_dict["param_groups"][g]
            outer.update({k: v for k, v in saved_group.items() if k != "params"})
        inner.load_state_dict(own["optimizer"])
        for g, outer in enumerate(self._outer):
            _copy_hyper(outer, inner.param_groups[g])

    def to_adamw_state_dict(self) -> dict[str, Any]:
        """The whole fp32 moments of every parameter, as a plain ``torch.optim.AdamW`` state dict over the
        model's parameters (positions in the client's group order, names in ``param_names``): loads at any
        rank count (:meth:`load_adamw_state_dict`) and into ``torch.optim.AdamW``. A collective: call it on
        every rank (each gets the whole dict)."""
        inner = self.bind()
        if inner.rule != "adamw":
            raise TypeError(f"to_adamw_state_dict exports AdamW's state; this client wraps a {inner.label}")
        fmap = self.fragment_map
        state: dict[int, dict[str, Tensor]] = {}
        for i, f in enumerate(fmap.fragments):
            canonical = inner.param_state(f.name)
            step = _all_ranks_max(inner.step_count(f.name), fmap)  # a rank holding none of it never steps it
            if step == 0:
                continue
            m = canonical.exp_avg if canonical is not None and canonical.exp_avg is not None else None
            v = canonical.dense_v() if canonical is not None else None
            state[i] = {"step": torch.tensor(float(step)),
                        "exp_avg": _gather_whole(m, f, fmap), "exp_avg_sq": _gather_whole(v, f, fmap)}
        groups, start = [], 0
        for g, outer in enumerate(self._outer):
            count = len(self._lp_groups[g])
            keep = {k: v for k, v in outer.items() if k not in ("params", "state_format", "weight_correction")}
            groups.append({**keep, "params": list(range(start, start + count)), "param_names": list(self._names[g])})
            start += count
        return {"state": state, "param_groups": groups}

    def load_adamw_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load a plain AdamW state dict of the whole parameters (:meth:`to_adamw_state_dict` at any rank
        count, or ``torch.optim.AdamW.state_dict()`` over the same model): each rank takes its fragments'
        elements and encodes them into their formats."""
        inner = self.bind()
        fmap = self.fragment_map
        state = {}
        for index, entry in state_dict["state"].items():
            i = int(index)
            f = fmap.fragments[i]
            view = self._views[i]
            state[i] = {k: (t.reshape(-1).narrow(0, f.offset, f.numel).view(view.shape).to(torch.float32)
                            if k in ("exp_avg", "exp_avg_sq") else t) for k, t in entry.items()}
        groups = [{"params": list(range(sum(len(g) for g in self._lp_groups[:k]),
                                        sum(len(g) for g in self._lp_groups[: k + 1])))}
                  for k in range(len(self._lp_groups))]
        inner.load_state_dict({"state": state, "param_groups": groups})


def _all_ranks_max(value: int, fmap: FragmentMap) -> int:
    if fmap.world == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=fmap.process_group)
    return int(t.item())


def _gather_whole(t: Tensor | None, f: Fragment, fmap: FragmentMap) -> Tensor:
    """The whole parameter's tensor from every rank's fragment ``t`` (zeros where a rank holds none)."""
    numel = math.prod(f.shape)
    whole = torch.zeros(numel, dtype=torch.float32)
    if t is not None and f.numel:
        whole[f.offset : f.offset + f.numel] = t.reshape(-1).to(torch.float32)
    if fmap.world > 1:
        import torch.distributed as dist

        dist.all_reduce(whole, group=fmap.process_group)  # the fragments are disjoint: a sum assembles them
    return whole.view(f.shape)


def _copy_hyper(source: Mapping[str, Any], target: dict[str, Any]) -> None:
    """The client group's hyperparameters (DeepSpeed's and the schedulers' writes) into the inner group's."""
    for k, v in source.items():
        if k not in ("params", "param_names") and k in target and target[k] is not v:
            target[k] = v


def zero_client(optimizer: torch.optim.Optimizer) -> ZeroClient:
    """``optimizer`` (a blockwise optimizer over the model's parameters, without state yet) as the
    client optimizer of ``deepspeed.initialize`` under ZeRO stages 0-3 (:class:`ZeroClient`); of an
    optimizer handed to ``deepspeed.initialize`` itself, the client it became (:func:`become_client`).

    DeepSpeed refuses a client optimizer under ZeRO unless its config sets
    ``"zero_allow_untested_optimizer": true`` (Lightning's ``DeepSpeedStrategy`` sets it), and with its
    optimizer offload unless it sets ``"zero_force_ds_cpu_optimizer": false``.

    Example:
        >>> opt = zero_client(BlockwiseAdamW(model.parameters(), state_format="int8", param_names=model))  # doctest: +SKIP
        >>> engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)  # doctest: +SKIP
    """
    if isinstance(optimizer, ZeroClient):
        return optimizer
    became = optimizer._zero_client() if _is_blockwise(optimizer) else None  # noqa: SLF001
    return became if became is not None else ZeroClient(optimizer)


__all__ = ["SUPPORTED_DEEPSPEED", "Fragment", "FragmentMap", "ZeroClient", "become_client", "check_deepspeed_version",
           "read_fragments", "zero_client"]
