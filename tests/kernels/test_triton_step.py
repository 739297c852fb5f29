"""The Triton step of the element-wise formats (``lightning_baoc/kernels/triton_step.py``) against the
eager step, its reference, run through Triton's interpreter on the CPU (``TRITON_INTERPRET=1``): every
format the kernels serve, every shape class (ragged sizes, sizes under one 1024-element super-block,
1-D, exact super-blocks), after 1 and after 50 steps, and the options (maximize, Adam's L2 decay,
several tensors in one step, 16-bit weights and their corrections, parameters the kernels do not
serve). The kernel computes the eager step's fp32 operations in its order, so the element-wise formats'
parameters, codes, scales and exponents are bit-equal; the factored formats' row and column sums are
ordered otherwise, and agree within a few fp32 ulps.

On a machine with CUDA the same comparison runs on the GPU (``tests/integrations/test_cuda.py``), and
this module is skipped: Triton chooses its interpreter when it is imported (``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` first, where torch sees no GPU).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

if torch.cuda.is_available():  # pragma: no cover - the GPU runs the kernels compiled
    pytest.skip("CUDA present: tests/integrations/test_cuda.py runs the kernels on the GPU", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py sets it before triton is imported
    pytest.skip("TRITON_INTERPRET=1 is not set", allow_module_level=True)
triton = pytest.importorskip("triton", reason="triton is not installed (the CUDA step's optional kernels)")

import support_formats as H  # noqa: E402
from support import lone_fp32_steps, ragged_shapes, record_grids, record_launches  # noqa: E402

import lightning_baoc.optim.stepping as stepping  # noqa: E402
from lightning_baoc import FORMATS, BlockwiseAdamW, kernels  # noqa: E402
from lightning_baoc.kernels import triton_common, triton_step  # noqa: E402

SERVED = [name for name, fmt in FORMATS.items() if fmt.kernel_kinds in triton_step.SERVED]
SHAPES = [(37, 101), (3, 11), (1000,), (2, 1024)]


@pytest.fixture
def triton_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """CPU parameters take the Triton step (not the compiled C++ one); the launches are counted."""
    monkeypatch.setattr(kernels, "TRITON_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(stepping, "kernel_serves", lambda *args: False)
    return record_launches(monkeypatch)


def _assert_bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), (x.dtype, (x.double() - y.double()).abs().max().item())


def _assert_close(fmt: str, a: list[torch.Tensor], b: list[torch.Tensor], shapes: list[tuple[int, ...]]) -> None:
    """The Triton step's tensors against the eager step's, within the format's bounds (its registry entry)."""
    H.assert_agree(fmt, "triton", a, b, shapes)


