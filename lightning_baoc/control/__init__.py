"""The BAOC lifecycle (:class:`~lightning_baoc.control.controller.BAOCController`) and the parts it is
composed of, each a class with its own interface: the partition (:mod:`.blocks`), its tables and
problem (:mod:`.tables`), the instruments on the gradients (:mod:`.instrumentation`,
:mod:`.released_gradients`), the options (:mod:`.options`), the risk (:mod:`.scoring`), the start
allocation (:mod:`.start`), the triggers (:mod:`.triggers`) and the state dict's codec
(:mod:`.checkpoint`); and its pure pieces: the event an allocation reports (:mod:`.events`), the run's
figures as one public record (:mod:`.summary`, which the reports and the loggers name alike), the
rank-zero protocol (:mod:`.protocol`) and the decision with its risk cap and hysteresis
(:mod:`.decision`).
"""
