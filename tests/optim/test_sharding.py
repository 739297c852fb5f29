"""The optimizers over FSDP2-sharded parameters (``DTensor``, ``lightning_baoc/optim/sharding.py``).

Two gloo ranks on the CPU, each model wrapped by ``fully_shard`` per layer (33 and 1 output rows:
uneven shards, and a rank holding no rows of a parameter):

- all-fp32 ``BlockwiseAdamW`` under FSDP2 equals torch's AdamW under FSDP2 within 1e-6 over 100 steps;
- int8 states under FSDP2 follow a single-process ``BlockwiseAdamW`` on the same global batch within
  the format's error (a small fraction of the update);
- each rank's state bytes are the storage it allocated, from its own shard's shape;
- formats are decided on the global parameter: a shard below ``min_8bit_numel`` keeps int8 when its
  parameter is above it, on every rank alike;
- one process, two ranks and three given the same gradients end with the same weights, to the bit, in
  every element-wise format and in the 8-bit ones where shards start on a 32-element group;
- the whole fp32 state gathered by ``to_adamw_state_dict`` resumes in one process (same formats,
  within int8's error) and in a fresh two-rank run (to the bit);
- a NaN in one rank's rows skips the parameter on every rank;
- BlockwiseSGD in fp32 equals torch's SGD under FSDP2; bf16 weights keep their 8-bit correction per
  shard (1 byte per local element) and follow the single-process run; gradient release is refused;
- under HSDP (4 ranks: 2 replicas x 2 shards) fp32 equals torch's AdamW;
- the factored formats over rows split among ranks follow one process (stepped and converted, a shard
  of one row included); a momentum re-created at a conversion starts alike on every rank;
- a placement other than ``Shard(0)``/``Replicate`` is refused at construction;
- saved and loaded through ``torch.distributed.checkpoint`` (the distributed layout), a run resumes to the bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from support_distributed import needs_gloo, on_gloo_ranks
from torch import nn

from lightning_baoc import BlockwiseAdamW, BlockwiseSGD, CheckpointError, export_adamw_state_dict
from lightning_baoc.formats import FORMATS
from lightning_baoc.optim.sharding import shard_offset

pytestmark = needs_gloo
WORLD = 2
STEPS = 100

def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(48, 33), nn.Tanh(), nn.Linear(33, 64), nn.Tanh(), nn.Linear(64, 1))


def _shard(model: nn.Module, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _batch(step: int, rank: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The micro-batch of ``rank`` at ``step`` (``None``: the global batch, every rank's in order)."""
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(WORLD * 8, 48, generator=gen), torch.randn(WORLD * 8, 1, generator=gen)
    return (x, y) if rank is None else (x[rank * 8 : (rank + 1) * 8], y[rank * 8 : (rank + 1) * 8])


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, rank: int | None, start: int = 0) -> None:
    for step in range(start, start + steps):
        x, y = _batch(step, rank)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]


