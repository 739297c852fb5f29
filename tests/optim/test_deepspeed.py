"""The blockwise optimizers as DeepSpeed's client optimizer (ZeRO 0-3) on the CPU, gloo, 1 and 2 ranks.

Every rank trains on the same batch, so the gradient DeepSpeed averages over the ranks is the one
process's bit for bit ((g + g) / 2 == g in floats) and the optimizers can be compared exactly: each
rank runs the one-process optimizer beside DeepSpeed's engine and compares the weights and every
fragment's state with the matching slice of the reference's. The model's sizes put partition edges
mid-row and mid-8-bit-group: ZeRO 1/2 on 2 ranks splits ``0.weight`` (16 x 37 = 592 elements) at
element 410 (inside a group of 32 and a row of 16); ZeRO-3 splits every parameter in halves (296 =
9 groups and 8 elements).
"""

from __future__ import annotations

import os

import pytest
import torch
from support_distributed import needs_gloo, on_gloo_ranks

pytest.importorskip("deepspeed")

STEPS = 4


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 37), torch.nn.Tanh(), torch.nn.Linear(37, 40), torch.nn.Tanh(),
                               torch.nn.Linear(40, 5))


def _config(stage: int, offload: bool = False) -> dict:
    zero: dict = {"stage": stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "zero_optimization": zero,
            "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
            "steps_per_print": 10**9}


def _deepspeed_env(rank: int, world: int) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(8, 16, generator=g) for _ in range(STEPS)]


def _full_params(engine, stage: int) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {n: p.detach().clone() for n, p in params.items()}
    return {n: p.detach().clone() for n, p in params.items()}


def _storage_bytes(opt) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in opt.state_tensors()}
    return sum(storages.values())


def _parity(rank: int, world: int, stage: int, fmt: str, offload: bool) -> None:
    _deepspeed_env(rank, world)
    import deepspeed

    from lightning_baoc import BlockwiseAdamW
    from lightning_baoc.optim.deepspeed import zero_client

    reference_model = _model()
    reference = (torch.optim.AdamW(reference_model.parameters(), lr=1e-2) if fmt == "torch" else
                 BlockwiseAdamW(reference_model.named_parameters(), lr=1e-2, state_format=fmt, min_8bit_numel=0))
    model = _model()
    client = zero_client(BlockwiseAdamW(model.named_parameters(), lr=1e-2, state_format="fp32" if fmt == "torch" else fmt,
                                        min_8bit_numel=0))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=_config(stage, offload),
                                           dist_init_required=False)
    client.bind()
    if fmt == "int8_factored" and world > 1:
        # ZeRO-3 halves every parameter: 2.weight (40 x 37) in whole rows keeps its factored form, 0.weight
        # (37 x 16, cut mid-row) takes the format's 1-D fallback; the reference holds the same formats
        assert client.formats()["2.weight"] == "int8_factored" and client.formats()["0.weight"] == "int8"
        reference.set_formats(client.formats())
    for x in _batches():
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        reference.zero_grad()
        reference_model(x).square().mean().backward()
        reference.step()
    got, want = _full_params(engine, stage), dict(reference_model.named_parameters())
    if fmt == "torch":
        worst = max((got[n] - want[n]).abs().max().item() for n in want)
        assert worst <= 1e-6, f"stage {stage}: fp32 differs from torch AdamW by {worst}"
        return
    # a factored second moment sums its column statistics over the ranks: equal within float summation order
    tolerance = 1e-6 if "factored" in fmt else 0.0
    for name in want:
        worst = (got[name] - want[name].detach()).abs().max().item()
        assert worst <= tolerance, f"stage {stage} {fmt}: {name} differs by {worst}"
    fmap = client.fragment_map
    split = 0
    for f in fmap.fragments:
        assert client.formats()[f.name] == reference.formats()[f.name]
        ours, theirs = client.param_state(f.name), reference.param_state(f.name)
        if not f.numel:
            continue
        split += f.numel < want[f.name].numel()
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = getattr(ours, key), getattr(theirs, key)
            if b is None:
                assert a is None
                continue
            if a is None:  # a factored second moment: its row and column statistics
                a, b = ours.dense_v(), theirs.dense_v()
            piece = b.reshape(-1)[f.offset : f.offset + f.numel]
            assert torch.allclose(a.reshape(-1), piece, rtol=tolerance, atol=0.0), f"stage {stage} {fmt}: {f.name} {key}"
    if world > 1:
        assert split >= 1  # some parameter is split across the ranks
        if stage in (1, 2):
            cut = next(f for f in fmap.fragments if 0 < f.numel < want[f.name].numel())
            edge = cut.offset + cut.numel if cut.offset == 0 else cut.offset
            assert edge % 32 != 0  # the split falls inside an 8-bit group
    assert client.state_bytes() == _storage_bytes(client.inner)


