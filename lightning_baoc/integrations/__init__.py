"""Adapters: the training frameworks' hooks translated into the lifecycle's calls.

- :mod:`lightning_baoc.integrations.callback`: :class:`~lightning_baoc.BAOC`, the Lightning callback;
- :mod:`lightning_baoc.integrations.fabric`: :class:`~lightning_baoc.BAOCStrategy`, for Fabric loops;
- :mod:`lightning_baoc.optim.swap`: the optimizer swap and LR-scheduler rebinding (torch only);
- :mod:`lightning_baoc.integrations.checkpoints`: the metadata of a distributed checkpoint, read before its load;
- :mod:`lightning_baoc.integrations.logs`: the callback's log lines, one per event wherever logging is set up.

The callback and the strategy are the only modules that import Lightning; this package imports
none of them eagerly, so the core (which uses the swap) never loads Lightning.
"""
