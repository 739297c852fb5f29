"""The offloaded update's performance model and simulator (``lightning_baoc.optim.offload_model``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_baoc.optim.offload_model import (
    PROFILES,
    STATE_BYTES,
    Subgroup,
    calibrated,
    choose,
    every_kth,
    hardware,
    host_only,
    predict,
    simulate,
    spread,
    subgroups,
)

SUBGROUP = 16 << 20  # elements of a default subgroup (64 MiB of fp32 parameters)


def test_tensors_pack_into_subgroups_of_the_size_asked() -> None:
    groups = subgroups([10, 30, 5], subgroup_bytes=4 * 16)
    assert [g.numel for g in groups] == [16, 16, 13]
    assert sum(g.numel for g in subgroups([SUBGROUP * 3 + 7])) == SUBGROUP * 3 + 7
    with pytest.raises(ValueError, match="subgroup_bytes"):
        subgroups([4], subgroup_bytes=2)


def test_one_subgroup_s_paths_take_their_chain_of_transfers_and_update() -> None:
    hw = calibrated(hardware("h100-pcie5"), latency=0.0)
    g = [Subgroup(SUBGROUP, grad_bytes=2, weight_bytes=2)]
    host = simulate(g, [False], hw).seconds
    # the host path: the bf16 gradient down (the host keeps a copy of the weight), the CPU's update, the weight up
    assert host == pytest.approx(2 * SUBGROUP / hw.d2h + SUBGROUP / hw.cpu_adam + 2 * SUBGROUP / hw.h2d)
    copied = simulate([Subgroup(SUBGROUP, 2, 2, weight_down=True)], [False], hw).seconds  # no host copy: the weight too
    assert copied == pytest.approx(4 * SUBGROUP / hw.d2h + SUBGROUP / hw.cpu_adam + 2 * SUBGROUP / hw.h2d)
    device = simulate(g, [True], hw).seconds
    assert device == pytest.approx(STATE_BYTES * SUBGROUP / hw.h2d + SUBGROUP / hw.gpu_adam + STATE_BYTES * SUBGROUP / hw.d2h)


def test_host_only_pipelines_the_transfers_under_the_cpu() -> None:
    """Many subgroups: the copies of one overlap the CPU's update of another, so the phase is the CPU's time plus
    one subgroup's copies (each resource's busy time is within the phase: no resource runs two tasks at once)."""
    hw = hardware("h100-sxm")
    groups = subgroups([SUBGROUP * 40])
    s = host_only(groups, hw)
    cpu = sum(g.numel for g in groups) / hw.cpu_adam
    assert cpu <= s.seconds <= cpu * 1.03
    assert all(busy <= s.seconds * (1 + 1e-9) for busy in s.busy.values()), s.busy


def test_a_single_copy_engine_serializes_both_directions() -> None:
    hw = hardware("a100-pcie4")
    groups = subgroups([SUBGROUP * 12])
    duplex = simulate(groups, [True] * 12, hw).seconds
    simplex = simulate(groups, [True] * 12, replace(hw, duplex=False)).seconds
    assert simplex > 1.8 * duplex


def test_interleaving_beats_host_only_and_respects_every_resource() -> None:
    """The chosen schedule is shorter than host-only and never shorter than any resource's own work (a lower bound)."""
    hw = hardware("h100-pcie5")
    groups = subgroups([SUBGROUP * 60])
    best = choose(groups, hw)
    assert 0 < best.device_share < 1
    assert best.seconds < 0.6 * host_only(groups, hw).seconds
    assert all(busy <= best.seconds * (1 + 1e-9) for busy in best.busy.values()), best.busy


def test_very_fast_pcie_puts_the_updates_on_the_gpu() -> None:
    hw = calibrated(hardware("h100-sxm"), h2d=1e14, d2h=1e14)
    groups = subgroups([SUBGROUP * 30])
    assert choose(groups, hw).device_share >= 0.9  # the CPU still takes a few beside the GPU
    slow_cpu = calibrated(hw, cpu_adam=1e6)
    assert choose(groups, slow_cpu).on_device == [True] * 30


def test_no_free_gpu_memory_keeps_every_update_on_the_host() -> None:
    hw = hardware("h100-pcie5")
    groups = subgroups([SUBGROUP * 20])
    best = choose(groups, hw, free_memory=0)
    assert best.on_device == [False] * 20
    assert best.seconds == host_only(groups, hw).seconds
    # room for the double buffer of one subgroup's states: the device path opens
    assert choose(groups, hw, free_memory=2 * STATE_BYTES * SUBGROUP).device_share > 0


def test_the_paper_s_setting_updates_at_least_twice_as_fast_as_host_only() -> None:
    """Deep Optimizer States' setting: mixed precision on an H100 (bf16 gradients and weights on the GPU, the
    fp32 master and moments of every parameter on the host: a 20B model), the update phase after backward:
    interleaved at most half of host-only (the paper: updates up to 3x faster than static offload). Its device
    path moves DeepSpeed's fp32 master with the moments: 12 bytes per element each way."""
    hw = hardware("h100-sxm")
    p = predict([20_000_000_000], hw, grad_bytes=2, weight_bytes=2, state_bytes=12)
    assert p.interleaved <= 0.5 * p.host, p


def test_profiles_are_named_and_a_bad_name_is_refused() -> None:
    assert {"h100-sxm", "h100-pcie5", "a100-pcie4", "h200"} <= set(PROFILES)
    with pytest.raises(ValueError, match="Unknown hardware profile 'tpu'; allowed"):
        hardware("tpu")
    with pytest.raises(ValueError, match="expected a positive rate"):
        calibrated(hardware("h200"), h2d=0.0)
    assert every_kth(5, 2) == [True, False, True, False, True]
    assert spread(6, 2) == [False, False, True, False, False, True]  # every third
    assert all(sum(spread(n, m)) == m for n in (1, 7, 64, 100) for m in range(n + 1))
