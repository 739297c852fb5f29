"""Every route of the optimizer step held to one result: the route is a test axis.

The routes, all on the CPU (``tests/support_routes.py``): the eager step, the compiled CPU kernels, the device's
route (the GPU's planned step through Triton's interpreter) and graph replay on that route.

Each case (a :class:`Case`) trains named parameters through one route and returns what the step leaves (every
parameter, its compact states, its counts and its master-weight correction). Every route agrees with the eager
step within each format's stated bound (:attr:`StateFormat.parity <lightning_baoc.formats.base.StateFormat.parity>`:
``compiled`` for the compiled route, ``triton`` for the device's), and the graph route with the device route bit
for bit (the same kernels, replayed). Where a case's steps are steady, the graph route must have replayed a
captured step (else it only repeats the device route).

The default run holds a small matrix (every route, the cases that took defects before); ``-m slow`` runs every
case on every route, every AdamW format, SGD's and Lion's, and DeepSpeed's fragments on two ranks.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import pytest
import torch
from support_formats import OPTIMIZERS, _assert_fast
from support_routes import PARITY_OF, POLICY, ROUTES, on_route, route_unavailable, set_graphs
from torch import nn

from lightning_baoc import FORMATS, MOMENTUM_FORMATS
from lightning_baoc.formats.base import BIT_EQUAL

@dataclass
class Run:
    """One case's training on one route: its parameters, optimizer, and what it counted."""

    route: str
    named: list[tuple[str, nn.Parameter]]
    make: Callable[[list[tuple[str, nn.Parameter]]], Any]
    opt: Any = None
    replays: int = 0
    gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(1))

    def build(self) -> Any:
        """A new optimizer over the run's parameters on its route (a resume builds one again)."""
        if self.opt is not None:
            self.replays += self.opt._stepper.graphs.replays  # noqa: SLF001 - what the graph route did
        self.opt = self.make(self.named)
        set_graphs(self.opt, self.route)
        return self.opt

    @property
    def params(self) -> dict[str, nn.Parameter]:
        return dict(self.named)

    def noise(self, p: torch.Tensor, scale: float = 1e-2) -> torch.Tensor:
        return (torch.randn(p.shape, generator=self.gen) * scale).to(p.dtype)

    def set_grads(self, skip: tuple[str, ...] = ()) -> None:
        """Each gradient written into the one tensor it keeps (as backward accumulates: the graph replays)."""
        for name, p in self.named:
            if name in skip:
                p.grad = None
                continue
            g = self.noise(p)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(g)

    def loss(self, targets: dict[str, torch.Tensor]) -> torch.Tensor:
        """A loss whose gradients differ by parameter and step: a weighted distance to ``targets``."""
        return sum(((p.float() - targets[name]) ** 2 * (1.0 + i)).sum() * 0.5
                   for i, (name, p) in enumerate(self.named))  # type: ignore[return-value]

    def targets(self) -> dict[str, torch.Tensor]:
        return {name: torch.randn(p.shape, generator=self.gen) for name, p in self.named}

    def step(self) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "non-finite gradient", RuntimeWarning)
            warnings.filterwarnings("ignore", ".*skipped.*", RuntimeWarning)
            self.opt.step()

    def state(self) -> list[tuple[str, list[torch.Tensor]]]:
        """Per parameter: its final format and (the parameter, its compact states by key, its counts, its
        correction)."""
        out = []
        masters = self.opt.master_weights()
        for name, p in self.named:
            rec = self.opt._records[p]  # noqa: SLF001 - the compact state itself
            tensors = [p.detach().clone(), *(t.clone() for _, t in sorted(rec.views.items())), rec.counts.clone()]
            if rec.master_correction is not None:
                # the fp32 master the weight and its correction rebuild: where a route's fp32 arithmetic differs in
                # its last bits (fp32's and factored formats' sums), the correction, which holds those bits, differs
                # by a few codes; the master is held to the format's bound (bit-equal: weight and correction equal)
                tensors.append(masters[name].clone())
            out.append((rec.format, tensors))
        return out

    def finish(self) -> int:
        return self.replays + self.opt._stepper.graphs.replays  # noqa: SLF001