def _assert_fp32_close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    """fp32 tensors within 1e-6 of each other's largest value (torch's fused AdamW against the Triton
    kernel's, which orders a few operations otherwise: an ulp of each update, several only where values
    cancel to near zero; measured 6.7e-8, moments equal); the step counts equal."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.shape == y.shape
        if x.dtype != torch.float32:
            assert torch.equal(x, y)
        elif x.numel():
            assert float((x - y).abs().max()) <= 1e-6 * float(y.abs().max())


# every format runs through the Triton kernels, their launches counted, in tests/formats/test_backends.py; these 41
# ragged tensors in one launch take 9 to 17 s per format in Triton's interpreter on the 2-core machine
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int8", "bf16_momentum", "int8_factored"])
def test_many_tensors_take_one_launch(fmt: str, triton_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """41 tensors of sizes from 1 to 3000 elements (an empty one among them) in one launch per step:
    each program finds its tensor in the table (a binary search of the tensors' first super-blocks);
    the result equals the eager step's, one NaN gradient skipped by its own tensor's flag alone."""
    grids = record_grids(monkeypatch, triton_step, "_adamw_tensors")
    shapes = ragged_shapes()

    def run(policy: str) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        opt = BlockwiseAdamW([(f"w{i}", p) for i, p in enumerate(params)], lr=1e-2, state_format=fmt,
                             min_8bit_numel=0, kernels=policy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the NaN's warning
            for i in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                if i == 1:
                    params[17].grad.view(-1)[-1] = float("nan")
                opt.step()
            assert opt.nonfinite_counts == {"w17": 1}
        return [t.clone() for p in params for t in [p.detach(), *H.state_of(opt, p)]]

    _assert_close(fmt, run("auto"), run("eager"), shapes)
    factored = FORMATS[fmt].factored  # its 1-D tensors take their own launch (another second-moment kind)
    assert len(grids) == 3 * (2 if factored else 1)
    numel = sum(-(-int(torch.Size(s).numel()) // 1024) for s in shapes)
    assert sum(grids) == 3 * numel  # one program per super-block of every tensor


@pytest.mark.parametrize(
    "options", [{}, pytest.param({"weight_decay": 0.1, "decoupled_weight_decay": False}, marks=pytest.mark.slow),
                pytest.param({"maximize": True, "weight_decay": 0.1}, marks=pytest.mark.slow)],
    ids=["adamw", "adam-l2", "maximize"],  # the options: slow here, held by default by test_triton_step_options
)
def test_fp32_tensors_take_one_fused_call_and_each_skips_alone(
    options: dict, triton_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """fp32 states decided on the device: torch's fused AdamW (or Adam, for L2 decay) once per step over all
    41 tensors (the flag of any non-finite gradient as its ``found_inf``), then one Triton launch that steps
    the finite ones where the fused call skipped them all, and does nothing at the other steps: the eager
    step within fp32 rounding (bit-equal but at the step with the NaN), the NaN's tensor untouched at its step."""
    calls: list[int] = []
    name = "_fused_adam_" if options.get("decoupled_weight_decay") is False else "_fused_adamw_"
    real = getattr(torch, name)
    monkeypatch.setattr(torch, name, lambda *a, **k: (calls.append(len(a[0])), real(*a, **k))[1])
    grids = record_grids(monkeypatch, triton_step, "_adamw_tensors")
    shapes = ragged_shapes()

    def run(policy: str, nan: bool) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
        opt = BlockwiseAdamW([(f"w{i}", p) for i, p in enumerate(params)], lr=1e-2, state_format="fp32", kernels=policy,
                             **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the NaN's warning
            for i in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                if nan and i == 1:
                    params[17].grad.view(-1)[-1] = float("nan")
                before = params[17].detach().clone()
                opt.step()
                if nan and i == 1:
                    assert torch.equal(params[17].detach(), before)
            assert opt.nonfinite_counts == ({"w17": 1} if nan else {})
        return [t.clone() for p in params for t in [p.detach(), *(v for _, v in sorted(opt._records[p].views.items()))]]

    served = sum(1 for s in shapes if torch.Size(s).numel())
    for nan in (False, True):
        eager = run("eager", nan)
        calls.clear()
        decided = run("auto", nan)
        assert calls == [served] * 3 and len(grids) == 3  # one fused call and one Triton launch per step
        grids.clear()
        if nan:
            _assert_fp32_close(decided, eager)
        else:  # no skip: the fused call stepped them all, the Triton launch did nothing
            _assert_bit_equal(decided, eager)


def test_a_lone_fp32_tensor_takes_its_own_flag_without_a_triton_launch(triton_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """One fp32 tensor decided on the device (as gradient release steps them, one at a time): torch's fused
    call with the tensor's own flag as its ``found_inf`` and no Triton launch; bit-equal to the eager step,
    the step with a NaN skipped."""
    calls: list[int] = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: (calls.append(len(a[0])), real(*a, **k))[1])

    cpu = torch.device("cpu")
    eager = lone_fp32_steps(cpu, "eager")
    calls.clear()
    decided = lone_fp32_steps(cpu, "auto")
    assert calls == [1, 1, 1] and triton_on_cpu == []  # a fused call per step, skipped by its own flag at the NaN
    _assert_bit_equal(decided, eager)


@pytest.mark.parametrize(
    "options", [{"maximize": True}, {"weight_decay": 0.1, "decoupled_weight_decay": False}, {"betas": (0.4, 0.99)}],
    ids=["maximize", "adam-l2", "large-momentum-weight"],
)
@pytest.mark.parametrize("fmt", ["int8", pytest.param("int8_factored", marks=pytest.mark.slow)])  # int8 by default
def test_triton_step_options(fmt: str, options: dict, triton_on_cpu: list[int]) -> None:
    shapes = [(37, 101), (64, 33)]
    _assert_close(fmt, H.run(fmt, "triton", shapes, 2, **options), H.run(fmt, "eager", shapes, 2, **options), shapes)
    assert triton_on_cpu == [2, 2]


def test_items_the_kernel_does_not_serve_take_the_eager_step(triton_on_cpu: list[int]) -> None:
    """A non-contiguous gradient goes to the eager step, beside a bf16 and an fp32 parameter served."""
    gen = torch.Generator().manual_seed(0)

    def run(policy: str) -> list[torch.Tensor]:
        a = nn.Parameter(torch.randn(40, 40, generator=gen.manual_seed(0)))
        b = nn.Parameter(torch.randn(40, 40, generator=gen).to(torch.bfloat16))
        c = nn.Parameter(torch.randn(300, generator=gen))
        opt = BlockwiseAdamW([("a", a), ("b", b), ("c", c)], state_format="int8", min_8bit_numel=0, kernels=policy)
        for _ in range(2):
            a.grad = torch.randn(40, 40, generator=gen).t()
            b.grad = torch.randn(40, 40, generator=gen).to(torch.bfloat16)
            c.grad = torch.randn(300, generator=gen)
            opt.step()
        return [a.detach().clone(), b.detach().float(), c.detach().clone()]

    _assert_bit_equal(run("auto"), run("eager"))
    assert triton_on_cpu == [1, 1, 1, 1]  # b and c took the kernel: a launch per weight dtype, per step


#: Every 16-bit case: the default run takes each format with ecc8 and ecc16 in bf16 and ecc8 in fp16;
#: the rest (no correction, which the other tests' bf16 parameters cover too) with ``-m slow``.
SIXTEEN_BIT = [
    pytest.param(fmt, dtype, correction, marks=() if correction != "none" and (dtype == torch.bfloat16 or correction == "ecc8")
                 else pytest.mark.slow, id=f"{fmt}-{str(dtype)[6:]}-{correction}")
    for fmt in ("int8", "bf16", "nomomentum_int8", "fp32", "factored")
    for dtype in (torch.bfloat16, torch.float16)
    for correction in ("none", "ecc8", "ecc16")
]


@pytest.mark.parametrize(("fmt", "dtype", "correction"), SIXTEEN_BIT)
def test_16_bit_weights_and_their_corrections(fmt: str, dtype: torch.dtype, correction: str, triton_on_cpu: list[int]) -> None:
    """bf16 and fp16 parameters (and gradients) with each master-weight correction: the kernel rebuilds
    the fp32 master, steps it and splits it again, bit-equal to the eager step's weight and correction.
    The fp32 format's eager step is torch's foreach order, not the kernel's (which is the compiled CPU
    step's, to the bit), and the factored format sums its means in another order: their masters and
    moments agree to fp32 rounding, within 1e-6 of their norm."""
    masters: list[dict[str, torch.Tensor]] = []

    def run(policy: str) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(dtype)) for s in [(20, 50), (300,)]]
        opt = BlockwiseAdamW([(f"w{i}", p) for i, p in enumerate(params)], lr=1e-3, state_format=fmt, min_8bit_numel=0,
                             kernels=policy, weight_correction=correction)
        for _ in range(3):
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(dtype)
            opt.step()
        masters.append(opt.master_weights())
        return [t for p in params for t in [p.detach().clone(), *H.state_of(opt, p)]]

    served, eager = run("auto"), run("eager")
    assert sum(triton_on_cpu) == 2 * 3  # every parameter, every step (a 1-D one in its fallback format)
    if fmt not in ("fp32", "factored"):
        _assert_close(fmt, served, eager, [(20, 50), (300,)])
        return
    # the masters differ in their last fp32 bits: the corrections, which hold those bits, differ there too
    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).norm() / b.double().norm())

    for name, master in masters[0].items():
        assert relative(master, masters[1][name]) <= 1e-6, name
    for a, b in zip(served, eager):
        if a.dtype == torch.float32:  # the moments
            assert relative(a, b) <= 1e-6


