"""Class aliases of :class:`~lightning_baoc.optim.BlockwiseAdamW` named like the user's optimizer class.

BAOC installs a BlockwiseAdamW in place of the user's ``torch.optim.AdamW``; the alias keeps the class
name (``LearningRateMonitor``'s metric names) and pickles by reference to the public path.
"""

from __future__ import annotations

from lightning_baoc.optim.optimizer import PUBLIC_MODULE, BlockwiseAdamW

_ALIAS_PREFIX = "_BlockwiseAs"
_ALIASES: dict[str, type[BlockwiseAdamW]] = {}


def optimizer_alias(name: str) -> type[BlockwiseAdamW]:
    """A BlockwiseAdamW subclass whose ``__name__`` is ``name`` (the user's optimizer class name).

    ``LearningRateMonitor`` names its metrics ``"lr-" + type(optimizer).__name__`` (``lr-AdamW/pg1``):
    an optimizer installed in place of the user's keeps the metric names. The class is
    ``lightning_baoc.optim._BlockwiseAs<name>``, resolved by ``lightning_baoc.optim.__getattr__``, so
    instances and the class itself pickle by reference and unpickle in a fresh process.

    Example:
        >>> optimizer_alias("AdamW").__name__, optimizer_alias("AdamW").__qualname__
        ('AdamW', '_BlockwiseAsAdamW')
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"Invalid optimizer class name {name!r}; expected a Python identifier")
    alias = _ALIASES.get(name)
    if alias is None:
        alias = type(
            name,
            (BlockwiseAdamW,),
            {"__module__": PUBLIC_MODULE, "__qualname__": _ALIAS_PREFIX + name, "__doc__": f"BlockwiseAdamW installed in place of {name}."},
        )
        _ALIASES[name] = alias
    return alias


def resolve_alias(attr: str) -> type[BlockwiseAdamW]:
    """The ``_BlockwiseAs<name>`` alias class named ``attr`` (for unpickling in a fresh process).

    Raises:
        AttributeError: ``attr`` names no alias.
    """
    if attr.startswith(_ALIAS_PREFIX) and attr[len(_ALIAS_PREFIX) :].isidentifier():
        return optimizer_alias(attr[len(_ALIAS_PREFIX) :])
    raise AttributeError(f"module {PUBLIC_MODULE!r} has no attribute {attr!r}")