@dataclass(frozen=True)
class Case:
    """A training to run on every route.

    ``shapes``: each parameter's name, shape and dtype (``"t"`` in the name: the parameter is a transposed,
    non-contiguous view); ``options``: the optimizer's; ``formats``: per-parameter formats set before the first
    step; ``body(run)``: the steps; ``steady``: whether the graph route must replay (its steps capture);
    ``optimizer``: ``"adamw"``, ``"sgd"`` or ``"lion"``.
    """

    name: str
    shapes: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]
    body: Callable[[Run], None]
    options: dict[str, Any] = field(default_factory=dict)
    formats: dict[str, str] = field(default_factory=dict)
    steady: bool = True
    optimizer: str = "adamw"
    exact: bool = False  # the same arithmetic on every route (an fp32-exact lr): the same bits


    def model(self) -> list[tuple[str, nn.Parameter]]:
        gen = torch.Generator().manual_seed(0)
        named = []
        for name, shape, dtype in self.shapes:
            if "t" in name:  # the parameter's data is a transposed view of a contiguous tensor: non-contiguous
                data = (torch.randn(tuple(reversed(shape)), generator=gen) * 0.1).to(dtype).t()
            else:
                data = (torch.randn(shape, generator=gen) * 0.1).to(dtype)
            named.append((name, nn.Parameter(data)))
        return named

    def run(self, route: str) -> tuple[list[tuple[str, list[torch.Tensor]]], int]:
        cls = OPTIMIZERS[self.optimizer][0]
        options = {"lr": 1e-2, "weight_decay": 0.1, "min_8bit_numel": 0, **self.options}

        def make(named: list[tuple[str, nn.Parameter]]) -> Any:
            opt = cls(named, kernels=POLICY[route], **options)
            if self.formats:
                opt.set_formats(self.formats)
            return opt

        with on_route(route):
            run = Run(route, self.model(), make)
            run.build()
            self.body(run)
            return run.state(), run.finish()


# --- the cases' bodies ----------------------------------------------------------------------------------------


def _steps(n: int) -> Callable[[Run], None]:
    def body(run: Run) -> None:
        for _ in range(n):
            run.set_grads()
            run.step()
    return body


def _conversions(run: Run) -> None:
    """Formats changed before steps 4 and 7 (momentum dropped, re-created, 8-bit to 16-bit and back)."""
    names = [name for name, _ in run.named]
    for step in range(10):
        if step == 4:
            run.opt.set_formats({names[0]: "bf16", names[1]: "nomomentum", names[-1]: "int8"})
        if step == 7:
            run.opt.set_formats({names[0]: "int8", names[1]: "fp32"})
        run.set_grads()
        run.step()


def _resume(run: Run) -> None:
    """A checkpoint after step 4, loaded by a new optimizer (as a resume builds one), then more steps."""
    for step in range(9):
        if step == 4:
            saved = run.opt.state_dict()
            run.build()
            run.opt.load_state_dict(saved)
        run.set_grads()
        run.step()


def _nonfinite(run: Run) -> None:
    """An inf in one gradient at step 2, a NaN in another at step 5: those parameters skip (counted)."""
    names = [name for name, _ in run.named]
    for step in range(8):
        run.set_grads()
        if step == 2:
            run.params[names[0]].grad.view(-1)[3] = float("inf")
        if step == 5:
            run.params[names[-1]].grad.view(-1)[0] = float("nan")
        run.step()
    assert run.opt.nonfinite_counts == {names[0]: 1, names[-1]: 1}, (run.route, run.opt.nonfinite_counts)


def _accumulate_and_clip(run: Run) -> None:
    """Two backward passes into the kept gradients, clipped to a norm below theirs, zeroed in place."""
    for _ in range(7):
        for _ in range(2):
            run.loss(run.targets()).backward()
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in run.named], max_norm=1.0)
        assert float(norm) > 1.0  # the clipping changes the gradients
        run.step()
        run.opt.zero_grad(set_to_none=False)