def _worker(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    _parity_with_torch(mesh, rank)
    _int8_follows_one_process(mesh, rank)
    _sgd_and_bf16_weights(mesh, rank)
    _one_and_two_ranks_agree(mesh)
    _full_export_moves_between_world_sizes(mesh, rank)
    _nonfinite_is_skipped_on_every_rank(mesh, rank)
    _refusals(mesh)


def _parity_with_torch(mesh, rank: int) -> None:  # type: ignore[no-untyped-def]
    ours, theirs = _shard(_model(), mesh), _shard(_model(), mesh)
    opt = BlockwiseAdamW(ours.named_parameters(), lr=1e-2, weight_decay=0.1, state_format="fp32")
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    _train(ours, opt, STEPS, rank)
    _train(theirs, ref, STEPS, rank)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert type(a).__name__ == "DTensor"
        diff = (a.full_tensor() - b.full_tensor()).abs().max().item()
        assert diff <= 1e-6, (name, diff)
    # the state of each rank is its shard's: 8 bytes per local element, what the pools hold
    local_numel = sum(p.to_local().numel() for p in ours.parameters())
    assert opt.state_bytes() == 8 * local_numel == sum(opt.pool_bytes().values())
    sizes = [None] * WORLD
    dist.all_gather_object(sizes, local_numel)
    assert sum(sizes) == sum(p.numel() for p in ours.parameters()) and len(set(sizes)) == 2  # uneven shards


def _int8_follows_one_process(mesh, rank: int) -> None:  # type: ignore[no-untyped-def]
    single, sharded = _model(), _shard(_model(), mesh)
    start = _full(sharded)
    kwargs = dict(lr=1e-2, state_format="int8", min_8bit_numel=1000)
    one = BlockwiseAdamW(single.named_parameters(), **kwargs)
    opt = BlockwiseAdamW(sharded.named_parameters(), **kwargs)
    _train(single, one, 30, None)
    _train(sharded, opt, 30, rank)
    # decided on the whole parameter: 0.weight has 1,584 elements (int8), 792 or fewer on a rank
    assert opt.formats() == one.formats()
    assert opt.formats()["0.weight"] == "int8" and opt.formats()["4.bias"] == "fp32"
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, opt.formats())
    assert everyone[0] == everyone[1]
    for (name, p), a, s in zip(single.named_parameters(), _full(sharded), start):
        update = (p.detach() - s).abs().max().item()
        assert (a - p.detach()).abs().max().item() <= 0.05 * update, name
    # a shard starting off a super-block holds the whole parameter's groups it touches (one more at most)
    expected = sum(spec.nbytes for n, p in sharded.named_parameters()
                   for spec in FORMATS[opt.formats()[n]].shard_layout(tuple(p.to_local().shape), shard_offset(p)))
    assert opt.state_bytes() == expected == sum(opt.pool_bytes().values()), (opt.state_bytes(), expected, opt.pool_bytes())


def _sgd_and_bf16_weights(mesh, rank: int) -> None:  # type: ignore[no-untyped-def]
    ours, theirs = _shard(_model(), mesh), _shard(_model(), mesh)
    kwargs = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    _train(ours, BlockwiseSGD(ours.named_parameters(), state_format="fp32", **kwargs), STEPS, rank)
    _train(theirs, torch.optim.SGD(theirs.parameters(), **kwargs), STEPS, rank)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert (a.full_tensor() - b.full_tensor()).abs().max().item() <= 1e-6, name
    # bf16 weights with an 8-bit master-weight correction held per shard
    single, sharded = _model().to(torch.bfloat16), _shard(_model().to(torch.bfloat16), mesh)
    kwargs = dict(lr=1e-3, state_format="int8", min_8bit_numel=0, weight_correction="ecc8")
    one, opt = BlockwiseAdamW(single.named_parameters(), **kwargs), BlockwiseAdamW(sharded.named_parameters(), **kwargs)
    start = _full(sharded)
    for step in range(20):
        for model, optimizer, who in ((single, one, None), (sharded, opt, rank)):
            x, y = _batch(step, who)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
            optimizer.step()
    assert opt.weight_correction_bytes() == sum(p.to_local().numel() for p in sharded.parameters())
    for (name, p), a, s in zip(single.named_parameters(), _full(sharded), start):
        update = (p.detach().float() - s.float()).abs().max().item()
        assert (a.float() - p.detach().float()).abs().max().item() <= 0.25 * update, name
    with pytest.raises(ValueError, match="gradient release over sharded parameters"):
        opt.release_gradients()


