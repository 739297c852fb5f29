"""Integrations with training frameworks and with torch's training utilities.

- :mod:`lightning_baoc.integrations.swap`: the optimizer swap and LR-scheduler rebinding (torch only).

The Lightning callback (:mod:`lightning_baoc.callback`) and the Fabric strategy
(:mod:`lightning_baoc.fabric`) are the only modules that import Lightning; nothing here imports
them eagerly, so the core never loads Lightning.
"""
