"""The GPU's step captured in a CUDA graph and replayed: the host's work per step independent of the number
of tensors.

The planned step (:mod:`lightning_baoc.optim.device_plan`) still walks the parameters in Python at every
step: the optimizer's own loops (which parameters have gradients, pending conversions and corrections),
the routing, the plans' checks, one launch per format with its table copied to the device. On a GPU the
kernels of a GPT-2-small step take a fraction of a millisecond; the host's walk over ~150 tensors takes
more. A :class:`GraphStep` takes a step whose parameters all step through the device's plans and records
its device work once:

- **what changes from step to step lives in device tensors**, filled by two host-to-device copies at the
  start of the graph from one host buffer (pinned on a GPU): each tensor's rounding key, step size,
  ``1 / sqrt(bias_correction2)`` and decay factor (the columns of its launch table:
  :data:`~lightning_baoc.kernels.triton_step._COLUMNS`), and for the fp32 tensors of torch's fused kernel
  each one's step count and the group's learning rate. The host computes them exactly as the planned step
  does, with a fixed number of numpy operations over all rows (so a learning-rate schedule keeps working:
  the learning rate is read at each step);
- **recorded once**: the finiteness flags (one pass over the gradients), each format's launch, torch's fused
  kernel for fp32 tensors and its repair, and the copy of the skip flags to the host, which the next step
  reads (:class:`GraphSkips`, applied to the counts with numpy).

So a replayed step's host work is a fixed number of Python and numpy operations, whatever the number of
tensors, plus checks at C speed over the tensors that nothing the graph read has changed (the parameters'
and gradients' addresses, dtypes and layouts; ``tests/optim/test_graph_step.py`` counts both). It equals the
planned step bit for bit (the same test, through a backend that replays what it recorded with the
arguments it recorded: a CUDA graph's semantics, on the CPU).

**Re-capture.** A step is captured only after two steps with the same plan and the same gradient
addresses; the capture holds while nothing changes. What invalidates it (each tested): a conversion, a
correction or a load (the optimizer's ``generation``), a parameter added, a param group's setting other
than its learning rate, a gradient that moved, changed dtype or is missing, a parameter's data replaced,
gradient release, a count torch's fused kernel cannot take. An invalid step runs as the planned step and
may be captured again later; a capture that fails, or gradients that move at every step (re-captured more
than :data:`MAX_RECAPTURES` times), turn the graph off for the optimizer with one warning saying why.

**Decisions.** The fused kernel's learning rate is a device tensor under a graph (a float would be recorded
once), so fp32 tensors see ``lr`` rounded to fp32, as torch's own ``AdamW(fused=True, capturable=True)``
with a tensor learning rate does; the planned step of an optimizer with graphs on does the same, so the
two steps are the same bits and a run moves between them freely. Gradients are not copied into static
buffers (a copy per step costs what the graph saves): the graph reads them where backward put them, which
PyTorch's caching allocator repeats from step to step in a steady loop.
"""

from __future__ import annotations

import operator
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from lightning_baoc.formats.fused_adam import MAX_FUSED_STEP, fused_kernel_options
from lightning_baoc.formats.quant import M_SCALE_MAX, V_SCALE_MAX
from lightning_baoc.optim.device_plan import step_columns

#: Per-step columns of each row in the host buffer: rounding key, step size, 1/sqrt(bias_correction2), decay,
#: bias_correction2.
_STAGE = 5
#: Captures allowed per optimizer before the graph is turned off (gradients that move at every step).
MAX_RECAPTURES = 8
#: Steps with an unchanged plan and unchanged gradient addresses before a step is captured.
STEADY_STEPS = 2

_grad_of = operator.attrgetter("grad")
_dtype_of = operator.attrgetter("dtype")


class Graph(Protocol):
    """A recorded step: :meth:`replay` runs it again with what it recorded."""

    def replay(self) -> None: ...