def _one_and_two_ranks_agree(mesh) -> None:  # type: ignore[no-untyped-def]
    """The same gradients, whole on one process and sharded on the mesh's ranks: the same weights, to
    the bit, in every element-wise format (rounding keys shifted by the shard's offset), and in the
    8-bit ones where each shard starts on a 32-element quantization group: shards of 33 rows of 256
    and 48 rows of 66 on 2 ranks (22 and 32 rows on 3), none on a 1024-element super-block, with
    gradient rows over 8 orders of magnitude (the super-blocks' shared exponents differ, the scales
    they store do not)."""
    from torch.distributed.tensor import distribute_tensor

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 66), nn.Tanh(), nn.Linear(66, 96))

    offsets = [-(-p.shape[0] // mesh.size()) * p[0].numel() for p in model().parameters() if p.dim() == 2]
    assert all(o % 32 == 0 and o % 1024 for o in offsets), offsets
    for fmt in ("fp32", "bf16", "bf16_momentum", "nomomentum", "int8", "nomomentum_int8"):
        single, sharded = model(), _shard(model(), mesh)
        # the biases (66 and 96 elements, shards of 33 or 22 and 48 or 32) stay fp32: below min_8bit_numel
        one = BlockwiseAdamW(single.named_parameters(), lr=1e-2, state_format=fmt, min_8bit_numel=1000)
        opt = BlockwiseAdamW(sharded.named_parameters(), lr=1e-2, state_format=fmt, min_8bit_numel=1000)
        for step in range(10):
            gen = torch.Generator().manual_seed(step)
            for p, q in zip(single.parameters(), sharded.parameters()):
                scale = 10.0 ** torch.randint(-7, 2, p.shape[:1], generator=gen).float()
                g = torch.randn(p.shape, generator=gen) * scale.view(-1, *([1] * (p.dim() - 1)))
                p.grad, q.grad = g, distribute_tensor(g, q.device_mesh, q.placements)
            one.step()
            opt.step()
        assert opt.formats() == one.formats() and opt.formats()["0.weight"] == fmt
        for (name, p), q in zip(single.named_parameters(), _full(sharded)):
            assert torch.equal(p.detach(), q), (fmt, name, (p.detach() - q).abs().max().item())


def _full_export_moves_between_world_sizes(mesh, rank: int) -> None:  # type: ignore[no-untyped-def]
    """The whole fp32 state of a sharded int8 run (gathered on every rank) resumes in one process with
    the same formats and continues as the sharded run does (within int8's error); a fresh sharded run
    resumes from it to the bit. A rank holding no rows of a parameter counts its steps alike."""
    sharded = _shard(_model(), mesh)
    kwargs = dict(lr=1e-2, state_format="int8", min_8bit_numel=1000)
    opt = BlockwiseAdamW(sharded.named_parameters(), **kwargs)
    _train(sharded, opt, 10, rank)
    export = opt.to_adamw_state_dict()
    assert tuple(export["state"][0]["exp_avg"].shape) == (33, 48)  # the whole parameter's, on every rank
    single = _model()
    with torch.no_grad():
        for p, full in zip(single.parameters(), _full(sharded)):
            p.copy_(full)
    one = BlockwiseAdamW(single.named_parameters(), **kwargs)
    one.load_state_dict(export)
    assert one.formats() == opt.formats() and one.step_count("0.weight") == 10
    again = _shard(_model(), mesh)
    with torch.no_grad():
        for p, q in zip(again.parameters(), sharded.parameters()):
            p.to_local().copy_(q.to_local())
    resumed = BlockwiseAdamW(again.named_parameters(), **kwargs)
    resumed.load_state_dict(export)
    for name, p in sharded.named_parameters():
        mine = opt.param_state(name)
        if mine.exp_avg.numel() == 0:  # a rank with no rows of this parameter
            continue
        for loaded in (resumed.param_state(name), one.param_state(name)):
            part = this_rank(loaded.exp_avg, p) if loaded.exp_avg.shape != mine.exp_avg.shape else loaded.exp_avg
            scale = mine.exp_avg.abs().max().item() + 1e-12
            assert (part - mine.exp_avg).abs().max().item() <= 0.02 * scale, name  # int8 re-encoded
    _train(sharded, opt, 5, rank)
    _train(again, resumed, 5, rank)
    _train(single, one, 5, None)
    for (name, a), b, c in zip(sharded.named_parameters(), again.parameters(), single.parameters()):
        whole_a, whole_b = a.full_tensor(), b.full_tensor()  # collectives: every rank, every parameter
        assert torch.equal(whole_a, whole_b), name  # the same world size resumes to the bit
        assert (whole_a - c.detach()).abs().max().item() <= 0.1 * 5 * 1e-2, name


def _nonfinite_is_skipped_on_every_rank(mesh, rank: int) -> None:  # type: ignore[no-untyped-def]
    """A NaN in one rank's rows of a gradient skips that parameter on both ranks (counted there), and
    only that parameter: the shards and their step counts stay in step."""
    model = _shard(_model(), mesh)
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-2, state_format="int8", min_8bit_numel=0)
    _train(model, opt, 2, rank)
    before = _full(model)
    x, y = _batch(2, rank)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    if rank == 1:
        model[0].weight.grad.to_local()[0, 0] = float("nan")  # rank 1's rows only
    with pytest.warns(RuntimeWarning, match="non-finite gradient for '0.weight'"):
        opt.step()
    after = _full(model)
    assert torch.equal(after[0], before[0]) and not torch.equal(after[2], before[2])
    assert opt.nonfinite_counts["0.weight"] == 1 and opt.step_count("0.weight") == 2
    assert opt.step_count("2.weight") == 3
    counts = [None] * WORLD
    dist.all_gather_object(counts, {n: opt.step_count(n) for n in opt.named_params})
    assert counts[0] == counts[1]
    # the sharded gradients' finiteness is read once per step (across the ranks), not again by the step
    from lightning_baoc.optim import stepping

    reads: list[int] = []
    checks: list[bool] = []
    real_mask, real_compiled = opt._stepper.finite_mask, stepping.compiled_step
    opt._stepper.finite_mask = lambda params: (reads.append(len(params)), real_mask(params))[1]  # type: ignore[method-assign]
    stepping.compiled_step = lambda *args: (checks.append(args[-1]), real_compiled(*args))[1]
    try:
        _train(model, opt, 1, rank)
    finally:
        del opt._stepper.finite_mask
        stepping.compiled_step = real_compiled
    assert sum(reads) == len(list(model.parameters())) and not any(checks)


def this_rank(whole: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    from lightning_baoc.optim.sharding import this_shard

    return this_shard(whole, p)


def _refusals(mesh) -> None:  # type: ignore[no-untyped-def]
    from torch.distributed.tensor import Shard, distribute_tensor

    columns = nn.Parameter(distribute_tensor(torch.randn(8, 6), mesh, [Shard(1)]))
    with pytest.raises(ValueError, match=r"placed \(Shard\(dim=1\),\).*Shard this parameter on dim 0"):
        BlockwiseAdamW([("columns", columns)])
    # export_adamw_state_dict of a sharded optimizer's dict said "'baoc' should be a dict, got NoneType"
    model = _shard(_model(), mesh)
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-2, state_format="int8", min_8bit_numel=0)
    _train(model, opt, 1, mesh.get_local_rank())
    with pytest.raises(CheckpointError, match=r"distributed layout of a sharded optimizer.*to_adamw_state_dict\(\) on every rank"):
        export_adamw_state_dict(opt.state_dict())
    whole = opt.to_adamw_state_dict()  # what the message names works
    assert len(whole["state"]) == len(list(model.parameters()))


@pytest.mark.slow  # two ranks; FSDP2 is held by default by tests/optim/test_routes_sharded.py
def test_blockwise_adamw_under_fsdp2_on_two_ranks() -> None:
    on_gloo_ranks(_worker, WORLD)


#: One format of each kind: 8-bit with and without momentum, factored (its rows split), bf16; fp32 elsewhere.
_MIXED = {"0.weight": "int8", "2.weight": "int8_factored", "4.weight": "bf16", "2.bias": "bf16_momentum",
          "0.bias": "nomomentum_int8"}


def _mixed_optimizer(model: nn.Module) -> BlockwiseAdamW:
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-2, weight_decay=0.1, state_format="fp32", min_8bit_numel=0)
    opt.set_formats(_MIXED)
    return opt