def _cases(rank: int, world: int, cases: list[tuple[int, str]]) -> None:
    for stage, fmt in cases:
        _parity(rank, world, stage, fmt, False)


@needs_gloo
def test_zero_1_2_3_on_two_ranks() -> None:
    """fp32 under ZeRO-1 equals torch AdamW; int8 under ZeRO-2 and ZeRO-3 (partitions cutting 8-bit
    groups) equals one process's BlockwiseAdamW bit for bit; state bytes equal the storage."""
    on_gloo_ranks(_cases, 2, 2, [(1, "torch"), (2, "int8"), (3, "int8")])


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("stage", [2, 3])
def test_fp32_equals_torch_adamw(stage: int) -> None:
    on_gloo_ranks(_parity, 2, 2, stage, "torch", False)


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize(("stage", "fmt"), [(1, "int8"), (2, "bf16"), (3, "bf16_momentum"), (2, "nomomentum_int8"),
                                            (3, "int8_factored")])
def test_formats_bit_equal_to_one_process_on_two_ranks(stage: int, fmt: str) -> None:
    on_gloo_ranks(_parity, 2, 2, stage, fmt, False)


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("stage", [2, 3])
def test_int8_bit_equal_on_one_rank(stage: int) -> None:
    on_gloo_ranks(_parity, 1, 1, stage, "int8", False)


def _train(engine, batches: list[torch.Tensor]) -> None:
    for x in batches:
        engine.backward(engine(x).square().mean())
        engine.step()


def _engine(stage: int, fmt: str, plain: bool = False):
    """A DeepSpeed engine over a BlockwiseAdamW wrapped by ``zero_client``, or handed as it is (``plain``)."""
    import deepspeed

    from lightning_baoc import BlockwiseAdamW
    from lightning_baoc.optim.deepspeed import zero_client

    model = _model()
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-2, state_format=fmt, min_8bit_numel=0)
    client = opt if plain else zero_client(opt)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=_config(stage), dist_init_required=False)
    return engine, client


def _resume(rank: int, world: int, stage: int, fmt: str, directory: str) -> None:
    """Train 2 steps, save through DeepSpeed, train 2 more; a fresh engine loads the save and trains the
    same 2 steps: the weights and every state tensor are bit-equal, the formats kept."""
    _deepspeed_env(rank, world)
    batches = _batches()
    engine, client = _engine(stage, fmt)
    _train(engine, batches[:2])
    engine.save_checkpoint(directory, tag="ckpt")
    _train(engine, batches[2:])
    want, want_states = _full_params(engine, stage), [t.clone() for t in client.inner.state_tensors()]
    export = client.to_adamw_state_dict()

    engine, client = _engine(stage, fmt)
    engine.load_checkpoint(directory, tag="ckpt")
    assert set(client.formats().values()) == {fmt}
    _train(engine, batches[2:])
    got = _full_params(engine, stage)
    for name in want:
        assert torch.equal(got[name], want[name]), f"stage {stage}: {name} differs after resume"
    states = client.inner.state_tensors()
    assert len(states) == len(want_states) and all(torch.equal(a, b) for a, b in zip(states, want_states))
    assert all(s.dtype == w.dtype for s, w in zip(states, want_states))  # int8 codes came back int8

    # the export holds the whole parameters' fp32 moments, and loads into a plain torch AdamW
    model = _model()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plain.load_state_dict(export)
    names = [n for n, _ in model.named_parameters()]
    for i, p in enumerate(model.parameters()):
        assert plain.state[p]["exp_avg"].shape == p.shape, names[i]
    torch.save({"export": export, "client": client.state_dict()}, os.path.join(directory, f"export{rank}.pt"))


