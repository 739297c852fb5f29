"""The compiled CPU step (``lightning_baoc/kernels/cpu_step.cpp``) against the eager step, its
reference: the options (maximize, Adam's L2 decay, bf16 parameters, several tensors in one call, the
edges of fp32), the policies and the build. Every format on every shape class after 1 and after 50
steps: ``tests/formats/test_backends.py``; both through the harness ``tests/support_formats.py``, with
each format's bounds from its registry entry.

Both steps compute the same fp32 operations in the same order (a correctly rounded square root in
both, see ``quant.sqrt_rn``), so the element-wise formats agree to the bit: parameters, codes,
scales and exponents. The factored formats sum their row and column means in another order, so
their vectors (and through them the parameters) agree to a few fp32 ulps. ``fp32`` and ``offload``
take torch's fused AdamW in the eager step (``torch.optim.AdamW(fused=True)`` bit for bit) and the
kernel's AdamW in the compiled step (``adam_math.chunk_adamw``'s order: one division per element
fewer), within an ulp of each other."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import support_formats as H
import torch
from torch import nn

from lightning_baoc import FORMATS, BlockwiseAdamW, kernels
from lightning_baoc.kernels import build

pytestmark = pytest.mark.skipif(not kernels.cpu_kernels().available, reason=f"no compiled kernels: {kernels.cpu_kernels().detail}")

COMPILED = [name for name, fmt in FORMATS.items() if fmt.kernel_kinds is not None]
FP32_PAIR = [name for name in COMPILED if FORMATS[name].kernel_kinds == (kernels.M_FP32, kernels.V_FP32)]


@pytest.mark.parametrize("fmt", COMPILED)
@pytest.mark.parametrize(
    "options",
    [{"maximize": True}, {"decoupled_weight_decay": False, "weight_decay": 0.1}, {"param_dtype": torch.bfloat16},
     {"betas": (0.3, 0.99)}],  # a momentum weight >= 0.5 takes ATen's other lerp formula
    ids=["maximize", "l2", "bf16-params", "beta1-0.3"],
)
def test_compiled_step_options(fmt: str, options: dict) -> None:
    shapes = [(40, 77)]
    compiled = H.run(fmt, "compiled", shapes, 5, **dict(options))
    H.assert_agree(fmt, "compiled", compiled, H.run(fmt, "eager", shapes, 5, **dict(options)), shapes)


@pytest.mark.parametrize("options", [{}, {"maximize": True}, {"decoupled_weight_decay": False, "weight_decay": 0.1}])
@pytest.mark.parametrize("fmt", FP32_PAIR)
def test_compiled_fp32_step_equals_chunk_adamw_bit_for_bit(fmt: str, options: dict) -> None:
    """The kernel's AdamW on fp32 state is ``adam_math.chunk_adamw`` to the bit (ragged size, 20 steps)."""
    from lightning_baoc.formats.adam_math import chunk_adamw
    from lightning_baoc.formats.base import StepHyper

    shape, lr, betas, eps, wd = (37, 101), 1e-2, (0.9, 0.999), 1e-8, options.get("weight_decay", 1e-2)
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) * (1.0 + 0.1 * i) for i in range(20)]
    p = nn.Parameter(start.clone())
    opt = BlockwiseAdamW([("w", p)], lr=lr, betas=betas, eps=eps, state_format=fmt, kernels="compiled", **options)
    hyper = StepHyper(lr, *betas, eps, wd, options.get("decoupled_weight_decay", True), options.get("maximize", False))
    q, m, v = start.clone().view(-1), torch.zeros(start.numel()), torch.zeros(start.numel())
    for t, g in enumerate(grads, start=1):
        p.grad = g
        opt.step()
        chunk_adamw(q, g.view(-1), m, v, hyper, 1.0 - betas[0] ** t, 1.0 - betas[1] ** t)
    rec = opt._records[p]  # noqa: SLF001 - the state itself
    assert torch.equal(p.detach().view(-1), q)
    assert torch.equal(rec.views["exp_avg"], m) and torch.equal(rec.views["exp_avg_sq"], v)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("fmt", COMPILED)
