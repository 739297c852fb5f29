"""The routes of the optimizer step as a test axis (``tests/optim/test_routes.py``, ``test_routes_sharded.py``).

- ``"eager"``: each format's own ``update`` (``kernels="eager"``), the reference every route is held to;
- ``"compiled"``: the compiled CPU kernels (``kernels="compiled"``);
- ``"device"``: the GPU's route (the device's planned step: the Triton kernels, torch's fused AdamW for fp32
  tensors, skips decided by the device's flags), taken by CPU tensors through Triton's interpreter
  (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``);
- ``"graph"``: the device route with its step captured and replayed (the tape backend of
  :mod:`lightning_baoc.optim.graph_step`, a CUDA graph's semantics).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from support_formats import unavailable

from lightning_baoc import kernels

ROUTES = ("eager", "compiled", "device", "graph")
#: each route's attribute of a format's Parity (the device's route runs the Triton kernels)
PARITY_OF = {"compiled": "compiled", "device": "triton", "graph": "triton"}
#: each route's kernel policy (``BlockwiseAdamW(kernels=...)``)
POLICY = {"eager": "eager", "compiled": "compiled", "device": "auto", "graph": "auto"}


def route_unavailable(route: str) -> str | None:
    """Why ``route`` cannot run here (``None``: it can)."""
    if route == "eager":
        return None
    return unavailable("compiled" if route == "compiled" else "triton")


@contextlib.contextmanager
def on_route(route: str) -> Iterator[None]:
    """CPU parameters take ``route``'s kernels while the block runs (the device's: the Triton kernels and torch's
    fused AdamW, not the compiled C++ ones)."""
    if route not in ("device", "graph"):
        yield
        return
    import lightning_baoc.optim.stepping as stepping

    saved = kernels.TRITON_DEVICES, stepping.kernel_serves
    kernels.TRITON_DEVICES, stepping.kernel_serves = {"cuda", "cpu"}, (lambda *args: False)
    try:
        yield
    finally:
        kernels.TRITON_DEVICES, stepping.kernel_serves = saved


def set_graphs(opt: Any, route: str) -> None:
    """``opt``'s step captured and replayed on the graph route (the tape backend); the planned step alone on the
    device route."""
    from lightning_baoc.optim import graph_step

    if route == "graph":
        tape = graph_step.TapeBackend()
        opt._stepper.graphs.backend_for = lambda device: tape  # noqa: SLF001
    elif route == "device":
        opt._stepper.graphs.backend_for = lambda device: None  # noqa: SLF001 - the planned step only