def _load_elsewhere(rank: int, world: int, stage: int, fmt: str, directory: str) -> None:
    """A per-fragment save of 2 ranks refused at 1 rank, naming the export; the export loads instead and
    holds the same moments the 2 ranks held."""
    _deepspeed_env(rank, world)
    from lightning_baoc.optim import CheckpointError

    engine, client = _engine(stage, fmt)
    with pytest.raises(Exception, match="world size of 2"):  # DeepSpeed's own refusal comes first
        engine.load_checkpoint(directory, tag="ckpt")
    saved = torch.load(os.path.join(directory, "export0.pt"), weights_only=True)
    with pytest.raises(CheckpointError, match="to_adamw_state_dict"):  # the client's, where DeepSpeed lets it through
        client.load_state_dict(saved["client"])
    export = saved["export"]
    client.load_adamw_state_dict(export)
    again = client.to_adamw_state_dict()
    assert sorted(again["state"]) == sorted(export["state"])  # every parameter's moments and step came across
    for i, entry in export["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(again["state"][i][key], entry[key]) if fmt == "fp32" else torch.allclose(
                again["state"][i][key], entry[key], rtol=0.1, atol=1e-6)


@pytest.mark.slow  # two ranks; ZeRO is held by default by test_zero_1_2_3_on_two_ranks
@needs_gloo
def test_resume_through_deepspeed_checkpoints_and_another_rank_count(tmp_path) -> None:
    on_gloo_ranks(_resume, 2, 2, 3, "int8", str(tmp_path))
    on_gloo_ranks(_load_elsewhere, 1, 1, 3, "int8", str(tmp_path))


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize(("stage", "fmt"), [(2, "int8"), (1, "bf16"), (3, "fp32")])
def test_resume_bit_equal(tmp_path, stage: int, fmt: str) -> None:
    on_gloo_ranks(_resume, 2, 2, stage, fmt, str(tmp_path))
    on_gloo_ranks(_load_elsewhere, 1, 1, stage, fmt, str(tmp_path))


def _momentum_parity(rank: int, world: int, stage: int, rule: str) -> None:
    """BlockwiseSGD (momentum) and BlockwiseLion in int8 under ZeRO equal one process's bit for bit."""
    _deepspeed_env(rank, world)
    import deepspeed

    from lightning_baoc import BlockwiseLion, BlockwiseSGD
    from lightning_baoc.optim.deepspeed import zero_client

    def build(model: torch.nn.Module):
        if rule == "sgd":
            return BlockwiseSGD(model.named_parameters(), lr=1e-2, momentum=0.9, state_format="int8", min_8bit_numel=0)
        return BlockwiseLion(model.named_parameters(), lr=1e-3, state_format="int8", min_8bit_numel=0)

    reference_model, model = _model(), _model()
    reference, client = build(reference_model), zero_client(build(model))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=_config(stage), dist_init_required=False)
    for x in _batches():
        engine.backward(engine(x).square().mean())
        engine.step()
        reference.zero_grad()
        reference_model(x).square().mean().backward()
        reference.step()
    got, want = _full_params(engine, stage), dict(reference_model.named_parameters())
    for name in want:
        assert torch.equal(got[name], want[name].detach()), f"{rule} stage {stage}: {name} differs"
    assert set(client.formats().values()) == {"int8"}
    assert client.state_bytes() == _storage_bytes(client.inner)


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize(("stage", "rule"), [(2, "sgd"), (3, "lion")])
def test_sgd_and_lion_bit_equal_on_two_ranks(stage: int, rule: str) -> None:
    on_gloo_ranks(_momentum_parity, 2, 2, stage, rule)