def _amp(run: Run) -> None:
    """torch's GradScaler: scaled backward, unscale, clip, the scaler's step (an inf at step 3 skips it all)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    for step in range(8):
        loss = run.loss(run.targets())
        scaler.scale(loss).backward()
        if step == 3:
            run.named[0][1].grad.view(-1)[1] = float("inf")
        scaler.unscale_(run.opt)
        torch.nn.utils.clip_grad_norm_([p for _, p in run.named], max_norm=10.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            scaler.step(run.opt)
        scaler.update()
        run.opt.zero_grad(set_to_none=False)
    assert run.opt.nonfinite_counts == {}  # the scaler's skip is no parameter's


def _lr_schedule_and_none_grads(run: Run) -> None:
    """A cosine learning rate; at step 4 one parameter has no gradient (it does not step)."""
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(run.opt, T_max=10)
    names = [name for name, _ in run.named]
    for step in range(8):
        run.set_grads(skip=(names[1],) if step == 4 else ())
        run.step()
        schedule.step()


F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
_SHAPES = (("a", (37, 101), F32), ("b", (300,), F32), ("c", (64, 64), F32), ("e", (2, 1024), F32))
#: a group of fp32, bf16 and fp16 weights in each order (the device route once crashed where an fp32 weight
#: came before a 16-bit one in the fp32 format)
_SHORT = {F32: "32", BF16: "bf", F16: "16"}
_ORDERS = {"-".join(_SHORT[d] for d in order): order for order in itertools.permutations((F32, BF16, F16))}


def _mixed(order: tuple[torch.dtype, ...]) -> tuple[tuple[str, tuple[int, ...], torch.dtype], ...]:
    return tuple((f"w{i}", (24, 40 + i), d) for i, d in enumerate(order)) + (("v", (33,), order[0]),)


CASES: list[Case] = []
for _fmt in FORMATS:
    CASES.append(Case(f"format-{_fmt}", _SHAPES, _steps(5), {"state_format": _fmt}))
for _key, _order in _ORDERS.items():
    CASES.append(Case(f"mixed-dtypes-{_key}", _mixed(_order), _steps(5)))
CASES += [
    # torch's fused kernel reads lr as an fp32 tensor on the device's route: at an lr fp32 holds exactly, the same bits
    Case("fp32-exact-lr", _SHAPES + (("h", (20, 50), BF16),), _steps(6), {"lr": 2.0**-7}, exact=True),
    Case("mixed-dtypes-int8", _mixed((F32, BF16, F16)), _steps(5), {"state_format": "int8"}),
    Case("corrections-ecc8", (("a", (37, 101), BF16), ("b", (300,), BF16), ("c", (64, 64), F32)), _steps(6),
         {"weight_correction": "ecc8", "state_format": "int8"}, {"c": "bf16"}),
    Case("corrections-ecc16", (("a", (37, 101), BF16), ("b", (300,), F16)), _steps(6),
         {"weight_correction": "ecc16"}, {"b": "bf16_momentum"}),
    # a non-contiguous weight takes the host's decision (no plan serves it), so no step is captured
    Case("noncontiguous", (("at", (48, 80), F32), ("ct", (40, 64), BF16), ("b", (300,), F32)), _steps(6),
         {"state_format": "int8"}, {"b": "fp32"}, steady=False),
    Case("conversions", _SHAPES, _conversions, {"state_format": "int8"}, {"c": "fp32"}),
    Case("resume", _SHAPES + (("h", (20, 50), BF16),), _resume, {"state_format": "int8", "weight_correction": "ecc8"},
         {"b": "fp32", "c": "bf16", "h": "int8_factored"}),
    Case("nonfinite", _SHAPES, _nonfinite, {"state_format": "int8"}, {"b": "fp32", "e": "fp32"}),
    Case("accumulate-clip", _SHAPES, _accumulate_and_clip, {"state_format": "int8"}, {"b": "fp32", "c": "bf16"}),
    Case("amp", _SHAPES, _amp, {"state_format": "int8"}, {"b": "fp32", "c": "bf16", "e": "factored"}),
    Case("schedule-none-grad", _SHAPES, _lr_schedule_and_none_grads, {"state_format": "bf16"}, {"a": "fp32"},
         steady=False),
]
for _optimizer in ("sgd", "lion"):
    for _fmt in MOMENTUM_FORMATS:
        CASES.append(Case(f"{_optimizer}-{_fmt}", _SHAPES, _steps(5), {"state_format": _fmt}, steady=False,
                          optimizer=_optimizer))
    CASES.append(Case(f"{_optimizer}-bf16-weights", _mixed((BF16, F32, F16)), _steps(5),
                      {"state_format": "int8", "weight_correction": "ecc8"}, steady=False, optimizer=_optimizer))
BY_NAME = {case.name: case for case in CASES}
#: the default run's cases: the defects' and one of each kind of behaviour; ``-m slow`` runs them all
DEFAULT = ("mixed-dtypes-32-bf-16", "fp32-exact-lr", "mixed-dtypes-int8", "resume", "nonfinite", "amp",
           "accumulate-clip", "sgd-int8")


#: the default cases that also run on the device and graph routes by default (the others there under ``-m slow``:
#: each is several seconds on Triton's interpreter)
DEFAULT_ON_DEVICE = ("mixed-dtypes-32-bf-16", "fp32-exact-lr", "mixed-dtypes-int8", "sgd-int8")


def _matrix() -> list[Any]:
    out = []
    for case in CASES:
        for route in ROUTES[1:]:
            default = case.name in DEFAULT and (route == "compiled" or case.name in DEFAULT_ON_DEVICE)
            marks = () if default else (pytest.mark.slow,)
            out.append(pytest.param(case.name, route, marks=marks, id=f"{case.name}-{route}"))
    return out


_RESULTS: dict[tuple[str, str], Any] = {}


def _result(case: Case, route: str) -> Any:
    """``case``'s result on ``route`` (the eager and device routes' kept per process: every other route is held
    to the eager one, the graph route to the device one)."""
    key = (case.name, route)
    if key in _RESULTS:
        return _RESULTS[key]
    result = case.run(route)
    if route in ("eager", "device"):
        _RESULTS[key] = result
    return result


def assert_routes_agree(case: Case, route: str, got: Any, eager: Any) -> None:
    """``got`` (of ``route``) agrees with the eager step's ``eager``, parameter by parameter, within the bound of
    each parameter's format for that route."""
    registry = OPTIMIZERS[case.optimizer][1]
    assert [fmt for fmt, _ in got] == [fmt for fmt, _ in eager], (case.name, route)
    for (name, _, _), (fmt, mine), (_, theirs) in zip(case.shapes, got, eager):
        agreement = BIT_EQUAL if case.exact and route != "compiled" else getattr(registry[fmt].parity, PARITY_OF[route])
        assert len(mine) == len(theirs), (case.name, route, name)
        _assert_fast(agreement, mine, theirs, f"{case.name}: {name} ({fmt}) on the {route} route")