class GraphBackend(Protocol):
    """Records a step's device work (``body``, made of :meth:`Recorder.call`'s) and replays it."""

    name: str

    def capture(self, body: Callable[[Recorder], None], device: torch.device) -> Graph: ...

    def host_buffer(self, numel: int, dtype: torch.dtype) -> Tensor: ...

    def event(self, device: torch.device) -> Any: ...


class Recorder:
    """What a captured body calls for each device operation (``call(fn, *args, **kwargs)``): run at once
    under a CUDA graph's capture, kept for replay by :class:`TapeBackend`. A body reads nothing from the host
    but what its arguments hold when it is captured."""

    def __init__(self, run: bool) -> None:
        self.run = run
        self.tape: list[tuple[Callable[..., Any], tuple, dict]] = []

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.tape.append((fn, args, kwargs))
        if self.run:
            fn(*args, **kwargs)


class CudaGraphs:
    """torch's CUDA graphs: the body captured on a side stream (``thread_local`` capture: another thread's CUDA
    calls, a data loader's pinning thread, are not part of it), without :func:`torch.cuda.graph`'s
    ``empty_cache()`` and garbage collection, which would move the next backward's gradients off the addresses
    the graph reads."""

    name = "cuda"

    def capture(self, body: Callable[[Recorder], None], device: torch.device) -> Graph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device):
            current = torch.cuda.current_stream(device)
            side = torch.cuda.Stream(device)
            side.wait_stream(current)
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    body(Recorder(run=True))
                finally:
                    graph.capture_end()
            current.wait_stream(side)
        return graph

    def host_buffer(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.zeros(numel, dtype=dtype, pin_memory=True)

    def event(self, device: torch.device) -> Any:
        return torch.cuda.Event()


@dataclass
class _Tape:
    tape: list[tuple[Callable[..., Any], tuple, dict]]

    def replay(self) -> None:
        for fn, args, kwargs in self.tape:
            fn(*args, **kwargs)


class TapeBackend:
    """A CUDA graph's semantics anywhere: the body's calls recorded (not run) at capture and replayed with the
    arguments recorded, so that a host value read at capture stays what it was. Tests run the graph step on
    the CPU through it (Triton's interpreter standing in for the GPU); counts its captures."""

    name = "tape"

    def __init__(self) -> None:
        self.captures = 0

    def capture(self, body: Callable[[Recorder], None], device: torch.device) -> Graph:
        recorder = Recorder(run=False)
        body(recorder)
        self.captures += 1
        return _Tape(recorder.tape)

    def host_buffer(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.zeros(numel, dtype=dtype)

    def event(self, device: torch.device) -> Any:
        return None


def default_backend(device: torch.device) -> GraphBackend | None:
    """The backend of ``device``'s graphs: CUDA graphs on a GPU, none elsewhere."""
    return CudaGraphs() if device.type == "cuda" and torch.cuda.is_available() else None


class GraphSkips:
    """The skip flags of a captured step, copied to the host by the graph and applied to the counts of all its
    tensors at once (numpy) when a count is next read: at the next step, at a checkpoint, or by a getter
    (each record's ``unread_skip`` points here for as long as the graph lives)."""

    persistent = True

    def __init__(self, host: Tensor, array: np.ndarray, index: np.ndarray, momentum: np.ndarray,
                 records: list[Any], on_skipped: Callable[[list[Any]], None]) -> None:
        self.host, self.array, self.index, self.momentum = host, array, index, momentum
        self.host_np = host.numpy()  # a view, made once
        self.records, self.on_skipped = records, on_skipped
        self.event: Any = None
        self.pending = False

    def apply(self) -> None:
        """Take the last replay's skipped steps back out of the counts (waiting for its flags' copy if needed)."""
        if not self.pending:
            return
        self.pending = False
        if self.event is not None and not self.event.query():
            self.event.synchronize()
        if self.host_np[-1] != 0:  # AMP's scaler skipped the whole step: taken back, nothing counted or warned of
            self.array[self.index, 0] -= 1
            self.array[self.index, 1] -= self.momentum
            return
        bad = np.flatnonzero(self.host_np[:-1])
        if not len(bad):
            return
        at = self.index[bad]
        self.array[at, 0] -= 1
        self.array[at, 1] -= self.momentum[bad]
        self.array[at, 2] += 1
        self.on_skipped([self.records[i] for i in bad.tolist()])  # (their counts' third column: nonfinite)

    def release(self) -> None:
        """Apply what is pending and detach the records (the graph is dropped)."""
        self.apply()
        for rec in self.records:
            if rec.unread_skip is not None and rec.unread_skip[0] is self:
                rec.unread_skip = None


class GraphStep:
    """One captured step: the entries of the device's plans of every param group (``parts``: per group, its
    index, its hyperparameters and the :class:`~lightning_baoc.optim.device_plan.Chosen` entries that step),
    on one device, all of this step's parameters."""

    def __init__(self, parts: list[tuple[int, Any, Any]], seed: int, backend: GraphBackend,
                 on_skipped: Callable[[list[Any]], None], amp: str = "none") -> None:
        # lazy: the Triton step imports triton, an optional dependency
        from lightning_baoc.kernels import triton_step as ts

        self.parts = parts
        self.seed = seed
        self.backend = backend
        entries = [e for _, _, chosen in parts for e in chosen.entries]
        self.entries = entries
        self.params = [e.param for e in entries]
        self.device = self.params[0].device
        plan0 = parts[0][2].plan
        self.array = plan0.array  # the counts of every entry: rows of the optimizer's one array
        self.index = np.concatenate([chosen.plan.index[chosen.rows] for _, _, chosen in parts])
        # what step_columns reads of each row, from its plan
        self.momentum, self.has_m, self.salts, self.offsets = (
            np.concatenate([getattr(chosen.plan, name)[chosen.rows] for _, _, chosen in parts])
            for name in ("momentum", "has_m", "salts", "offsets"))
        self.group_of = np.concatenate([np.full(len(chosen), g, dtype=np.int64) for g, (_, _, chosen) in enumerate(parts)])
        self.fused = np.array([i for i, e in enumerate(entries) if e.fused], dtype=np.int64)
        # what the checks compare: the parameters' and gradients' addresses, dtypes
        grads = list(map(_grad_of, self.params))
        self.param_addresses = list(map(Tensor.data_ptr, self.params))
        self.grad_addresses = list(map(Tensor.data_ptr, grads))
        self.grad_dtypes = list(map(_dtype_of, grads))
        n = len(entries)
        # the device's static tensors: the skip flags, the launches' tables (per group and kind), the fused
        # kernel's found_inf, step counts and learning rates
        self.skip = torch.zeros(n, dtype=torch.float32, device=self.device)
        self.any_skip = torch.zeros(1, dtype=torch.float32, device=self.device)
        self.flags_host = backend.host_buffer(n + 1, torch.float32)  # the skip flags, then AMP's found_inf
        # AMP's scaler (optim/amp.py): "none", "found" (its found_inf joins the flags) or "scaled" (and the
        # gradients are unscaled first), as at the step the graph was built after
        self.amp = amp
        self.found = torch.zeros(1, dtype=torch.float32, device=self.device)
        self.inverse_scale = torch.ones((), dtype=torch.float32, device=self.device)
        self.unscale_found = torch.zeros(1, dtype=torch.float32, device=self.device)
        # each row's key, lr_step, inv_sqrt_bc2, decay (its table's last columns) and bias_correction2 (factored)
        self.stage_int = backend.host_buffer(_STAGE * n, torch.int64)
        self.stage_float = backend.host_buffer(len(self.fused) + len(parts), torch.float32)  # steps, then lrs
        self.stage_int_np, self.stage_float_np = self.stage_int.numpy(), self.stage_float.numpy()  # views, made once
        self.dev_int = torch.zeros(_STAGE * n, dtype=torch.int64, device=self.device)
        self.dev_float = torch.zeros(len(self.fused) + len(parts), dtype=torch.float32, device=self.device)
        self.launches: list[tuple[Any, ...]] = []  # (table on the device, count, rows in entries, kind, common)
        self.fused_calls: list[tuple[Any, ...]] = []
        # the factored formats' works (kernels/triton_factored.py): (work, its buffers, its sums' tables, its finish
        # table, its rows among the entries, the hyperparameters), the buffers the graph's own
        self.factored: list[tuple[Any, ...]] = []
        start = 0
        fused_at = {int(i): k for k, i in enumerate(self.fused.tolist())}
        for g, (_, hyper, chosen) in enumerate(parts):
            by_launch: dict[Any, list[int]] = {}
            for k, e in enumerate(chosen.entries):
                by_launch.setdefault(e.launch, []).append(start + k)
            for launch, members in by_launch.items():
                launched = [entries[i] for i in members]
                table = launch.table
                rows = np.array([e.row for e in launched], dtype=np.int64)
                common = ts._common(table.kinds, hyper, M_SCALE_MAX, V_SCALE_MAX)
                repair = None
                if launched[0].fused:  # a launch's entries share their kernel (DevicePlan keys launches by it)
                    steps = [self.dev_float[fused_at[i] : fused_at[i] + 1].view(()) for i in members]
                    found = self.skip[members[0] : members[0] + 1] if len(members) == 1 else self.any_skip
                    kernel, options = fused_kernel_options(hyper)
                    # the parameters, not their gradients: a tensor held here would keep its memory from the
                    # next step's gradient (the body reads each parameter's at its capture)
                    self.fused_calls.append((kernel, [e.param for e in launched], [e.moments[0] for e in launched],
                                             [e.moments[1] for e in launched], steps,
                                             self.dev_float[len(self.fused) + g : len(self.fused) + g + 1].view(()),
                                             options, found))
                    if len(members) == 1:
                        continue
                    repair = found
                factors = None
                if launch.work is not None:
                    factors = self._factored(launch.work, rows, members, hyper)
                self.launches.extend(self._tables(table, rows, members, common, repair, factors))
            start += len(chosen)
        self.graph: Graph | None = None
        self.skips = GraphSkips(self.flags_host, self.array, self.index, self.momentum,
                                [e.rec for e in entries], on_skipped)

    def _factored(self, work: Any, rows: np.ndarray, members: list[int], hyper: Any) -> list[tuple[int, int]]:
        """A factored launch's work with buffers and tables of the graph's own (its gradients' and skip flags'
        addresses of this capture); its rows' factors' addresses."""
        if not np.array_equal(rows, np.arange(work.count)):
            raise ValueError("a factored launch steps all of its tensors, in order")
        buffers = work.buffers()
        grads = [self.grad_addresses[i] for i in members]
        skips = self.skip.data_ptr() + 4 * np.array(members, dtype=np.int64)
        sums, finish = work.tables(grads, skips, np.zeros(len(members), dtype=np.int64), hyper)
        at = torch.tensor(members, dtype=torch.int64, device=self.device)
        self.factored.append((work, buffers, sums, finish, at, hyper))
        return work.factors(buffers)

    def _tables(self, table: Any, rows: np.ndarray, members: list[int], common: dict, repair: Tensor | None,
                factors: list[tuple[int, int]] | None = None) -> list:
        """The device tables of one launch's rows (per kind): what stays written once, the gradients' and skip
        flags' addresses of this capture among it (and a factored format's factors, in the graph's buffers)."""
        # lazy: the Triton step imports triton, an optional dependency
        from lightning_baoc.kernels import triton_step as ts

        out = []
        kinds = [table.kind[r] for r in rows.tolist()]
        for kind in dict.fromkeys(kinds):
            of_kind = [j for j, k in enumerate(kinds) if k == kind]
            part = table.rows[rows[of_kind]].copy()
            at = [members[j] for j in of_kind]
            part[:, 1] = [self.grad_addresses[i] for i in at]
            part[:, ts._SKIP_COLUMN] = self.skip.data_ptr() + 4 * np.array(at, dtype=np.int64)
            if factors is not None:
                part[:, ts._FACTOR_COLUMN : ts._FACTOR_COLUMN + 2] = [factors[j] for j in of_kind]
            sizes = table.blocks[rows[of_kind]]
            firsts = np.cumsum(sizes)
            flat = torch.from_numpy(np.concatenate([part.reshape(-1), [0], firsts[:-1]]).astype(np.int64))
            device_table = flat.to(self.device) if self.device.type == "cuda" else flat
            rows_at = torch.tensor(at, dtype=torch.int64, device=self.device)  # this launch's rows of the step's columns
            out.append((device_table, len(at), rows_at, kind, common, repair, int(firsts[-1])))
        return out

    # ------------------------------------------------------------------ capture and replay

    def _body(self, rec: Recorder) -> None:
        """The step's device work, every argument a tensor the graph keeps or a constant of the capture."""
        # lazy: the Triton step imports triton, an optional dependency
        from lightning_baoc.kernels import triton_factored as tf, triton_step as ts

        on_gpu = self.device.type == "cuda"
        rec.call(self.dev_int.copy_, self.stage_int, non_blocking=on_gpu)
        rec.call(self.dev_float.copy_, self.stage_float, non_blocking=on_gpu)
        grads = [p.grad for p in self.params]
        if self.amp == "scaled":  # the scaler's unscale_, per dtype (optim/amp.py)
            by_dtype: dict[torch.dtype, list[Tensor]] = {}
            for g in grads:
                by_dtype.setdefault(g.dtype, []).append(g)
            for group in by_dtype.values():
                rec.call(torch._amp_foreach_non_finite_check_and_unscale_, group, self.unscale_found, self.inverse_scale)
        rec.call(_skip_flags, grads, self.skip)
        if self.amp != "none":  # the scaler's found_inf: every flag set
            rec.call(self.found.clamp_, max=1.0)
            rec.call(torch.maximum, self.skip, self.found, out=self.skip)
        if len(self.params) > 1:
            rec.call(torch.amax, self.skip, 0, True, out=self.any_skip)
        per_row = self.dev_int.view(-1, _STAGE)
        for table, count, at, _, _, _, _ in self.launches:
            columns = table[: count * len(ts._COLUMNS)].view(count, len(ts._COLUMNS))[:, ts._KEY_COLUMN :]
            rec.call(_gather_into, columns, per_row[:, :4], at)
        for work, buffers, sums, finish, at, hyper in self.factored:  # the vectors and factors before the updates
            bc2 = finish.view(work.count, len(tf.FINISH_COLUMNS))[:, tf.FINISH_COLUMNS.index("bias_correction2")]
            rec.call(_gather_into, bc2, per_row[:, 4], at)
            rec.call(work.launch, sums, finish, buffers, hyper)
        for kernel, params, ms, vs, steps, lr, options, found in self.fused_calls:
            rec.call(kernel, params, [p.grad for p in params], ms, vs, [], steps, lr=lr, found_inf=found, **options)
        for table, count, _, kind, common, repair, blocks in self.launches:
            rec.call(_launch, table, count, kind, common, repair, blocks)
        n = len(self.params)
        rec.call(self.flags_host[:n].copy_, self.skip, non_blocking=on_gpu)
        rec.call(self.flags_host[n:].copy_, self.found, non_blocking=on_gpu)

    def capture(self) -> None:
        """Record the step (its first replay is the step itself)."""
        self.graph = self.backend.capture(self._body, self.device)
        self.skips.event = self.backend.event(self.device)
        for e, row in zip(self.entries, range(len(self.entries))):
            e.rec.unread_skip = (self.skips, row)

    def fill(self, lrs: Sequence[float], hypers: Sequence[Any]) -> bool:
        """Advance the counts as if every tensor stepped and write the step's columns into the host buffers
        (``lrs``: each part's learning rate, ``hypers``: its hyperparameters); ``False`` (nothing changed) where
        torch's fused kernel cannot take a count (the planned step decides)."""
        array, at = self.array, self.index
        if len(self.fused):
            counts = array[at[self.fused]]
            if ((counts[:, 0] != counts[:, 1]) | (counts[:, 0] + 1 >= MAX_FUSED_STEP)).any():
                return False
        array[at, 0] += 1
        array[at, 1] += self.momentum
        self.stage_int_np.reshape(-1, _STAGE)[:] = step_columns(self.seed, array[at, :2], self.has_m, self.group_of,
                                                                list(hypers), list(lrs), self.salts, self.offsets)
        floats = self.stage_float_np
        if len(self.fused):
            floats[: len(self.fused)] = array[at[self.fused], 0]
        floats[len(self.fused) :] = lrs
        return True

    def replay(self) -> None:
        assert self.graph is not None
        self.graph.replay()
        if self.skips.event is not None:
            self.skips.event.record()
        self.skips.pending = True

    def holds(self, params: list[Tensor]) -> bool:
        """Whether what the graph read is what the step would read: the parameters' data, their gradients'
        addresses and dtypes, contiguous (C-speed checks over the tensors)."""
        if list(map(Tensor.data_ptr, params)) != self.param_addresses:
            return False
        grads = list(map(_grad_of, params))
        try:
            if list(map(Tensor.data_ptr, grads)) != self.grad_addresses:
                return False
        except TypeError:  # a parameter without a gradient
            return False
        return list(map(_dtype_of, grads)) == self.grad_dtypes and all(map(Tensor.is_contiguous, grads))


class GraphSteps:
    """An optimizer's captured step: when to capture (:meth:`observe`), whether a step replays it
    (:meth:`replay`), when to drop it, and when to stop trying (the reason said once).

    ``policy``: ``"auto"`` (CUDA parameters take a graph) or ``"off"``. ``backend_for(device)``: the graph
    backend of a device (:func:`default_backend`; tests give :class:`TapeBackend`)."""

    def __init__(self, policy: str, seed: int, label: str, on_skipped: Callable[[list[Any]], None],
                 describe: Callable[[Tensor], str] = repr) -> None:
        self.policy = policy
        self.describe = describe  # a parameter in a message: its name and format
        self.seed, self.label, self.on_skipped = seed, label, on_skipped
        self.backend_for: Callable[[torch.device], GraphBackend | None] = default_backend
        self.current: GraphStep | None = None
        self.captures = 0  # graphs captured (the first, then each re-capture)
        self.replays = 0
        self.capture_seconds: list[float] = []  # the host's time of each capture
        self.off_reason: str | None = None  # why graphs are off for good (said once)
        self._seen: tuple | None = None  # the last step's signature, and how many steps had it
        self._steady = 0
        self._outside = 0  # steps a graph could not take for parameters outside the plans
        self._stepped_apart: int | None = None  # the generation whose steps another part of the optimizer shares
        self._apart_names: list[str] = []  # and the parameters it steps, for the message
        self.reason_said = False

    @property
    def on(self) -> bool:
        """Whether this optimizer's steps may take a graph (its fused kernel then reads a tensor learning rate)."""
        return self.policy != "off" and self.off_reason is None

    def turn_off(self, reason: str) -> None:
        """Stop capturing, saying why once."""
        self.drop()
        if self.off_reason is None:
            self.off_reason = reason
            warnings.warn(f"{self.label}: the CUDA graph step is off: {reason}. The planned step runs instead "
                          f"(the same results, more host work per tensor).", RuntimeWarning, stacklevel=4)

    def drop(self) -> None:
        """Forget the captured step (its pending skips applied first)."""
        if self.current is not None:
            self.current.skips.release()
            self.current = None
        self._seen, self._steady = None, 0

    def wants_reason(self) -> bool:
        """Whether a step the graph cannot take should name the parameters outside the plans (said once)."""
        return self.on and not self.reason_said and self.current is None

    def apply_skips(self) -> None:
        if self.current is not None:
            self.current.skips.apply()

    # ------------------------------------------------------------------ the optimizer's step

    def replay(self, groups: list[dict[str, Any]], hyper_of: Callable[[Any], Any], generation: int,
               counts: np.ndarray, allowed: bool, found_inf: Tensor | None = None,
               grad_scale: Tensor | None = None) -> bool:
        """Step by the captured graph (capturing it first where it is new) if it holds; ``False``: the planned
        step runs (the graph dropped where something changed). ``generation``: the optimizer's (conversions,
        corrections, loads); ``counts``: its counts' array now; ``allowed``: nothing the graph cannot do (gradient
        release, an atomic step) is on; ``found_inf``, ``grad_scale``: AMP's scaler's (:mod:`lightning_baoc.optim.amp`),
        as the graph was captured with (or none)."""
        g = self.current
        if g is None:
            return False
        if not (allowed and generation == g.generation and counts is g.array and g.amp == amp_mode(found_inf, grad_scale)
                and self._holds(g, groups)):
            self.drop()
            return False
        g.skips.apply()
        hypers = [hyper_of(groups[index]) for index in g.group_indices]
        if g.graph is None:
            if self.captures >= MAX_RECAPTURES:
                self.turn_off(f"captured {self.captures} times already: the gradients change address from step to "
                              f"step (keep them between steps: zero_grad(set_to_none=False))")
                return False
            start = time.perf_counter()
            try:
                g.capture()
            except Exception as err:  # noqa: BLE001 - any capture error turns graphs off; the step runs planned
                self.turn_off(f"capture failed ({type(err).__name__}: {err})")
                return False
            self.captures += 1
            self.capture_seconds.append(time.perf_counter() - start)
        if not g.fill([h.lr for h in hypers], hypers):
            self.drop()  # a count torch's fused kernel cannot take: the planned step decides
            return False
        if found_inf is not None:
            g.found.copy_(found_inf.reshape(1), non_blocking=True)
        if grad_scale is not None:
            g.inverse_scale.copy_(grad_scale.double().reciprocal().float().reshape(()), non_blocking=True)
        g.replay()
        self.replays += 1
        return True

    def _holds(self, g: GraphStep, groups: list[dict[str, Any]]) -> bool:
        """The param groups' parameters and settings (their learning rates aside) as captured, the same
        parameters with gradients, and what the graph read of them."""
        if _groups_snapshot(groups) != g.snapshot:
            return False
        grads = list(map(_grad_of, g.every))
        if sum(map(operator.is_not, grads, _nones(len(grads)))) != len(g.params):
            return False  # a parameter outside the graph has a gradient
        return g.holds(g.params)

    def observe(self, parts: list[tuple[int, Any, Any]], complete: bool, groups: list[dict[str, Any]],
                generation: int, counts: np.ndarray, amp: str = "none", outside: list[str] | None = None) -> None:
        """After a planned step: ``parts`` (per group: its index, hyperparameters and the plan's entries that
        stepped); ``complete``: they were all of the step's parameters. Two such steps in a row with the same
        plans and gradient addresses: the next step is captured (``amp``: :func:`amp_mode` of the step's scaler).
        ``outside``: where the step was not complete, the parameters outside the plans (:meth:`wants_reason`), said
        once after two such steps on a device with graphs."""
        if not self.on or self.current is not None:
            return
        if complete and parts and self._stepped_apart == generation:  # as found below, until the states change
            complete = False
            if outside is None and not self.reason_said:
                outside = self._apart_names
        elif complete and parts:  # every parameter with a gradient among the plans' (another part of the optimizer
            stepped = {id(e.param) for _, _, chosen in parts for e in chosen.entries}  # may step some: offload's)
            missing = [p for group in groups for p in group["params"] if p.grad is not None and id(p) not in stepped]
            if missing:
                complete = False
                self._stepped_apart = generation  # not walked again at each step of this generation
                self._apart_names = [self.describe(p) for p in missing]
                if outside is None and not self.reason_said:
                    outside = self._apart_names
        if not complete or not parts:
            self._seen, self._steady = None, 0
            if outside and parts and self.backend_for(parts[0][2].entries[0].param.device) is not None:
                self._outside += 1
                if self._outside >= STEADY_STEPS:
                    self.reason_said = True
                    shown = ", ".join(outside[:4]) + (f" and {len(outside) - 4} more" if len(outside) > 4 else "")
                    warnings.warn(
                        f"{self.label}: the CUDA graph step does not capture this optimizer's steps: {shown} step "
                        f"outside the device's plans (a format without GPU kernels, a sharded parameter, or a layout "
                        f"the kernels do not take). The planned step runs for the others.", RuntimeWarning, stacklevel=4)
            return
        params = [e.param for _, _, chosen in parts for e in chosen.entries]
        devices = {p.device for p in params}
        if len(devices) != 1:
            self._seen, self._steady = None, 0
            return
        device = next(iter(devices))
        backend = self.backend_for(device)
        if backend is None:
            return
        signature = (generation, amp, tuple(id(chosen.plan) for _, _, chosen in parts), tuple(map(Tensor.data_ptr, params)),
                     tuple(map(Tensor.data_ptr, map(_grad_of, params))))
        self._steady = self._steady + 1 if signature == self._seen else 1
        self._seen = signature
        if self._steady < STEADY_STEPS:
            return
        g = GraphStep(parts, self.seed, backend, self.on_skipped, amp)
        g.generation, g.snapshot = generation, _groups_snapshot(groups)
        g.group_indices = [index for index, _, _ in parts]
        g.every = [p for group in groups for p in group["params"]]
        self.current = g


def amp_mode(found_inf: Tensor | None, grad_scale: Tensor | None) -> str:
    """What AMP's scaler hands a step: nothing, its ``found_inf``, or that and the gradients' scale."""
    return "none" if found_inf is None else "scaled" if grad_scale is not None else "found"


def _groups_snapshot(groups: list[dict[str, Any]]) -> tuple:
    """What a graph holds for of the param groups: each one's parameters and its settings but the learning rate."""
    return tuple((tuple(group["params"]), tuple((k, v) for k, v in group.items() if k not in ("params", "lr")))
                 for group in groups)


def _nones(n: int) -> list[None]:
    return [None] * n


def _skip_flags(grads: list[Tensor], skip: Tensor) -> None:
    """1 in ``skip`` where a gradient holds inf or NaN (:meth:`StepDispatcher._device_flags
    <lightning_baoc.optim.stepping.StepDispatcher._device_flags>`'s arithmetic, written in place)."""
    torch.stack(torch._foreach_norm(grads, ord=float("inf"), dtype=torch.float32), out=skip)
    skip.mul_(0.0).nan_to_num_(nan=1.0)


def _gather_into(columns: Tensor, per_row: Tensor, at: Tensor) -> None:
    columns.copy_(per_row.index_select(0, at))


def _launch(table: Tensor, count: int, kind: Any, common: dict, repair: Tensor | None, blocks: int) -> None:
    # lazy: the Triton step imports triton, an optional dependency
    from lightning_baoc.kernels import triton_step as ts

    ts._adamw_tensors[(blocks,)](table, count, table if repair is None else repair,
                                 **ts.launch_options(kind, count, repair), **common)


__all__ = ["CudaGraphs", "GraphBackend", "GraphSkips", "GraphStep", "GraphSteps", "MAX_RECAPTURES", "Recorder", "STEADY_STEPS",
           "TapeBackend", "default_backend"]