def test_one_call_over_many_tensors_equals_tensor_by_tensor(fmt: str, threads: int) -> None:
    """Many parameters of one format go through one kernel call (the super-blocks of every tensor
    are one index range, split among the threads); each comes out as if stepped alone, at 1 thread, to the bit."""
    shapes = [(33, 65), (8, 1024), (1, 2000), (3, 3), (129, 31)]
    gen = torch.Generator().manual_seed(1)
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(3)]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        params = [nn.Parameter(x.clone()) for x in start]
        together = BlockwiseAdamW([(str(i), p) for i, p in enumerate(params)], state_format=fmt, min_8bit_numel=0, kernels="compiled")
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g
            together.step()
        torch.set_num_threads(1)
        for i, p in enumerate(params):
            alone = nn.Parameter(start[i].clone())
            opt = BlockwiseAdamW([(str(i), alone)], state_format=fmt, min_8bit_numel=0, kernels="compiled")
            for step in grads:
                alone.grad = step[i]
                opt.step()
            # the factored column sums run in fixed parts whatever the thread count: bit-equal (they differed by
            # 2.4e-7 between 1 and 2 threads, so a resume on another core count was not bit-equal)
            assert torch.equal(alone.detach(), p.detach()), (fmt, threads, shapes[i])
    finally:
        torch.set_num_threads(before)


def test_kernel_policies() -> None:
    assert kernels.resolve_policy(None) in kernels.POLICIES
    with pytest.raises(ValueError, match="kernels.*'fast'.*auto, compiled, eager"):
        kernels.resolve_policy("fast")
    with pytest.raises(ValueError, match="Invalid kernels"):
        BlockwiseAdamW([nn.Parameter(torch.zeros(4))], kernels="fast")
    assert kernels.use_compiled("eager") is False
    assert kernels.use_compiled("compiled") is True


def test_compiled_policy_without_kernels_names_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_STATUS", kernels.KernelStatus(False, "no C++ compiler found ('c++' is not on PATH)"))
    with pytest.raises(RuntimeError, match="kernels='compiled'.*no C\\+\\+ compiler found.*kernels='auto' or 'eager'"):
        BlockwiseAdamW([nn.Parameter(torch.zeros(4))], kernels="compiled")


def test_a_build_directory_that_cannot_be_written_names_its_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCH_EXTENSIONS_DIR under a file: not a compiler's failure, and the message says what to set."""
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "a-file" / "ext"))
    status = build._build(kernels.compile_flags(), [])  # noqa: SLF001 - the build itself, not the process's cached status
    assert isinstance(status, kernels.KernelStatus) and not status.available
    assert "build directory cannot be written" in status.detail and "TORCH_EXTENSIONS_DIR" in status.fix
    monkeypatch.setattr(kernels, "_STATUS", status)
    with pytest.raises(RuntimeError, match="build directory cannot be written.*Set TORCH_EXTENSIONS_DIR to a writable"):
        BlockwiseAdamW([nn.Parameter(torch.zeros(4))], kernels="compiled")


_NO_COMPILER = textwrap.dedent(
    """
    import warnings, torch
    from torch import nn
    from lightning_baoc import BlockwiseAdamW
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(37, 101))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = BlockwiseAdamW([("w", p)], state_format="int8", min_8bit_numel=0)
    print("WARN", [str(w.message) for w in caught if "compiled CPU step" in str(w.message)])
    for i in range(5):
        p.grad = torch.randn(37, 101) * (1 + i)
        opt.step()
    torch.save(p.detach(), "result.pt")
    """
)


@pytest.mark.slow  # a process without a compiler; the eager step is held by default by every format's tests
def test_without_a_compiler_the_eager_step_runs_with_the_same_results(tmp_path: Path) -> None:
    """Install on a machine without a C++ compiler: one warning that says so, the eager step, the
    same results as the compiled one."""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    env.pop(kernels.KERNELS_ENV, None)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", _NO_COMPILER], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "no C++ compiler found" in out.stdout and "the eager step runs instead" in out.stdout, out.stdout
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").rglob("*.so"))  # nothing was built
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(37, 101))
    opt = BlockwiseAdamW([("w", p)], state_format="int8", min_8bit_numel=0, kernels="compiled")
    for i in range(5):
        p.grad = torch.randn(37, 101) * (1 + i)
        opt.step()
    assert torch.equal(torch.load(tmp_path / "result.pt"), p.detach())


