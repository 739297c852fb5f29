"""BAOC's settings and config files: every setting declared once, and the YAML that holds them.

- :mod:`.settings`: :data:`~lightning_baoc.config.settings.SETTINGS`, the table of every setting
  (argument name, config key, type, default, range, help), :class:`~lightning_baoc.BAOCConfig` and the
  one validator, :func:`~lightning_baoc.config.settings.check_settings`;
- :mod:`.files`: the ``baoc`` section of a config file as typed dataclasses, loading with OmegaConf
  dotlist overrides, and the JSON Schema (:func:`~lightning_baoc.json_schema`).
"""