def _dcp_worker(rank: int, path: str) -> None:
    """Save through torch.distributed.checkpoint, resume in a fresh model and optimizer: bit-equal."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    model = _shard(_model(), mesh)
    opt = _mixed_optimizer(model)
    _train(model, opt, 6, rank)
    saved = get_optimizer_state_dict(model, opt)
    # every compact tensor of a sharded parameter is a DTensor, one row per rank; keyed by name
    entry = saved["state"]["0.weight"]
    assert entry["format"] == "int8" and type(entry["tensors"]["exp_avg"]).__name__ == "DTensor"
    assert entry["tensors"]["exp_avg"].shape[0] == WORLD and entry["shape"] == [33, 48]
    dcp.save({"model": get_model_state_dict(model), "optim": saved}, checkpoint_id=path)
    opt._codec.refusal_keys = False  # noqa: SLF001 - the layout of an earlier release: no plain AdamW keys
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path + "_earlier")
    opt._codec.refusal_keys = True  # noqa: SLF001
    _train(model, opt, 6, rank, start=6)  # the uninterrupted run goes on
    expected = opt._local_state_dict()  # noqa: SLF001

    fresh = _shard(_model(), mesh)
    with torch.no_grad():
        for p in fresh.parameters():
            p.mul_(0.5)  # not the saved weights: the load must bring them
    from lightning_baoc.optim.checkpoint.distributed import saved_formats

    resumed = BlockwiseAdamW(fresh.named_parameters(), lr=1e-2, weight_decay=0.1, min_8bit_numel=0)
    resumed.set_formats(saved_formats(path, "optim"))  # the template of the load follows them
    assert resumed.formats() == opt.formats() and resumed.step_count("0.weight") == 0
    target = {"model": get_model_state_dict(fresh), "optim": get_optimizer_state_dict(fresh, resumed)}
    dcp.load(target, checkpoint_id=path)
    set_model_state_dict(fresh, target["model"])
    set_optimizer_state_dict(fresh, resumed, target["optim"])
    assert resumed.formats() == opt.formats() and resumed.step_count("0.weight") == 6
    _train(fresh, resumed, 6, rank, start=6)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), name  # to the bit, on every rank
    got = resumed._local_state_dict()  # noqa: SLF001
    for name, entry in expected["state"].items():
        for key, t in entry["tensors"].items():
            assert torch.equal(t, got["state"][name]["tensors"][key]), (name, key)
        assert got["state"][name]["steps"] == entry["steps"] == 12
    # resumed by a plain AdamW (without BAOC) it is refused at load naming BAOC and the fix (before: DCP's
    # "Missing key in checkpoint state_dict: optim.state.0.weight.exp_avg")
    plain_model = _shard(_model(), mesh)
    plain = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    plain_target = {"optim": get_optimizer_state_dict(plain_model, plain)}
    dcp.load(plain_target, checkpoint_id=path)
    with pytest.raises(ValueError, match=r"BlockwiseAdamW \(BAOC\).*export_adamw_state_dict"):
        set_optimizer_state_dict(plain_model, plain, plain_target["optim"])
    # a checkpoint of the earlier layout resumes: check_saved_shards lays the template out as it was saved
    from lightning_baoc.integrations.checkpoints import check_saved_shards

    earlier_model = _shard(_model(), mesh)
    earlier = _mixed_optimizer(earlier_model)
    earlier.set_formats(saved_formats(path + "_earlier", "optim"))
    check_saved_shards(path + "_earlier", [earlier], "BAOC under ModelParallelStrategy")
    earlier_target = {"optim": get_optimizer_state_dict(earlier_model, earlier)}
    dcp.load(earlier_target, checkpoint_id=path + "_earlier")
    set_optimizer_state_dict(earlier_model, earlier, earlier_target["optim"])
    assert earlier.step_count("0.weight") == 6 and earlier.formats() == opt.formats()
    check_saved_shards(path, [earlier], "BAOC under ModelParallelStrategy")  # this release's layout: the keys again
    assert earlier._codec.refusal_keys  # noqa: SLF001
    # a saved dict kept in memory loads too (keyed by position, as state_dict() returns it)
    again = _mixed_optimizer(_shard(_model(), mesh))
    again.load_state_dict(resumed.state_dict())
    assert again._local_state_dict()["state"]["0.weight"]["tensors"]["exp_avg"].equal(  # noqa: SLF001
        got["state"]["0.weight"]["tensors"]["exp_avg"])
    # a damaged shared field is caught by the layout's checksum, the optimizer left as it was
    bad = resumed.state_dict()
    next(iter(bad["state"].values()))["steps"] = 99
    with pytest.raises(CheckpointError, match="checksum of its formats, counts and param groups"):
        again.load_state_dict(bad)
    # another world size is refused, naming the way (to_adamw_state_dict)
    from lightning_baoc.optim.checkpoint.distributed import _local_row

    with pytest.raises(CheckpointError, match=r"saved by 2 shards, this run has 4.*to_adamw_state_dict"):
        _local_row(saved["state"]["0.weight"]["tensors"]["exp_avg"], 1, "x", 4)


def _factored_worker(rank: int) -> None:
    """The factored formats over shards split by rows follow one process within float summation order:
    stepped, converted into and out of, with a shard of one row (3 rows on 2 ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    _momentum_recreated_alike(rank)

    mesh = init_device_mesh("cpu", (WORLD,))

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(48, 33), nn.Tanh(), nn.Linear(33, 64), nn.Tanh(), nn.Linear(64, 3))

    single, sharded = model(), _shard(model(), mesh)
    assert sharded[4].weight.to_local().shape[0] == (2 if rank == 0 else 1)
    # fp32, then factored (converted from fp32), then out of it (factored -> fp32 expands over the
    # whole row mean) and into int8_factored
    plan = [({}, 4), ({"0.weight": "factored", "2.weight": "factored", "4.weight": "factored"}, 12),
            ({"0.weight": "int8_factored", "2.weight": "fp32", "4.weight": "nomomentum"}, 8)]
    opts = [BlockwiseAdamW(m.named_parameters(), lr=1e-2, weight_decay=0.1, min_8bit_numel=0) for m in (single, sharded)]
    start = 0
    for formats, steps in plan:
        before = [p.detach().clone() for p in single.parameters()]
        for m, opt, r in ((single, opts[0], None), (sharded, opts[1], rank)):
            opt.set_formats(formats)  # a conversion: collective for a factored shard, on every rank at once
            _train(m, opt, steps, r, start=start)
        start += steps
        if formats:
            assert opts[1].formats() == opts[0].formats()
            assert {opts[1].formats()[n] for n in formats} == set(formats.values())
        quantized = any("int8" in f for f in opts[0].formats().values())
        for (name, p), a, b in zip(single.named_parameters(), _full(sharded), before):
            diff = (a - p.detach()).abs().max().item()
            if quantized:
                # 8-bit codes: a last-bit difference of the sums (another order) can move a code by one
                assert diff <= 0.05 * (p.detach() - b).abs().max().item(), (formats, name, diff)
            else:
                assert diff <= 1e-6, (formats, name, diff)  # measured at most 1e-7 after the factored phase
        if opts[0].formats()["2.weight"] == "factored":
            # each rank's rows of the row statistics, every column's statistics (the same on each rank)
            one, two = opts[0].param_state("2.weight"), opts[1].param_state("2.weight")
            rows = sharded[2].weight.to_local().shape[0]
            assert two.row.shape == (rows,) and two.col.shape == (33,)
            offset = 0 if rank == 0 else 32
            assert torch.allclose(two.row, one.row[offset : offset + rows], rtol=1e-5)
            assert torch.allclose(two.col, one.col, rtol=1e-5)
            # the whole v expands over the whole parameter's row mean (dense_v of a shard: a collective)
            assert torch.allclose(two.dense_v(), one.dense_v()[offset : offset + rows], rtol=1e-5)
            whole, single_export = opts[1].to_adamw_state_dict(), opts[0].to_adamw_state_dict()
            index = [n for n, _ in single.named_parameters()].index("2.weight")
            assert torch.allclose(whole["state"][index]["exp_avg_sq"], single_export["state"][index]["exp_avg_sq"], rtol=1e-5)