@pytest.mark.parametrize(("name", "route"), _matrix())
def test_every_route_agrees_with_the_eager_step(name: str, route: str) -> None:
    why = route_unavailable(route)
    if why is not None:
        pytest.skip(why)
    case = BY_NAME[name]
    got, replays = _result(case, route)
    assert_routes_agree(case, route, got, _result(case, "eager")[0])
    if route == "graph":
        device, _ = _result(case, "device")
        for (fmt, mine), (_, theirs) in zip(got, device):  # the replayed step is the planned one, bit for bit
            for x, y in zip(mine, theirs):
                assert x.dtype == y.dtype and torch.equal(x, y), (name, fmt)
        if case.steady:
            assert replays > 0, f"{name}: the graph route never replayed a captured step"


def test_the_matrix_covers_every_format_and_order() -> None:
    """Every AdamW format, SGD's and Lion's momentum formats and every order of fp32, bf16 and fp16 weights in
    one group are cases; the default run holds every route."""
    names = set(BY_NAME)
    assert {f"format-{fmt}" for fmt in FORMATS} <= names
    assert {f"{o}-{fmt}" for o in ("sgd", "lion") for fmt in MOMENTUM_FORMATS} <= names
    assert len([n for n in names if n.startswith("mixed-dtypes-") and n != "mixed-dtypes-int8"]) == 6
    assert set(DEFAULT) <= names
    defaults = [p for p in _matrix() if not p.marks]
    assert {p.values[1] for p in defaults} == set(ROUTES[1:])
