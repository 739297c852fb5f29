"""LightningCLI over the example workloads, with BAOC from a config's ``baoc`` section or as a callback.

Any LightningModule / LightningDataModule importable by class path works; ``examples/workloads.py``
has ``ViTDigits``, ``CharGPT``, ``DDPMDigits``, ``DigitsDataModule`` and ``CharDataModule``. Two ways
to add BAOC (use one, not both: one optimizer has one allocation):

1. A template from ``configs/`` (its ``baoc`` section, the vocabulary of the BAOC paper; ``${...}``
   interpolations are resolved, the parser runs in OmegaConf mode):

       python examples/cli.py fit --config configs/vision.yaml
       python examples/cli.py fit --config configs/vision.yaml --baoc.memory_budget=0.25 --trainer.max_steps=200

2. BAOC as a plain Lightning callback, with its own arguments (no ``baoc`` section):

       python examples/cli.py fit --model workloads.ViTDigits --data workloads.DigitsDataModule \\
           --trainer.max_steps=300 --trainer.accelerator=cpu \\
           --trainer.callbacks+=lightning_baoc.BAOC --trainer.callbacks.memory_budget=0.3 \\
           --trainer.callbacks.warmup_steps=100

   With a template, ``--baoc=null`` switches its section off. BAOC's options:
   ``python examples/cli.py fit --trainer.callbacks.help lightning_baoc.BAOC``; the section's:
   ``python examples/cli.py fit --baoc.help``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import lightning as L
from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `workloads` by class path, from anywhere

from lightning_baoc import BAOC  # noqa: E402
from lightning_baoc.config.files import BAOCSection  # noqa: E402


class BAOCLightningCLI(LightningCLI):
    """LightningCLI with an optional ``baoc`` section (:class:`~lightning_baoc.config.files.BAOCSection`).

    The section is parsed, type-checked and validated by jsonargparse like the ``trainer``
    section (an unknown key is an error naming it); when it is set, a
    ``BAOC.from_config(section)`` callback joins the trainer's callbacks.
    """

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument(
            "--baoc",
            type=Optional[BAOCSection],
            default=None,
            help="BAOC settings in the config vocabulary (configs/*.yaml's baoc section); null: none",
        )

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        section = self._get(self.config_init, "baoc")
        if section is not None:
            callbacks = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
            callbacks = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
            if any(isinstance(cb, BAOC) for cb in callbacks):
                raise ValueError(
                    "BAOC is configured twice: by the baoc section and in trainer.callbacks. Keep one: drop "
                    "--trainer.callbacks+=lightning_baoc.BAOC, or pass --baoc=null"
                )
            kwargs["callbacks"] = [*callbacks, *kwargs.get("callbacks", []), BAOC.from_config(section)]
        return super().instantiate_trainer(**kwargs)


def main(args: list[str] | None = None, run: bool = True) -> BAOCLightningCLI:
    """Build (and with ``run``, run) the CLI; ``args`` as on the command line (default: ``sys.argv``)."""
    return BAOCLightningCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf"},
        # the templates fix default_root_dir (logger: false, so no version_N folder): a rerun of the
        # same command replaces the config.yaml saved there, as it replaces the BAOC report beside it
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


if __name__ == "__main__":
    main()