def test_an_unsupported_deepspeed_release_is_refused_by_name() -> None:
    from lightning_baoc.optim.deepspeed import SUPPORTED_DEEPSPEED, check_deepspeed_version

    check_deepspeed_version("0.19.8")
    with pytest.raises(RuntimeError, match=rf"DeepSpeed 0.18.2 is not supported.*>={SUPPORTED_DEEPSPEED[0]},<{SUPPORTED_DEEPSPEED[1]}"):
        check_deepspeed_version("0.18.2")


def test_zero_client_takes_a_blockwise_optimizer_without_state() -> None:
    from lightning_baoc import BlockwiseAdamW
    from lightning_baoc.optim.deepspeed import zero_client

    model = _model()
    with pytest.raises(TypeError, match="BlockwiseAdamW.from_optimizer"):
        zero_client(torch.optim.AdamW(model.parameters()))
    opt = BlockwiseAdamW(model.named_parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    with pytest.raises(ValueError, match="holds state already"):
        zero_client(opt)
    client = zero_client(BlockwiseAdamW(model.named_parameters()))
    with pytest.raises(RuntimeError, match="after deepspeed.initialize"):
        client.state_bytes()


def _conversion_parity(rank: int, world: int, stage: int) -> None:
    """Live conversions of the fragments (fp32 -> int8 -> bf16 -> int8 mid-training, the 8-bit edges of
    split groups exchanged) equal one process's conversions bit for bit."""
    _deepspeed_env(rank, world)
    import deepspeed

    from lightning_baoc import BlockwiseAdamW
    from lightning_baoc.optim.deepspeed import zero_client

    reference_model, model = _model(), _model()
    reference = BlockwiseAdamW(reference_model.named_parameters(), lr=1e-2, min_8bit_numel=0)
    client = zero_client(BlockwiseAdamW(model.named_parameters(), lr=1e-2, min_8bit_numel=0))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=_config(stage), dist_init_required=False)
    plan = {1: {"0": "int8"}, 2: {"2": "bf16", "0": "bf16_momentum"}, 3: {"0": "int8", "2": "int8"}}
    for step, x in enumerate(_batches()):
        for opt in (client, reference):
            if step in plan:
                opt.set_formats(plan[step])
        engine.backward(engine(x).square().mean())
        engine.step()
        reference.zero_grad()
        reference_model(x).square().mean().backward()
        reference.step()
    got, want = _full_params(engine, stage), dict(reference_model.named_parameters())
    assert client.formats() == reference.formats()
    for name in want:
        assert torch.equal(got[name], want[name].detach()), f"stage {stage}: {name} differs after conversions"
    assert client.state_bytes() == _storage_bytes(client.inner)


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("stage", [2, 3])
def test_live_conversions_bit_equal_on_two_ranks(stage: int) -> None:
    on_gloo_ranks(_conversion_parity, 2, 2, stage)


# ---------------------------------------------------------------------------- handed to deepspeed.initialize as it is