def _three_ranks_worker(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    _one_and_two_ranks_agree(init_device_mesh("cpu", (3,)))


@pytest.mark.slow  # 3 processes on the 2 cores of CI: about 10 s
def test_another_sharding_gives_the_same_weights_to_the_bit() -> None:
    """Three ranks (another place for every shard boundary) end as one process does, as two do."""
    on_gloo_ranks(_three_ranks_worker, 3)


def _momentum_recreated_alike(rank: int) -> None:
    """A momentum re-created at a conversion comes from the gradient on every shard or on none: a NaN
    in one rank's rows leaves every rank's momentum zero, with the same bias-correction count."""
    from torch.distributed.device_mesh import init_device_mesh

    model = _shard(_model(), init_device_mesh("cpu", (WORLD,)))
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-2, state_format="nomomentum", min_8bit_numel=0)
    _train(model, opt, 3, rank)
    weight = model[2].weight
    if rank == 1:
        weight.grad.to_local()[0, 0] = float("nan")
    opt.set_formats({"2.weight": "int8"})  # from no momentum: re-created from the gradient, if finite
    counts: list[int | None] = [None] * WORLD
    dist.all_gather_object(counts, opt.momentum_step_count("2.weight"))
    assert counts == [0, 0]
    assert opt.param_state("2.weight").exp_avg.abs().max().item() == 0.0
    opt.set_formats({"2.weight": "nomomentum"})
    weight.grad.to_local().nan_to_num_(0.0)
    opt.set_formats({"2.weight": "int8"})  # a finite gradient everywhere: one EMA step of it on every rank
    dist.all_gather_object(counts, opt.momentum_step_count("2.weight"))
    assert counts == [1, 1]


