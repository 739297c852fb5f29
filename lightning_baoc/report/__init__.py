"""What an allocation is reported as: :mod:`.allocation` writes the rich table, ``baoc_allocation.json`` (its
schema, :data:`~lightning_baoc.report.allocation.ALLOCATION_SCHEMA`), the PNG figure and the logger scalars."""