def _blockwise(rule: str, model: torch.nn.Module):
    """A blockwise optimizer of ``rule`` in int8 over two param groups (the weights decayed, the biases not):
    ZeRO 1/2 step each group through a one-group list of it."""
    from lightning_baoc import BlockwiseAdamW, BlockwiseLion, BlockwiseSGD

    groups = [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")]},
              {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
    kwargs = {"state_format": "int8", "min_8bit_numel": 0, "param_names": model}
    if rule == "adamw":
        return BlockwiseAdamW(groups, lr=1e-2, **kwargs)
    if rule == "sgd":
        return BlockwiseSGD(groups, lr=1e-2, momentum=0.9, weight_decay=1e-2, **kwargs)
    return BlockwiseLion(groups, lr=1e-3, **kwargs)


def _plain_parity(rank: int, world: int, cases: list[tuple[int, str]]) -> None:
    """A blockwise optimizer handed to deepspeed.initialize as it is trains bit-equal to ``zero_client`` of
    the same (weights, every state tensor, formats, state bytes), through a ``set_formats`` mid-run; it
    becomes that client at its first use: ``zero_client(opt)`` is then the client it became."""
    _deepspeed_env(rank, world)
    import deepspeed

    from lightning_baoc.optim.deepspeed import ZeroClient, zero_client

    for stage, rule in cases:
        wrapped_model, plain_model = _model(), _model()
        wrapped, plain = zero_client(_blockwise(rule, wrapped_model)), _blockwise(rule, plain_model)
        engines = [deepspeed.initialize(model=m, optimizer=o, config=_config(stage), dist_init_required=False)[0]
                   for m, o in ((wrapped_model, wrapped), (plain_model, plain))]
        assert engines[1].basic_optimizer is plain  # nothing in between: DeepSpeed holds the optimizer itself
        for step, x in enumerate(_batches()):
            if step == 2:  # a conversion of live state, split 8-bit groups in it on two ranks
                plan = {"2": "bf16", "0.bias": "fp32"}
                assert plain.set_formats(plan) == wrapped.set_formats(plan) != {}
            for engine in engines:
                _train(engine, [x])
        got, want = _full_params(engines[1], stage), _full_params(engines[0], stage)
        for name in want:
            assert torch.equal(got[name], want[name]), f"{rule} stage {stage}: {name} differs from zero_client's"
        became = zero_client(plain)
        assert isinstance(became, ZeroClient) and became is not wrapped and zero_client(plain) is became
        assert plain.formats() == wrapped.formats() and plain.formats()["2.weight"] == "bf16"
        ours, theirs = became.inner.state_tensors(), wrapped.inner.state_tensors()
        assert len(ours) == len(theirs) > 0
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(ours, theirs))
        assert plain.state_bytes() == wrapped.state_bytes() == _storage_bytes(became.inner) > 0
        assert plain.state_bytes(by_group=True) == wrapped.state_bytes(by_group=True)
        for name in ("0.weight", "2.bias"):  # this rank's fragment of the momentum (empty where it holds none)
            a, b = plain.param_state(name).exp_avg, wrapped.param_state(name).exp_avg
            assert torch.equal(a, b), f"{rule} stage {stage}: {name}'s momentum"
        assert plain.state_dict()["baoc_deepspeed"]["map"] == wrapped.state_dict()["baoc_deepspeed"]["map"]


@pytest.mark.slow  # two ranks; ZeRO is held by default by test_zero_1_2_3_on_two_ranks
@needs_gloo
def test_an_optimizer_handed_to_deepspeed_as_it_is_equals_zero_client_on_two_ranks() -> None:
    """ZeRO-2 (DeepSpeed steps each of the two groups through a one-group list; a partition cuts 0.weight
    inside an 8-bit group), BlockwiseAdamW in int8; ZeRO-3 in the checkpoint test and the slow ones."""
    on_gloo_ranks(_plain_parity, 2, 2, [(2, "adamw")])


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("world", [1, 2])
def test_every_stage_and_rule_handed_as_it_is_equals_zero_client(world: int) -> None:
    on_gloo_ranks(_plain_parity, world, world,
                  [(1, "adamw"), (2, "adamw"), (3, "adamw"), (2, "sgd"), (3, "sgd"), (1, "lion"), (3, "lion")])


def _plain_resume(rank: int, world: int, stage: int, directory: str) -> None:
    """Saved through DeepSpeed from an optimizer handed as it is, loaded by a fresh one and by a
    ``zero_client`` (before their first step): the same 2 steps after it are bit-equal, int8 kept int8."""
    _deepspeed_env(rank, world)
    from lightning_baoc.optim.deepspeed import zero_client

    batches = _batches()
    engine, opt = _engine(stage, "int8", plain=True)
    _train(engine, batches[:2])
    engine.save_checkpoint(directory, tag="plain")
    _train(engine, batches[2:])
    want, want_states = _full_params(engine, stage), [t.clone() for t in zero_client(opt).inner.state_tensors()]
    for plain in (True, False):
        engine, opt = _engine(stage, "int8", plain=plain)
        engine.load_checkpoint(directory, tag="plain")
        assert set(opt.formats().values()) == {"int8"}
        _train(engine, batches[2:])
        got, states = _full_params(engine, stage), zero_client(opt).inner.state_tensors()
        for name in want:
            assert torch.equal(got[name], want[name]), f"stage {stage} (plain={plain}): {name} differs after resume"
        assert len(states) == len(want_states)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(states, want_states))


