"""Tools around training: the pre-training checklist (:mod:`~lightning_baoc.tools.check`, its
memory-budget line in :mod:`~lightning_baoc.tools.budget_check`), the
memory planner (:mod:`~lightning_baoc.tools.plan`) and its built-in models
(:mod:`~lightning_baoc.tools.presets`); the ``lightning-baoc`` command line runs them."""
