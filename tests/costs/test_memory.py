"""``lightning_baoc.training_memory``: what training holds, from storages, and the allocation record's copy.

- bf16 weights with an ``ecc8`` correction and int8 states: 2 + 1 + 2 bytes per parameter and the
  optimizer's own ``state_bytes()``; gradients freed count nothing; tied weights count once.
- torch AdamW: its state's storages (8 bytes per fp32 parameter).
- A BAOC allocation's record carries the same figures (``training_memory``), valid under the schema,
  and its table's caption says the bytes per parameter.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_baoc import BlockwiseAdamW, training_memory
from lightning_baoc.control.controller import BAOCController
from lightning_baoc.report.allocation import allocation_table, build_record, validate_record


def test_bf16_weights_with_a_correction_and_int8_states() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)).to(torch.bfloat16)
    opt = BlockwiseAdamW(model.named_parameters(), state_format="int8", weight_correction="ecc8")
    model(torch.randn(4, 256, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    m = training_memory(model, opt)
    n = 2 * (256 * 256 + 256)
    assert m.params == n
    assert (m.weights, m.corrections, m.gradients) == (2 * n, n, 2 * n)
    assert m.states == opt.state_bytes() and 2.0 < m.per_param("states") < 2.5  # int8 (biases stay fp32)
    assert m.total == m.weights + m.corrections + m.gradients + m.states
    opt.zero_grad(set_to_none=True)
    assert training_memory(model, opt).gradients == 0


def test_torch_adamw_and_tied_weights() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(100, 32)
    head = nn.Linear(32, 100, bias=False)
    head.weight = emb.weight  # tied: one storage
    model = nn.Sequential(emb, head)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 100, (4,))).sum().backward()
    opt.step()
    m = training_memory(model, opt)
    assert m.params == 3200 and m.weights == 4 * 3200 and m.gradients == 4 * 3200
    assert m.states == 8 * 3200 and m.per_param() == 16.0


def test_the_allocation_record_carries_the_training_memory() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 8))
    ctl = BAOCController(memory_budget=0.4, warmup_steps=12, sample_every=2, calibration="prior")
    opt = ctl.install(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
    event = None
    for step in range(14):
        opt.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        ctl.before_step(step)
        ctl.observe(step)
        opt.step()
        event = ctl.maybe_allocate(step + 1) or event
    assert event is not None and event.training_memory is not None
    record = build_record(event)
    validate_record(record)
    assert record["training_memory"] == training_memory(model, opt).to_dict()
    assert "bytes per parameter" in str(allocation_table(record).caption)
