"""The captured step (``lightning_baoc/optim/graph_step.py``) against the planned one. On a GPU, real CUDA
graphs; on the CPU, the device's path through Triton's interpreter (``TRITON_INTERPRET=1``, set by
``tests/conftest.py``) and the graph through :class:`~lightning_baoc.optim.graph_step.TapeBackend`, which
records the step's calls at capture and replays them with the arguments recorded (a CUDA graph's semantics:
a host value read at capture stays what it was).

- 50 steps with skipped steps, a learning-rate schedule, a conversion mid-run and a resume: the same bits as
  the planned step, most steps replayed;
- what invalidates a captured step, each case: the step runs planned and is captured again;
- the host's work of a replayed step: the same number of Python calls and torch operations for 10 and for
  1,000 tensors.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections import Counter
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it before triton is imported
    pytest.skip("TRITON_INTERPRET=1 is not set", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (the CUDA step's optional kernels)")

import lightning_baoc.optim.stepping as stepping  # noqa: E402
from lightning_baoc import BlockwiseAdamW, kernels  # noqa: E402
from lightning_baoc.formats import quant  # noqa: E402
from lightning_baoc.optim import graph_step  # noqa: E402


@pytest.fixture(autouse=True)
def device_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU parameters take the device's path (the Triton kernels, torch's fused AdamW for fp32)."""
    if not ON_GPU:
        monkeypatch.setattr(kernels, "TRITON_DEVICES", {"cuda", "cpu"})
        monkeypatch.setattr(stepping, "kernel_serves", lambda *args: False)


class _CountedCuda(graph_step.CudaGraphs):
    def __init__(self) -> None:
        self.captures = 0

    def capture(self, body: Any, device: torch.device) -> Any:
        self.captures += 1
        return super().capture(body, device)


def _graphs(opt: BlockwiseAdamW, on: bool) -> Any:
    """The graphs of ``opt`` on (CUDA's on a GPU, else the tape) or off (the planned step, as it runs with graphs
    on: the fused kernel reading a tensor learning rate)."""
    backend = _CountedCuda() if ON_GPU else graph_step.TapeBackend()
    opt._stepper.graphs.backend_for = (lambda device: backend) if on else (lambda device: None)  # noqa: SLF001
    return backend


def _noise(shape: Any, gen: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * 1e-2).to(DEVICE, dtype)


def _model(seed: int = 0) -> list[tuple[str, nn.Parameter]]:
    gen = torch.Generator().manual_seed(seed)
    shapes = {"a": (37, 101), "b": (300,), "c": (64, 64), "d": (5,), "e": (2, 1024), "f": (3, 11)}
    named = [(name, nn.Parameter((torch.randn(shape, generator=gen) * 0.1).to(DEVICE))) for name, shape in shapes.items()]
    named.append(("h", nn.Parameter((torch.randn(20, 50, generator=gen) * 0.1).to(DEVICE, torch.bfloat16))))
    return named


def _optimizer(named: list[tuple[str, nn.Parameter]]) -> BlockwiseAdamW:
    opt = BlockwiseAdamW(named, lr=1e-2, weight_decay=0.1, state_format="int8", min_8bit_numel=0,
                         weight_correction="ecc8")
    opt.set_formats({"b": "fp32", "d": "fp32", "f": "bf16", "e": "fp32"})
    return opt


def _state(named: list[tuple[str, nn.Parameter]], opt: BlockwiseAdamW) -> list[torch.Tensor]:
    out = []
    for _, p in named:
        rec = opt._records[p]  # noqa: SLF001 - the state itself
        out += [p.detach().clone(), *(t.clone() for _, t in sorted(rec.views.items()))]
        if rec.master_correction is not None:
            out.append(rec.master_correction.clone())
    return out


def _fresh(graphs: bool, seed: int) -> tuple[list[tuple[str, nn.Parameter]], BlockwiseAdamW, Any, torch.Generator]:
    """The model and its optimizer with graphs on or off, each gradient a tensor kept (zeros), and the noise's
    generator."""
    named = _model()
    opt = _optimizer(named)
    backend = _graphs(opt, graphs)
    for _, p in named:
        p.grad = torch.zeros_like(p)
    return named, opt, backend, torch.Generator().manual_seed(seed)