@pytest.mark.parametrize("fmt", ["int8", "bf16", "int8_factored", "fp32"])
def test_a_non_finite_gradient_is_skipped_on_the_device(fmt: str, triton_on_cpu: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels read each parameter's finiteness flag themselves (the host reads no gradient to
    launch them): a parameter whose gradient holds inf or NaN keeps its value and state, the others
    step, and its counts, the skip counted and the warning (at the next step, or when a count is
    read) come out as the eager step's, which reads the flags on the host."""
    host_reads: list[int] = []
    real_mask = stepping.StepDispatcher.finite_mask
    monkeypatch.setattr(stepping.StepDispatcher, "finite_mask", lambda self, params: (host_reads.append(len(params)), real_mask(self, params))[1])

    def run(policy: str) -> tuple[list[torch.Tensor], dict[str, int], list[int], int]:
        gen = torch.Generator().manual_seed(0)
        params = [nn.Parameter(torch.randn(s, generator=gen)) for s in [(37, 101), (64, 33)]]
        opt = BlockwiseAdamW([("a", params[0]), ("b", params[1])], lr=1e-2, state_format=fmt, min_8bit_numel=0,
                             kernels=policy)
        with pytest.warns(RuntimeWarning, match="non-finite gradient for 'a'"):
            for i in range(4):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen)
                if i in (1, 2):
                    params[0].grad[3, 5] = float("nan") if i == 1 else float("inf")
                opt.step()
            counts = opt.nonfinite_counts  # a read applies the last step's device skips
        recs = [opt._records[p] for p in params]  # noqa: SLF001 - the counts themselves
        state = [t.clone() for p in params for t in [p.detach(), *H.state_of(opt, p)]]
        return state, counts, [r.step for r in recs] + [r.m_step for r in recs], sum(host_reads)

    served = run("auto")
    assert served[3] == 0  # no gradient's finiteness read on the host
    eager = run("eager")
    assert eager[3] == 2 * 4
    assert served[1] == eager[1] == {"a": 2}
    assert served[2] == eager[2] == [2, 4, 2, 4]
    if fmt == "fp32":  # the steps with a skip took the Triton kernel's AdamW, not torch's fused one
        _assert_fp32_close(served[0], eager[0])
    else:
        _assert_close(fmt, served[0], eager[0], [(37, 101), (64, 33)])
    # fp32: torch's fused kernel (one call, skipped whole by the flag of any), then the Triton kernel
    # for the finite ones, which does nothing at a step without a skip
    assert sum(triton_on_cpu) == 8


