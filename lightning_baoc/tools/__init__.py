"""Tools around training: the pre-training checklist (:mod:`~lightning_baoc.tools.check`), the
memory planner (:mod:`~lightning_baoc.tools.plan`) and its built-in models
(:mod:`~lightning_baoc.tools.presets`); the ``lightning-baoc`` command line runs them."""