@pytest.mark.parametrize("fmt", COMPILED)
def test_compiled_step_at_the_edges_of_fp32(fmt: str) -> None:
    """Gradients at the edges of fp32 (near its maximum, where AdamW's own v overflows; subnormal;
    exact zeros, whole groups of them): the saturation and flush rules of the formats (bf16 carry
    into the inf exponent, 8-bit scale limits, zero groups) come out as the eager step's."""
    shape = (16, 256)
    results = []
    for policy in ("compiled", "eager"):
        gen = torch.Generator().manual_seed(3)
        p = nn.Parameter(torch.randn(shape, generator=gen))
        opt = BlockwiseAdamW([("w", p)], lr=1e-3, state_format=fmt, min_8bit_numel=0, kernels=policy)
        for scale in (3.3e38, 1e19, 1e-40, 0.0, 1.0):
            g = (torch.randn(shape, generator=gen).double() * scale).clamp(-3.4e38, 3.4e38).float()
            g[0, :64] = 0.0  # two whole groups of zeros
            g[1, :5] = torch.tensor([3.4e38, -3.4e38, 1e-45, -1e-45, 0.0])
            p.grad = g
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # every gradient here is finite: no step may be skipped
                opt.step()
        results.append([p.detach().clone(), *H.state_of(opt, p)])
    H.assert_agree(fmt, "compiled", results[0], results[1], [shape])


def test_a_compiler_without_openmp_builds_the_kernels_for_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Apple's clang has no -fopenmp: the build is retried without it, and the status says so."""
    calls: list[list[str]] = []

    def fake_build(flags: list[str], ldflags: list[str]) -> kernels.KernelStatus | str:
        calls.append(flags)
        if "-fopenmp" in flags:
            return "clang: error: unsupported option '-fopenmp'"
        return kernels.KernelStatus(True, "built in 9.0 s", 9.0)

    monkeypatch.setattr(build, "_loaded", lambda: False)
    monkeypatch.setattr(build, "_missing_tool", lambda: None)
    monkeypatch.setattr(build, "_build", fake_build)
    status = build.load_kernels()  # the build logic itself, the builds faked
    assert status.available and "without OpenMP: one thread" in status.detail and "-fopenmp" in status.detail
    assert len(calls) == 2 and "-fopenmp" not in calls[1]
    monkeypatch.setattr(build, "_build", lambda flags, ldflags: "error: no matching function")
    failed = build.load_kernels()
    assert not failed.available and failed.detail == "the build failed: error: no matching function"


