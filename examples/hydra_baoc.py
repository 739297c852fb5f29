"""Train an example workload with BAOC from a Hydra config: the templates in ``configs/`` as they are.

Hydra composes ``configs/<name>.yaml`` with command-line overrides (the same dotlists that
``lightning_baoc.config.files.load_config`` takes without Hydra; the keys are BAOC's arguments:
``baoc.sample_every=5``); the composed config is validated by ``lightning_baoc.config.files.parse_config``
(every unknown key and bad value at once, each named), the BAOC callback comes from
``BAOC.from_config``, and the model and data from the config's ``model`` / ``data`` sections
(``examples/workloads.py``). Hydra is optional: ``pip install hydra-core`` (or
``pip install -e ".[examples]"``). About a minute on 2 CPU cores:

    python examples/hydra_baoc.py                                        # configs/vision.yaml, 300 steps
    python examples/hydra_baoc.py baoc.memory_budget=0.25 trainer.max_steps=200
    python examples/hydra_baoc.py --config-name language baoc.max_block_risk=0.05
    python examples/hydra_baoc.py --config-name diffusion --multirun baoc.memory_budget=0.5,0.35,0.25

Hydra's own output (logs, the composed config) goes to ``lightning_logs/hydra/`` unless
``hydra.run.dir`` / ``hydra.sweep.dir`` are given.

A typo in an override, with Hydra's ``+`` or without, stops the script before Hydra composes anything,
with one line that names the key, the key meant and the override to write (``+`` only where the
template lacks the key), and exit code 2 (:func:`check_overrides`)::

    hydra_baoc.py: error: override 'baoc.memory_budgett=0.25': baoc.memory_budgett: unknown key (did you mean baoc.memory_budget?); write baoc.memory_budget=0.25

Without it, Hydra answers ``baoc.memory_budgett=0.25`` with its advice to append the key
(``+baoc.memory_budgett=0.25``), and that typo then reaches the config. A bad value (or anything else
the loader refuses in the composed config) is reported the same way, naming its override, without a
traceback. Each log line prints once (:func:`lightning_logs_once`).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # `workloads` by class path

try:
    import hydra
except ImportError:  # an optional dependency: say how to get it
    hydra = None

MISSING_HYDRA = (
    "examples/hydra_baoc.py needs Hydra, an optional dependency: pip install hydra-core "
    '(or pip install -e ".[examples]"). Without Hydra, the same configs and dotlist overrides load with '
    "lightning_baoc.config.files.load_config('configs/vision.yaml', ['baoc.memory_budget=0.25'])."
)


CONFIGS = HERE.parent / "configs"


def stop(error: Exception) -> NoReturn:
    """Exit on bad input (code 2) with ``error``'s lines after the script's name, and no traceback."""
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "hydra_baoc.py"
    print(f"{prog}: error: {error}", file=sys.stderr)
    raise SystemExit(2)


def check_overrides(args: Sequence[str]) -> None:
    """Stop (:func:`stop`) on any unknown key among the command line's overrides, before Hydra composes.

    Hydra's own parser reads the command line (as :func:`hydra.main` will), the template it names is
    read for its keys, and :func:`lightning_baoc.config.files.override_errors` checks every override's
    key: the key meant, and the override to write, with Hydra's ``+`` exactly when the template lacks
    that key. Values are checked once composed (:func:`train`), since a sweep is no value yet.
    """
    from hydra._internal.utils import get_args_parser  # the parser hydra.main itself uses
    from omegaconf import OmegaConf

    from lightning_baoc.config.files import ConfigError, override_errors

    parsed = get_args_parser().parse_args(list(args))
    if parsed.help or parsed.hydra_help or parsed.shell_completion or parsed.experimental_rerun:
        return
    folder = Path(parsed.config_path) if parsed.config_path else CONFIGS
    if not folder.is_absolute():
        folder = HERE / folder  # as hydra.main reads it: relative to this file
    try:
        primary: Any = OmegaConf.to_container(OmegaConf.load(folder / f"{parsed.config_name or 'vision'}.yaml"))
    except Exception:  # noqa: BLE001 - a missing or broken template: Hydra says so; the overrides are kept as written
        primary = None
    errors = override_errors(parsed.overrides, primary)
    if errors:
        stop(ConfigError.of(errors, "the overrides"))


def lightning_logs_once() -> None:
    """Leave Lightning's lines to the handlers Hydra configured, so that each prints once.

    The ``lightning`` package gives its logger a console handler of its own (``lightning.pytorch`` and
    ``lightning.fabric`` do too when they are imported before logging is configured) and lets records
    propagate to the root logger, where Hydra's handlers print them again (and write them to the run's
    log file). Under Hydra those handlers are dropped. BAOC's own lines need nothing: its logger writes
    only where nothing else would (:mod:`lightning_baoc.integrations.logs`).
    """
    import logging

    import lightning  # noqa: F401 - its handlers are added at import

    if not logging.getLogger().handlers:  # logging not configured (hydra/job_logging=none): keep Lightning's
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in [h for h in logger.handlers if type(h) is logging.StreamHandler]:
            logger.removeHandler(handler)
        logger.propagate = True


def train(cfg: Any, overrides: Sequence[str] = ()) -> dict[str, float]:
    """Validate a composed config, build BAOC, the model and the data, train; return the metrics.

    ``overrides``: the ones Hydra applied (``HydraConfig.get().overrides.task``), named by the errors
    of the keys they set.
    """
    import lightning as L

    from lightning_baoc import BAOC
    from lightning_baoc.config.files import parse_config
    from lightning_baoc.tools.check import build_component

    config = parse_config(cfg, source="the Hydra config", overrides=overrides)
    if config.model is None or config.data is None:
        raise SystemExit("the config needs model and data sections (class_path, init_args) to train")
    if config.seed_everything is not None:
        L.seed_everything(config.seed_everything)
    baoc = BAOC.from_config(config)
    module = build_component(config.model, device="cpu")
    data = build_component(config.data, device="cpu", section="data")
    trainer = L.Trainer(**config.trainer, callbacks=[baoc])
    trainer.fit(module, data)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    s = baoc.summary()
    print(f"{config.model.class_path}: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())))
    print(f"optimizer state: {s.state_bytes:,} bytes ({s.state_fraction:.3f} of AdamW's {s.baseline_state_bytes:,}); "
          f"allocation: {baoc.allocation}")
    return metrics


def task(cfg: Any) -> dict[str, float]:
    """The Hydra task: :func:`train` with Hydra's overrides named in errors, one line per log event,
    and a config error as one line (:func:`stop`) rather than Hydra's report of an exception."""
    from hydra.core.hydra_config import HydraConfig

    from lightning_baoc.config.files import ConfigError

    lightning_logs_once()
    try:
        return train(cfg, overrides=HydraConfig.get().overrides.task)
    except ConfigError as err:
        stop(err)


def main() -> None:
    """Hydra's entry point (``configs/vision.yaml`` unless ``--config-name`` says otherwise)."""
    if hydra is None:
        print(MISSING_HYDRA, file=sys.stderr)
        raise SystemExit(2)
    args = sys.argv[1:]
    check_overrides(args)
    if not any(a.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for a in args):
        sys.argv += ["hydra.run.dir=lightning_logs/hydra/${now:%Y-%m-%d_%H-%M-%S}", "hydra.sweep.dir=lightning_logs/hydra/multirun"]
    entry = hydra.main(version_base=None, config_path=str(CONFIGS), config_name="vision")(task)
    entry()


if __name__ == "__main__":
    main()
