"""The parts of the BAOC lifecycle (:class:`~lightning_baoc.control.controller.BAOCController`): the event
an allocation reports (:mod:`.events`), the rank-zero protocol (:mod:`.protocol`), the decision
with its risk cap and hysteresis (:mod:`.decision`) and the checkpointed state (:mod:`.checkpoint`).
"""
