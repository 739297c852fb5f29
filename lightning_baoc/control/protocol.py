"""The rank-zero protocol: decisions are computed on rank zero and handed to every rank.

Every rank runs the same lifecycle calls; a decision (the feasibility check, an allocation) is
computed on rank zero only and broadcast through the callable the adapter passes
(``strategy.broadcast``). An error on rank zero is broadcast too and raised on every rank, so no
rank is left waiting on a broadcast that never comes.
"""

from __future__ import annotations

from typing import Any, Callable

from lightning_baoc.solver import BudgetInfeasibleError

#: ``broadcast(obj) -> obj`` from rank zero (``strategy.broadcast``); identity on one process.
Broadcast = Callable[[Any], Any]


def _error_payload(err: BaseException) -> dict[str, Any]:
    if isinstance(err, BudgetInfeasibleError):
        attrs = {k: getattr(err, k) for k in ("memory_budget", "time_budget", "min_memory", "min_time", "exact", "fp32_memory", "fp32_time")}
        return {"infeasible": str(err), "attrs": attrs}
    return {"error": f"{type(err).__name__}: {err}"}


def decide_on_rank_zero(fn: Callable[[], Any], broadcast: Broadcast | None, is_global_zero: bool) -> Any:
    """Run ``fn`` on rank zero, broadcast its result (or its error) and return it on every rank.

    Every rank must call this at the same point. An error raised on rank zero is raised on every
    rank (a :class:`BudgetInfeasibleError` with its attributes; anything else as a
    ``RuntimeError`` naming it), so no rank waits forever on a broadcast that never comes.

    Example:
        >>> decide_on_rank_zero(lambda: {"a": "int8"}, broadcast=None, is_global_zero=True)
        {'a': 'int8'}
    """
    payload: dict[str, Any] | None = None
    local: BaseException | None = None
    if is_global_zero:
        try:
            payload = {"ok": fn()}
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            local = err
            payload = _error_payload(err)
    if broadcast is not None:
        payload = broadcast(payload)
    if payload is None:  # pragma: no cover - a broadcast that returned nothing
        raise RuntimeError("BAOC: rank zero's decision did not arrive (broadcast returned None)")
    if "ok" in payload:
        return payload["ok"]
    if local is not None:
        raise local
    if "infeasible" in payload:
        raise BudgetInfeasibleError(payload["infeasible"], **payload["attrs"])
    raise RuntimeError(f"BAOC: the allocation failed on rank zero: {payload['error']}")


__all__ = ["Broadcast", "decide_on_rank_zero"]