def _run(graphs: bool, steps: int = 50) -> tuple[list[torch.Tensor], dict, dict, graph_step.GraphSteps, int]:
    """``steps`` steps of int8, bf16, fp32 and bf16-weight (ecc8) parameters, each gradient written into the
    one tensor it has (as backward accumulates into a kept gradient): non-finite gradients at steps 5 (an int8
    and an fp32 tensor) and 31 (the bf16 weight), a cosine learning rate, a conversion before step 20, a resume
    (a new optimizer loading the state dict) before step 30."""
    named = _model()
    params = dict(named)
    opt = _optimizer(named)
    tape = _graphs(opt, graphs)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    gen = torch.Generator().manual_seed(1)
    for _, p in named:
        p.grad = torch.zeros_like(p)
    captures = 0
    for step in range(1, steps + 1):
        if step == 20:
            opt.set_formats({"a": "bf16", "c": "fp32"})
        if step == 30:  # a resume: a new optimizer (and schedule) from the state dicts
            saved, saved_schedule = opt.state_dict(), schedule.state_dict()
            captures += tape.captures
            opt = _optimizer(named)
            tape = _graphs(opt, graphs)
            opt.load_state_dict(saved)
            schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
            schedule.load_state_dict(saved_schedule)
        for _, p in named:
            p.grad.copy_(_noise(p.shape, gen, p.dtype))
        if step == 5:
            params["a"].grad[3, 7] = float("nan")
            params["d"].grad[1] = float("inf")
        if step == 31:
            params["h"].grad[0, 0] = float("inf")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the skipped steps' warnings
            opt.step()
        schedule.step()
    counts = {rec.name: (rec.step, rec.m_step) for rec in opt._records.values()}  # noqa: SLF001
    return _state(named, opt), counts, opt.nonfinite_counts, opt._stepper.graphs, captures + tape.captures  # noqa: SLF001


@pytest.mark.slow  # 50 steps; the route matrix's graph route holds replay to the planned step by default
def test_the_captured_step_equals_the_planned_one_over_50_steps() -> None:
    captured, counts, skipped, graphs, captures = _run(True)
    planned, counts_p, skipped_p, unused, none = _run(False)
    assert none == 0 and unused.replays == 0
    assert skipped == skipped_p == {"a": 1, "d": 1, "h": 1}
    assert counts == counts_p
    assert counts["b"] == (50, 50) and counts["h"] == (49, 49) and counts["a"] == (49, 49)
    # captured at step 3, again after the conversion (step 22) and after the resume (step 32): the other steps replay
    assert captures == 3
    assert len(captured) == len(planned)
    for x, y in zip(captured, planned):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.slow  # long; the route matrix's graph route reads a schedule's lr by default (case lr-schedule)
def test_a_replayed_step_reads_the_learning_rate_of_each_step() -> None:
    """A learning rate set after capture moves the parameters as the planned step's does (a value recorded at
    capture would not)."""
    results = []
    for graphs in (True, False):
        named = _model()
        opt = _optimizer(named)
        tape = _graphs(opt, graphs)
        for _, p in named:
            p.grad = torch.full_like(p, 1e-2)
        for step in range(6):
            for group in opt.param_groups:
                group["lr"] = 1e-2 * (step + 1)
            opt.step()
        results.append((_state(named, opt), tape.captures))
    (captured, captures), (planned, _) = results
    assert captures == 1
    for x, y in zip(captured, planned):
        assert torch.equal(x, y)


Change = Callable[[list[tuple[str, nn.Parameter]], BlockwiseAdamW], None]


def _replace_grad(named: list, opt: BlockwiseAdamW) -> None:
    named[0][1].grad = named[0][1].grad.clone()  # a new address


def _drop_grad(named: list, opt: BlockwiseAdamW) -> None:
    named[1][1].grad = None


def _replace_data(named: list, opt: BlockwiseAdamW) -> None:
    named[2][1].data = named[2][1].data.clone()


def _convert(named: list, opt: BlockwiseAdamW) -> None:
    opt.set_formats({"a": "bf16"})


def _correct(named: list, opt: BlockwiseAdamW) -> None:
    opt.set_weight_corrections({"h": "ecc16"})


def _betas(named: list, opt: BlockwiseAdamW) -> None:
    opt.param_groups[0]["betas"] = (0.8, 0.99)