@pytest.mark.slow  # two ranks; ZeRO is held by default by test_zero_1_2_3_on_two_ranks
@needs_gloo
def test_checkpoints_of_an_optimizer_handed_as_it_is_resume_bit_equal(tmp_path) -> None:
    on_gloo_ranks(_plain_resume, 1, 1, 3, str(tmp_path))


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("stage", [1, 2])
def test_checkpoints_handed_as_it_is_at_other_stages(tmp_path, stage: int) -> None:
    on_gloo_ranks(_plain_resume, 1, 1, stage, str(tmp_path))


def _refused_when_handed(rank: int, world: int) -> None:
    """What cannot become the client is refused at its first use, naming the fix: an optimizer that
    stepped before deepspeed.initialize, one releasing its gradients."""
    _deepspeed_env(rank, world)
    import deepspeed

    from lightning_baoc import BlockwiseAdamW

    x = _batches()[0]
    model = _model()
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-2)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=_config(2), dist_init_required=False)
    engine.backward(engine(x).square().mean())
    with pytest.raises(RuntimeError, match=r"stepped before it.*zero_client\(BlockwiseAdamW\(\.\.\.\)\)"):
        engine.step()
    with pytest.raises(RuntimeError, match="stepped before it"):
        opt.state_bytes()

    model = _model()
    opt = BlockwiseAdamW(model.named_parameters(), lr=1e-2)
    opt.release_gradients()
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=_config(2), dist_init_required=False)
    with pytest.raises(ValueError, match=r"release_gradients\(False\)"):
        engine.backward(engine(x).square().mean())


@pytest.mark.slow  # two ranks; ZeRO is held by default by test_zero_1_2_3_on_two_ranks
@needs_gloo
def test_what_cannot_become_the_client_is_refused_naming_the_fix() -> None:
    on_gloo_ranks(_refused_when_handed, 1, 1)


def test_an_optimizer_not_handed_to_deepspeed_answers_as_itself() -> None:
    """Param groups edited without DeepSpeed (no ZeRO partitioning on the parameters) are no client's: the
    optimizer's own checks speak, as before."""
    from lightning_baoc import BlockwiseAdamW
    from lightning_baoc.optim.deepspeed import ZeroClient, zero_client

    model = _model()
    opt = BlockwiseAdamW(model[0].named_parameters())
    opt.param_groups[0]["params"].append(model[2].weight)
    assert opt.state_bytes() == 0 and list(opt.formats()) == ["weight", "bias"]
    released = BlockwiseAdamW(model.named_parameters())
    released.release_gradients()
    with pytest.raises(ValueError, match=r"release_gradients\(False\)"):
        zero_client(released)
    assert isinstance(zero_client(BlockwiseAdamW(model.named_parameters())), ZeroClient)