def test_offloaded_states_take_the_hosts_decision(triton_on_cpu: list[int]) -> None:
    """States on another device than their parameter (offload's host memory) are not decided on the
    parameter's device: their update runs on copies that carry no flag, so the host decides it."""
    from lightning_baoc.optim.pools import Record

    gen = torch.Generator().manual_seed(0)
    p = nn.Parameter(torch.randn(40, 40, generator=gen))
    opt = BlockwiseAdamW([("w", p)], state_format="fp32", kernels="auto")
    p.grad = torch.randn(40, 40, generator=gen)
    opt.step()
    rec: Record = opt._records[p]  # noqa: SLF001 - the step's decision itself
    assert opt._stepper.decided_on_device(p, rec, opt._hyper(opt.param_groups[0]), {})  # noqa: SLF001
    rec.views = {k: v.to("meta") for k, v in rec.views.items()}  # states on another device than the parameter
    assert not opt._stepper.decided_on_device(p, rec, opt._hyper(opt.param_groups[0]), {})  # noqa: SLF001


def test_without_triton_the_policy_is_checked_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton missing: ``kernels="compiled"`` refuses at construction, naming it and the fix; ``"auto"``
    warns once there and steps eagerly; ``"eager"`` says nothing."""
    monkeypatch.setattr(kernels, "TRITON_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(kernels, "_ANNOUNCED", set())
    monkeypatch.setattr(triton_common, "triton_status", lambda: (False, "triton is not installed (No module named 'triton')"))
    p = nn.Parameter(torch.randn(8, 8))
    with pytest.raises(RuntimeError, match="Triton kernels .* not available: triton is not installed.*Install triton"):
        BlockwiseAdamW([("w", p)], state_format="int8", kernels="compiled")
    with pytest.warns(RuntimeWarning, match="Triton step kernels are not available"):
        opt = BlockwiseAdamW([("w", p)], state_format="int8", min_8bit_numel=0, kernels="auto")
    p.grad = torch.randn(8, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # warned once already
        BlockwiseAdamW([("w", p)], state_format="int8", kernels="eager").step()
    assert opt._records[p].step == 1  # noqa: SLF001


def test_a_copy_after_a_step_decided_on_the_device_has_its_skip_applied(triton_on_cpu: list[int]) -> None:
    """A deep copy or pickle right after a skipped step carries the counts with the skip applied, and no flags."""
    import copy
    import pickle

    p = nn.Parameter(torch.randn(40, 40))
    opt = BlockwiseAdamW([("w", p)], state_format="int8", min_8bit_numel=0)
    p.grad = torch.randn(40, 40)
    opt.step()
    p.grad[0, 0] = float("nan")
    opt.step()
    assert opt._records[p].unread_skip is not None  # noqa: SLF001 - decided on the device, not read yet
    with pytest.warns(RuntimeWarning, match="non-finite gradient for 'w'"):
        twin = copy.deepcopy(opt)
    for other in (twin, pickle.loads(pickle.dumps(opt))):
        assert other.nonfinite_counts == {"w": 1}
        rec = next(iter(other._records.values()))  # noqa: SLF001
        assert rec.unread_skip is None and rec.step == 1


_COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lightning_baoc.kernels import M_FP32, V_FP32, triton_step as ts

def compile_(fn, types, constants):
    names = fn.arg_names
    signature = {n: "constexpr" if n in constants else types.get(n, "fp32") for n in names}
    src = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in constants.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False})

variants = [dict(M=m, V=v, W=0, G=0, CB=0, SKIP=False, REPAIR=False) for m, v in sorted(ts.SERVED | {(M_FP32, V_FP32)})]
variants += [dict(M=3, V=2, W=1, G=1, CB=8, SKIP=True, REPAIR=False), dict(M=2, V=1, W=2, G=2, CB=16, SKIP=True, REPAIR=False),
             dict(M=M_FP32, V=V_FP32, W=0, G=0, CB=0, SKIP=True, REPAIR=True)]
for v in variants:
    compile_(ts._adamw_tensors, {"table": "*i64", "count": "i32", "any_flag": "*fp32" if v["REPAIR"] else "*i64"},
             dict(v, LERP_SMALL=True, L2=True, SEARCH=3))
from lightning_baoc.kernels import triton_factored as tf
for w, g, cb in ((0, 0, 0), (1, 1, 8), (2, 1, 16)):
    compile_(tf._sums, {"table": "*i64", "count": "i32", "partial": "*fp32", "row_sum": "*fp32"},
             dict(L2=True, W=w, G=g, CB=cb, SEARCH=3, BR=tf.ROWS, BC=tf.TILE))
compile_(tf._finish, {"table": "*i64", "partial": "*fp32", "row_sum": "*fp32", "factors": "*fp32"},
         dict(SKIP=True, B=tf.BLOCK))
print("compiled", len(variants) + 4)
"""


@pytest.mark.slow  # 12 s on the 2-core machine: every kernel variant compiled for sm_90 in a fresh process
def test_the_kernels_compile_for_a_hopper_gpu(tmp_path: Path) -> None:
    """The interpreter runs the kernels' Python, not Triton's compiler: this compiles them for an H100
    (sm_90, through Triton's own ptxas; no GPU needed) in a process without the interpreter, so that a
    construct the compiler refuses fails here rather than on the first GPU."""
    import subprocess
    import sys

    backend = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not backend.exists():
        pytest.skip("this triton has no CUDA backend (ptxas)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)  # a cold cache: every variant compiled
    proc = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "compiled 15" in proc.stdout