def _add_group(named: list, opt: BlockwiseAdamW) -> None:
    extra = nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(3)).to(DEVICE))
    extra.grad = torch.zeros_like(extra)
    named.append(("x", extra))
    opt.add_param_group({"params": [("x", extra)]})


def _load(named: list, opt: BlockwiseAdamW) -> None:
    opt.load_state_dict(opt.state_dict())


def _release(named: list, opt: BlockwiseAdamW) -> None:
    opt.release_gradients()


_CHANGES = [_replace_grad, _drop_grad, _replace_data, _convert, _correct, _betas, _add_group, _load, _release]


@pytest.mark.slow  # long; a plan rebuilt when its tensors change is held by default by tests/optim/test_device_plan.py
@pytest.mark.parametrize("change", _CHANGES)
def test_what_invalidates_a_captured_step(change: Change) -> None:
    """Each change after capture: the next step runs planned (the graph dropped), with the planned step's bits;
    a steady step after it is captured again (but under gradient release, which steps in backward)."""
    results = []
    for graphs in (True, False):
        named, opt, tape, gen = _fresh(graphs, 2)
        replays = []
        for step in range(8):
            if step == 4:
                change(named, opt)
            noise = []
            for _, p in named:
                r = _noise(p.shape, gen, p.dtype)
                if change is _release and step >= 4:
                    noise.append((p, r))
                elif p.grad is not None:
                    p.grad.copy_(r)
            if noise:  # release steps each parameter in backward (its gradient r), then step()
                for p, _ in noise:
                    p.grad = None
                sum((p.float() * r.float()).sum() for p, r in noise).backward()
            opt.step()
            replays.append(opt._stepper.graphs.replays)  # noqa: SLF001
        results.append((_state(named, opt), tape.captures, replays))
    (captured, captures, replays), (planned, _, _) = results
    assert replays[2] == 1 and replays[3] == 2  # captured at step 2 (the third), replayed at step 3
    assert replays[4] == 2  # the change: the planned step
    if change is _release:
        assert captures == 1 and replays[-1] == 2
    elif change is _add_group:  # the new parameter's first step makes its counts a row: the plans are built again
        assert captures == 2 and replays[-1] == 3  # steady at steps 5 and 6: captured at 7
    else:
        assert captures == 2 and replays[-1] == 4  # steady again at steps 4 and 5: captured at 6, replayed at 7
    for x, y in zip(captured, planned):
        assert torch.equal(x, y)


@pytest.mark.slow  # long; a step the graph cannot take is held by default in this file
def test_a_capture_that_fails_turns_graphs_off_with_one_warning() -> None:
    class Failing(graph_step.TapeBackend):  # what a capture's error looks like, on any device
        def capture(self, body: Any, device: torch.device) -> Any:
            raise RuntimeError("operation not permitted when stream is capturing")

    named = _model()
    opt = _optimizer(named)
    opt._stepper.graphs.backend_for = lambda device: Failing()  # noqa: SLF001
    for _, p in named:
        p.grad = torch.full_like(p, 1e-3)
    with pytest.warns(RuntimeWarning, match="the CUDA graph step is off: capture failed .RuntimeError: operation not"):
        for _ in range(4):
            opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            opt.step()
    assert opt._stepper.graphs.replays == 0 and not opt._stepper.graphs.on  # noqa: SLF001
    assert opt.step_count("a") == 7


@pytest.mark.slow  # long; what invalidates a capture is held by the cases below
def test_gradients_that_move_at_every_step_turn_graphs_off() -> None:
    named = _model()
    opt = _optimizer(named)
    tape = _graphs(opt, True)
    kept = []  # the old gradients, held: a new one never takes an old one's memory
    with pytest.warns(RuntimeWarning, match="gradients change address from step to step"):
        for step in range(40):
            for _, p in named:
                # three steps at one address, then another: captured at each third step, replayed once
                if step % 3 == 0:
                    kept.append(p.grad)
                    p.grad = torch.full_like(p, 1e-3)
            opt.step()
    assert tape.captures == graph_step.MAX_RECAPTURES
    assert opt.step_count("a") == 40


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def _host_work(n: int) -> tuple[int, int]:
    """Python calls and torch operations of one replayed step of ``n`` tensors (the graph's replay aside:
    on a GPU it is one call)."""
    gen = torch.Generator().manual_seed(0)
    named = [(f"w{i}", nn.Parameter(torch.randn(64, generator=gen).to(DEVICE))) for i in range(n)]
    opt = BlockwiseAdamW(named, lr=1e-3, state_format="fp32")
    _graphs(opt, True)
    for _, p in named:
        p.grad = torch.full_like(p, 1e-3)
    for _ in range(3):  # two steady steps, then the capture and its first replay
        opt.step()
    graphs = opt._stepper.graphs  # noqa: SLF001
    assert graphs.current is not None and graphs.current.graph is not None
    graphs.current.graph.replay = lambda: None  # the graph's own work: one launch on a GPU
    calls: Counter[str] = Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            calls[event] += 1

    opt.step()  # a replay first: anything done once per process (imports, caches) done
    quant._step_key.cache_clear()  # the step's part of the rounding keys, computed (not remembered) in both
    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    quant._step_key.cache_clear()
    ops = _Ops()  # apart: the mode's own Python runs for each operation
    with ops:
        opt.step()
    assert graphs.replays == 4  # captured at the third step, replayed there and at the next three
    return sum(calls.values()), ops.count