def test_a_stale_build_lock_is_removed_and_a_live_one_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch waits for its build directory's lock without a limit: a process killed while it held it (an
    interrupted first step) would hang every later one. A lock older than STALE_LOCK_SECONDS is removed
    with a warning that names it; a younger one is waited for until its builder removes it."""
    import threading
    import time

    lock = tmp_path / "lock"
    lock.touch()
    old = time.time() - 2 * build.STALE_LOCK_SECONDS
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="removed a stale lock of the CPU kernels' build .*lock"):
        build._wait_for_build_lock(tmp_path, poll=0.01)  # noqa: SLF001 - the wait itself
    assert not lock.exists()

    lock.touch()  # a live build: its builder removes the lock after 0.3 s
    threading.Timer(0.3, lock.unlink).start()
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build._wait_for_build_lock(tmp_path, poll=0.01)  # noqa: SLF001
    assert 0.25 <= time.perf_counter() - start < 5.0

    lock.touch()  # nobody removes it: it goes stale while waited for
    monkeypatch.setattr(build, "STALE_LOCK_SECONDS", 0.3)
    with pytest.warns(RuntimeWarning, match="stale lock"):
        build._wait_for_build_lock(tmp_path, poll=0.01)  # noqa: SLF001
    assert not lock.exists()
    build._wait_for_build_lock(None)  # noqa: SLF001 - a torch that does not say where it builds


def _saturation(bits: torch.Tensor, noise: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 stochastic rounding of the fp32 values ``bits`` (int64, 32-bit patterns) under ``noise``, as
    int: the eager step's (quant.bf16_stochastic: the 32-bit sum masked, clamped to bf16's range,
    stored), the 32-bit saturation of the sum (the kernels' before) and the kernels' (cpu_step.cpp
    bf16_stochastic: the sum's upper 16 bits, saturated there)."""
    total = (bits + noise) & 0xFFFFFFFF
    masked = total & 0xFFFF0000
    as_float = torch.where(masked >= 2**31, masked - 2**32, masked).to(torch.int32).view(torch.float32)
    eager = as_float.clamp(-3.38953138925153547590e38, 3.38953138925153547590e38).to(torch.bfloat16)
    eager = eager.view(torch.int16).to(torch.int64) & 0xFFFF
    magnitude32 = masked & 0x7FFFFFFF
    wide = torch.where(magnitude32 > 0x7F800000, torch.full_like(total, 0x7FC00000),
                       (masked & 0x80000000) | magnitude32.clamp(max=0x7F7F0000)) >> 16
    h = total >> 16
    magnitude = h & 0x7FFF
    kernel = torch.where(magnitude > 0x7F80, torch.full_like(h, 0x7FC0), (h & 0x8000) | magnitude.clamp(max=0x7F7F))
    return eager, wide, kernel


@pytest.mark.slow  # long; 16-bit weights on the compiled step are held by default in this file
@pytest.mark.parametrize("stride", [pytest.param(61, marks=pytest.mark.slow), 4093])
def test_the_kernels_bf16_saturation_on_16_bits_equals_the_32_bit_one(stride: int) -> None:
    """The kernels saturate the stochastically rounded bf16 on the 16-bit result (twice the lanes of a
    vector): bit for bit the saturation of the 32-bit sum, over fp32 bit patterns (every 4093rd, every
    61st under ``slow``, and all near bf16's largest value, the carry past it, inf and NaN) and noise at
    the edges (the whole 2**32 patterns were checked once in C++: equal); and the eager step's value
    but for a NaN's payload (torch's vectorized conversion writes 0xFFFF, the kernels 0x7FC0; a step
    never rounds a NaN: a non-finite gradient skips the step)."""
    chunk = 1 << 24
    edges = [torch.arange(a, a + (1 << 18), dtype=torch.int64) for a in (0x7F7E0000, 0xFF7E0000, 0xFFFC0000, 0)]
    for noise in (0, 1, 0x7FFF, 0x8000, 0xFFFF, 0x1234):
        spans = [torch.arange(first, first + chunk, stride, dtype=torch.int64) for first in range(0, 1 << 32, chunk)]
        for bits in spans + edges:
            eager, wide, kernel = _saturation(bits, noise)
            assert torch.equal(wide, kernel), (noise, int(bits[(wide != kernel).nonzero()[0]]))
            nan = (eager & 0x7FFF) > 0x7F80
            assert torch.equal(nan, (kernel & 0x7FFF) > 0x7F80)
            assert torch.equal(eager[~nan], kernel[~nan])


_PORTABLE = textwrap.dedent(
    """
    import sys
    import pytest
    from lightning_baoc import kernels
    flags = kernels.compile_flags()
    kernels.compile_flags = lambda: [f for f in flags if f in ("-O3", "-ffp-contract=off", "-fno-math-errno",
                                                              "-fno-trapping-math", "-fopenmp")]
    print("FLAGS", kernels.compile_flags(), kernels.cpu_kernels().detail)
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", *sys.argv[1:], "-k", "not portable and not saturation"]))
    """
)


