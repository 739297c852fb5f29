"""Class aliases of the blockwise optimizers named like the user's optimizer class.

BAOC installs a :class:`~lightning_baoc.optim.BlockwiseAdamW` in place of the user's
``torch.optim.AdamW`` (a :class:`~lightning_baoc.optim.BlockwiseSGD` in place of a ``torch.optim.SGD``);
the alias keeps the class name (``LearningRateMonitor``'s metric names) and pickles by reference to
the public path.
"""

from __future__ import annotations

from lightning_baoc.optim.optimizer import PUBLIC_MODULE, BlockwiseAdamW, BlockwiseOptimizer
from lightning_baoc.optim.sgd_lion import BlockwiseSGD

#: Alias class-name prefix of each base class (AdamW's keeps the prefix older pickles name).
_PREFIXES: dict[str, type[BlockwiseOptimizer]] = {"_BlockwiseAs": BlockwiseAdamW, "_BlockwiseSGDAs": BlockwiseSGD}
_ALIASES: dict[tuple[str, str], type[BlockwiseOptimizer]] = {}


def optimizer_alias(name: str, base: type[BlockwiseOptimizer] = BlockwiseAdamW) -> type[BlockwiseOptimizer]:
    """A subclass of ``base`` (BlockwiseAdamW or BlockwiseSGD) whose ``__name__`` is ``name`` (the
    user's optimizer class name).

    ``LearningRateMonitor`` names its metrics ``"lr-" + type(optimizer).__name__`` (``lr-AdamW/pg1``):
    an optimizer installed in place of the user's keeps the metric names. The class is
    ``lightning_baoc.optim._BlockwiseAs<name>`` (``_BlockwiseSGDAs<name>`` for BlockwiseSGD), resolved
    by ``lightning_baoc.optim.__getattr__``, so instances and the class itself pickle by reference and
    unpickle in a fresh process.

    Example:
        >>> optimizer_alias("AdamW").__name__, optimizer_alias("AdamW").__qualname__
        ('AdamW', '_BlockwiseAsAdamW')
        >>> optimizer_alias("SGD", BlockwiseSGD).__qualname__
        '_BlockwiseSGDAsSGD'
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"Invalid optimizer class name {name!r}; expected a Python identifier")
    prefix = next((p for p, cls in _PREFIXES.items() if cls is base), None)
    if prefix is None:
        raise ValueError(f"no aliases of {base.__name__}; allowed bases: {[c.__name__ for c in _PREFIXES.values()]}")
    alias = _ALIASES.get((prefix, name))
    if alias is None:
        alias = type(
            name,
            (base,),
            {"__module__": PUBLIC_MODULE, "__qualname__": prefix + name, "__doc__": f"{base.__name__} installed in place of {name}."},
        )
        _ALIASES[(prefix, name)] = alias
    return alias


def resolve_alias(attr: str) -> type[BlockwiseOptimizer]:
    """The ``_BlockwiseAs<name>`` / ``_BlockwiseSGDAs<name>`` alias class named ``attr`` (for
    unpickling in a fresh process).

    Raises:
        AttributeError: ``attr`` names no alias.
    """
    for prefix, base in _PREFIXES.items():
        if attr.startswith(prefix) and attr[len(prefix) :].isidentifier():
            return optimizer_alias(attr[len(prefix) :], base)
    raise AttributeError(f"module {PUBLIC_MODULE!r} has no attribute {attr!r}")