@pytest.mark.slow  # two ranks; the factored formats over FSDP2 shards are held by default by tests/optim/test_routes_sharded.py
def test_factored_formats_over_shards_split_by_rows_follow_one_process() -> None:
    on_gloo_ranks(_factored_worker, WORLD)


@pytest.mark.slow  # two ranks; sharded state dicts are held by default by tests/optim/test_routes_sharded.py
def test_a_sharded_optimizer_resumes_to_the_bit_through_torch_distributed_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """... and resumed by 1 rank it is refused before the load: torch's loader failed inside (``Size mismatch between
    saved torch.Size([2, ...]) and current``, a ``CheckpointException`` that ``except Exception`` misses), the
    documented refusal never reached; the callback and ``BAOCStrategy`` check the shard count first
    (``check_saved_shards``), naming ``to_adamw_state_dict()``."""
    on_gloo_ranks(_dcp_worker, WORLD, str(tmp_path / "dcp"))
    on_gloo_ranks(_resume_on_another_world_size, 1, str(tmp_path / "dcp"), 1)


def _hsdp_worker(rank: int) -> None:
    """HSDP (2 replicas x 2 shards): fp32 BlockwiseAdamW equals torch's AdamW under the same wrapping."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ours, theirs = _shard(_model(), mesh), _shard(_model(), mesh)
    assert [type(p).__name__ for p in ours.parameters()][0] == "DTensor" and ours[0].weight.placements[1].is_shard(0)
    opt = BlockwiseAdamW(ours.named_parameters(), lr=1e-2, weight_decay=0.1, state_format="fp32")
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, weight_decay=0.1)
    _train(ours, opt, 30, rank % 2)
    _train(theirs, ref, 30, rank % 2)
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert (a.full_tensor() - b.full_tensor()).abs().max().item() <= 1e-6, name


@pytest.mark.slow  # 4 processes on the 2 cores of CI: about 15 s
def test_blockwise_adamw_under_hsdp_on_four_ranks() -> None:
    on_gloo_ranks(_hsdp_worker, 4)


def _resume_on_another_world_size(rank: int, path: str, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_baoc.integrations.checkpoints import check_saved_shards

    model = _shard(_model(), init_device_mesh("cpu", (world,)))
    opt = _mixed_optimizer(model)
    with pytest.raises(CheckpointError, match=rf"saved by 2 shards, and this run shards them {world} ways .*"
                                              r"optimizer.to_adamw_state_dict\(\)"):
        check_saved_shards(path, [opt], "BAOC under ModelParallelStrategy")
    assert opt.step_count("0.weight") == 0 and opt.formats()["0.weight"] == "int8"  # as it was
    check_saved_shards(path, [torch.optim.AdamW(nn.Linear(2, 2).parameters())], "x")  # nothing sharded: no check