@pytest.mark.slow
def test_the_portable_kernels_equal_the_eager_step(tmp_path: Path) -> None:
    """The kernels built without the CPU's vector extensions (the compiler's own loops, which CPUs other
    than x86 with AVX2 run, in place of the hand-written AVX2 ones): this file's tests against the eager
    step pass with them too, and the master-weight corrections' (every bf16 and fp16 weight, split and
    rebuilt bit for bit; a build of about 30 s)."""
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    env.pop(kernels.KERNELS_ENV, None)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    corrections = str(Path(__file__).resolve().parents[1] / "optim" / "test_weight_corrections.py")
    out = subprocess.run([sys.executable, "-c", _PORTABLE, __file__, corrections], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=900)
    assert "-mavx2" not in out.stdout and "built in" in out.stdout, out.stdout[-2000:]
    assert out.returncode == 0 and " passed" in out.stdout, out.stdout[-3000:] + out.stderr[-2000:]


@pytest.mark.parametrize("policy", ["compiled", "eager"])
@pytest.mark.parametrize("fmt", ["factored", "int8_factored"])
def test_the_factored_formats_step_alike_on_any_thread_count(fmt: str, policy: str) -> None:
    """A factored state stepped on 1 thread and on every thread the machine has (and 3, more than 2 cores) is
    bit-equal: the sums' order does not follow the thread count."""
    gen = torch.Generator().manual_seed(4)
    start = torch.randn(300, 97, generator=gen)
    grads = [torch.randn(300, 97, generator=gen) for _ in range(3)]
    before = torch.get_num_threads()
    results = []
    try:
        for threads in sorted({1, 3, before}):
            torch.set_num_threads(threads)
            p = nn.Parameter(start.clone())
            opt = BlockwiseAdamW([p], state_format=fmt, min_8bit_numel=0, kernels=policy)
            for g in grads:
                p.grad = g.clone()
                opt.step()
            state = opt.param_state("0")
            results.append((threads, p.detach().clone(), torch.cat([state.row, state.col])))
    finally:
        torch.set_num_threads(before)
    for threads, p, v in results[1:]:
        assert torch.equal(p, results[0][1]) and torch.equal(v, results[0][2]), (fmt, policy, threads)


@pytest.mark.parametrize("fmt", ["factored", "int8_factored"])
@pytest.mark.parametrize("correction", ["none", "ecc8", "ecc16"])
def test_a_16_bit_weight_in_a_factored_format_steps_in_place(
    fmt: str, correction: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The factored kernel took fp32 parameters and gradients only: a bf16 weight stepped through an fp32 copy of
    its master and its gradient (12 bytes per element of the tensor above the steady state, measured in
    docs/benchmarks/peak-memory.md). Now no working copy is made, and the step equals the one through a copy
    (a transposed view of the same values, which still takes one), bit for bit: the weights, their corrections
    and the states."""
    import lightning_baoc.kernels.compiled as compiled

    torch.manual_seed(0)
    start = torch.randn(96, 160).bfloat16()
    grads = [(torch.randn(96, 160) * 1e-2).bfloat16() for _ in range(3)]

    def run(transposed: bool) -> tuple[torch.Tensor, BlockwiseAdamW]:
        base = nn.Parameter(start.t().contiguous().t() if transposed else start.clone())
        opt = BlockwiseAdamW([("w", base)], lr=1e-3, weight_decay=0.01, state_format=fmt, weight_correction=correction,
                             min_8bit_numel=0)
        for g in grads:
            base.grad = g.t().contiguous().t() if transposed else g.clone()
            opt.step()
        return base.detach(), opt

    copied, opt_copied = run(transposed=True)

    def no_copy(*_: object) -> None:
        raise AssertionError("an fp32 working copy of a contiguous 16-bit weight")

    monkeypatch.setattr(compiled, "_master_flat", no_copy)
    monkeypatch.setattr(compiled, "param_flat", no_copy)
    in_place, opt = run(transposed=False)
    assert opt.step_count("w") == 3 and (in_place != start).any()
    assert torch.equal(in_place, copied)
    a, b = opt.state_dict(), opt_copied.state_dict()
    (mine,), (theirs,) = a["state"].values(), b["state"].values()
    for key, value in mine.items():
        if torch.is_tensor(value):
            assert torch.equal(value.reshape(-1), theirs[key].reshape(-1)), key