def test_a_replayed_steps_host_work_does_not_grow_with_the_number_of_tensors() -> None:
    small, ops_small = _host_work(10)
    large, ops_large = _host_work(1000)
    # torch's own profiling marks around Optimizer.step, and no other torch operation: the graph holds them all
    assert ops_small == ops_large <= 2
    assert small == large  # the same Python calls for 10 and 1,000 tensors
    assert small < 600


@pytest.mark.slow  # long; the planned step is held by default by the route matrix's device route
def test_cuda_graphs_off_runs_the_planned_step() -> None:
    named = _model()
    opt = _optimizer(named)
    tape = _graphs(opt, True)
    for _, p in named:
        p.grad = torch.full_like(p, 1e-3)
    for _ in range(4):
        opt.step()
    assert opt.cuda_graphs and opt._stepper.graphs.replays == 2  # noqa: SLF001
    opt.cuda_graphs = False
    for _ in range(4):
        opt.step()
    assert not opt.cuda_graphs and opt._stepper.graphs.replays == 2 and tape.captures == 1  # noqa: SLF001
    with pytest.raises(TypeError, match="cuda_graphs must be True or False"):
        opt.cuda_graphs = "yes"  # type: ignore[assignment]
    opt.cuda_graphs = True
    for _ in range(3):
        opt.step()
    assert tape.captures == 2 and opt._stepper.graphs.replays == 3  # noqa: SLF001
    assert opt.step_count("a") == 11


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA: the replay's synchronisations are CUDA's")
def test_a_replayed_step_makes_no_host_synchronisation() -> None:
    """Replayed steps (one with a NaN) under CUDA's sync-debug mode: any synchronising call raises."""
    named = _model()
    opt = _optimizer(named)
    _graphs(opt, True)
    for _, p in named:
        p.grad = torch.full_like(p, 1e-3)
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                if step == 1:
                    named[0][1].grad[0, 0] = float("nan")
                opt.step()
                named[0][1].grad.fill_(1e-3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt._stepper.graphs.replays == 4  # noqa: SLF001
    assert opt.nonfinite_counts == {"a": 1}
    assert any("non-finite gradient for 'a'" in str(w.message) for w in caught)  # at the step after the NaN's


@pytest.mark.skipif(not ON_GPU, reason="needs CUDA: the caching allocator's gradient addresses are CUDA's")
def test_a_lightning_run_replays_its_captured_step(tmp_path: Any) -> None:
    """Lightning's loop (gradients set to None after each step, clipped by norm in place) on a GPU: backward puts
    the gradients at the same addresses from step to step, so the step is captured once and replayed."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 4))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> Any:
            opt = BlockwiseAdamW(self.named_parameters(), lr=1e-3, state_format="int8", min_8bit_numel=0)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))}

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(40 * 16, 32, generator=gen), torch.randint(0, 4, (40 * 16,), generator=gen))
    module = Net()
    trainer = L.Trainer(accelerator="gpu", devices=1, max_steps=40, gradient_clip_val=1.0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(module, DataLoader(data, batch_size=16))
    graphs = trainer.optimizers[0]._stepper.graphs  # noqa: SLF001
    assert graphs.off_reason is None
    assert graphs.captures <= 3 and graphs.replays >= 25, (graphs.captures, graphs.replays)


@pytest.mark.slow  # the route matrix's amp and resume cases replay factored formats by default
def test_the_factored_formats_replay_as_planned() -> None:
    """``factored`` and ``int8_factored`` tensors (a bf16 weight with its ecc8 correction among them) in the graph:
    their vectors and factors recorded too (kernels/triton_factored.py), the same bits as the planned step over
    12 steps with a NaN and a learning-rate schedule."""
    def run(graphs: bool) -> tuple[list[torch.Tensor], dict, int]:
        gen = torch.Generator().manual_seed(0)
        shapes = {"a": (37, 101), "b": (64, 64), "c": (130, 20), "d": (300,)}
        named = [(n, nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(DEVICE))) for n, s in shapes.items()]
        named.append(("h", nn.Parameter((torch.randn(20, 50, generator=gen) * 0.1).to(DEVICE, torch.bfloat16))))
        opt = BlockwiseAdamW(named, lr=1e-2, weight_decay=0.1, state_format="factored", min_8bit_numel=0,
                             weight_correction="ecc8")
        opt.set_formats({"b": "int8_factored", "d": "bf16"})
        backend = _graphs(opt, graphs)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12)
        for _, p in named:
            p.grad = torch.zeros_like(p)
        for step in range(12):
            for _, p in named:
                p.grad.copy_(_noise(p.shape, gen, p.dtype))
            if step == 6:
                named[2][1].grad[5, 5] = float("nan")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                opt.step()
            schedule.step()
        return _state(named, opt), opt.nonfinite_counts, backend.captures

    captured, skipped, captures = run(True)
    planned, skipped_p, _ = run(False)
    assert captures == 1 and skipped == skipped_p == {"c": 1}
    for x, y in zip(captured, planned):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.slow  # long; the route matrix's graph route holds clipping with accumulation under -m slow, replay by default
def test_gradients_clipped_in_place_feed_the_captured_step() -> None:
    """``torch.nn.utils.clip_grad_norm_`` before each step (Lightning's ``gradient_clip_val``) writes the gradients in
    place: the graph reads the clipped ones, the same bits as the planned step."""
    results = []
    for graphs in (True, False):
        named, opt, backend, gen = _fresh(graphs, 4)
        for _ in range(8):
            for _, p in named:
                p.grad.copy_(_noise(p.shape, gen, p.dtype) * 50)
            torch.nn.utils.clip_grad_norm_([p for _, p in named], max_norm=0.1)
            opt.step()
        results.append((_state(named, opt), backend.captures, opt._stepper.graphs.replays))  # noqa: SLF001
    (captured, captures, replays), (planned, _, _) = results
    assert captures == 1 and replays == 6
    for x, y in zip(captured, planned):
        assert torch.equal(x, y)


def test_a_step_the_graph_cannot_take_says_why_once() -> None:
    """A parameter the device's kernels do not take (here a gradient of another layout: a transposed view) keeps the
    steps out of the graph: said once, naming it, after two such steps; the steps run planned."""
    named = _model()
    opt = _optimizer(named)
    tape = _graphs(opt, True)
    for name, p in named:
        p.grad = torch.full_like(p, 1e-3) if name != "c" else torch.full_like(p, 1e-3).t().contiguous().t()
    with pytest.warns(RuntimeWarning, match=r"does not capture this optimizer's steps: 'c' \(int8\) step outside"):
        for _ in range(3):
            opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            opt.step()
    assert tape.captures == 0 and opt.step_count("a") == 6


@pytest.mark.slow  # long; a step the graph cannot take is held by default in this file
def test_parameters_another_part_of_the_optimizer_steps_keep_the_graph_off_and_are_named() -> None:
    """``offload`` states under an offload schedule are stepped apart from the dispatcher: the graph is never
    captured (it would not step them), and they are named once, after two such steps."""
    named = _model()
    opt = BlockwiseAdamW(named, lr=1e-2, state_format="int8", min_8bit_numel=0, offload_schedule="host")
    opt.set_formats({"c": "offload"})
    tape = _graphs(opt, True)
    for _, p in named:
        p.grad = torch.full_like(p, 1e-3)
    with pytest.warns(RuntimeWarning, match=r"does not capture this optimizer's steps: 'c' \(offload\) step outside"):
        for _ in range(3):
            opt.step()
    for _ in range(3):
        opt.step()
    assert tape.captures == 0 and opt.step_count("c") == opt.step_count("a") == 6
