"""LightningCLI over the example workloads, with BAOC from a config's ``baoc`` section or as a callback.

Any LightningModule / LightningDataModule importable by class path works; ``examples/workloads.py``
has ``ViTDigits``, ``CharGPT``, ``DDPMDigits``, ``DigitsDataModule`` and ``CharDataModule``. Two ways
to add BAOC (use one, not both: one optimizer has one allocation):

1. A template from ``configs/`` (its ``baoc`` section, whose keys are BAOC's arguments; ``${...}``
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

A typo in the ``baoc`` or ``trainer`` section of a config file (or in a ``--baoc.*`` / ``--trainer.*``
argument) stops the CLI with every error found, each with its closest known key, in a few lines
(:meth:`BAOCLightningCLI.parse_arguments`)::

    cli.py: error: 2 errors in the LightningCLI config:
      my.yaml: baoc.sampel_every: unknown key (did you mean baoc.sample_every?)
      my.yaml: trainer.max_step: unknown key (did you mean trainer.max_steps?): not an argument of lightning.Trainer
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, Optional

import lightning as L
import yaml
from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `workloads` by class path, from anywhere

from lightning_baoc import BAOC  # noqa: E402
from lightning_baoc.config.files import BAOCSection, ConfigError, lightning_cli_errors, parse_section  # noqa: E402

#: Where the checked errors are said to be, in the heading of several.
WHERE = "the LightningCLI config"
#: The source named by an error of the section jsonargparse merged.
MERGED = "the baoc section (--config files and --baoc arguments merged)"


def _yaml_value(text: str) -> Any:
    """A command-line value as jsonargparse reads it: YAML (``0.25``, ``[fp32,int8]``, ``null``), else the text."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _config_file(path: str) -> Any:
    """A ``--config`` file as OmegaConf reads it (interpolations resolved); ``None`` if it does not load
    (jsonargparse then says why)."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception:  # noqa: BLE001 - a missing file, bad YAML, an interpolation: jsonargparse's to report
        return None


def cli_inputs(args: Sequence[str]) -> list[tuple[str, Any]]:
    """The inputs of a command line that hold BAOC settings or trainer keys, each with its source:
    every ``--config`` file, and every ``--baoc...`` / ``--trainer.<key>`` argument as a one-key config.

    Example:
        >>> for source, data in cli_inputs(["fit", "--baoc.sample_every=5", "--trainer.max_step", "3"]):
        ...     print(source, data)
        argument '--baoc.sample_every=5' {'baoc': {'sample_every': 5}}
        argument '--trainer.max_step 3' {'trainer': {'max_step': None}}
    """
    out: list[tuple[str, Any]] = []
    args = list(args)
    for i, arg in enumerate(args):
        if not arg.startswith("-"):
            continue
        option, eq, text = arg.partition("=")
        following = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        value = text if eq else following
        shown = arg if eq or following is None else f"{arg} {following}"
        if option in ("--config", "-c") and value is not None:
            data = _config_file(value)
            if data is not None:
                out.append((value, data))
            continue
        parts = option[2:].split(".")
        if parts[0] not in ("baoc", "trainer") or parts[-1] == "help" or (len(parts) == 1 and value is None):
            continue
        if len(parts) == 1:  # --baoc FILE_OR_YAML, --trainer FILE_OR_YAML
            data = _config_file(value) if Path(value).is_file() else _yaml_value(value)
            node: Any = data if isinstance(data, Mapping) else None
        elif parts[0] == "trainer":  # only the key is checked: its value is Trainer's
            node = {parts[1].rstrip("+"): None}
        else:
            node = _yaml_value(value) if value is not None else None
            for part in reversed(parts[2:]):
                node = {part: node}
            node = {parts[1]: node}
        if node is not None:
            out.append((f"argument {shown!r}", {parts[0]: node}))
    return out


class BAOCLightningCLI(LightningCLI):
    """LightningCLI with an optional ``baoc`` section (:class:`~lightning_baoc.config.files.BAOCSection`),
    whose errors are reported all at once, each with its suggestion.

    The section is parsed and type-checked by jsonargparse like the ``trainer`` section; when it is
    set, a ``BAOC.from_config(section)`` callback joins the trainer's callbacks.

    Why the check before parsing: jsonargparse stops at the first error and prints its whole usage
    (about 50 lines for LightningCLI) above an error that names no close key, so a typo and its fix
    get lost. :meth:`parse_arguments` first runs the config loader's own checks
    (:func:`~lightning_baoc.config.files.lightning_cli_errors`) on every input that can hold BAOC
    settings or trainer keys (each ``--config`` file, each ``--baoc.*`` / ``--trainer.*`` argument:
    :func:`cli_inputs`): unknown keys with their closest known key, 0.1.0's nested keys with the key
    that replaced each, bad values with the setting's message. Any error: all of them are printed,
    each naming its file or argument, and the CLI exits with code 2 before jsonargparse parses. Each
    input is checked alone, since jsonargparse merges them; a missing setting and the rules between
    settings are checked on the merged section when the callback is built
    (:meth:`instantiate_trainer`), and reported the same way. The rest (model, data, optimizer
    sections) is jsonargparse's.
    """

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument(
            "--baoc",
            type=Optional[BAOCSection],
            default=None,
            help="BAOC settings, keys as BAOC's arguments (configs/*.yaml's baoc section); null: none",
        )

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Check the BAOC settings and trainer keys of every input (see the class), then parse."""
        if args is None or isinstance(args, (list, tuple)):
            inputs = cli_inputs(sys.argv[1:] if args is None else [str(a) for a in args])
        else:  # a dict or a jsonargparse Namespace: the config itself
            inputs = [("<args>", args.as_dict() if hasattr(args, "as_dict") else args)]
        errors = [err for source, data in inputs for err in lightning_cli_errors(data, source)]
        if errors:
            self._stop(ConfigError.of(errors, WHERE))
        super().parse_arguments(parser, args)

    def _stop(self, err: ConfigError) -> NoReturn:
        """Exit as jsonargparse does on bad input (code 2), with ``err``'s lines and no usage text."""
        prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "cli.py"
        print(f"{prog}: error: {err}", file=sys.stderr)
        raise SystemExit(2)

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
            try:  # the merged section: a missing setting, the rules between settings
                checked = parse_section(dataclasses.asdict(section), source=MERGED)
            except ConfigError as err:
                self._stop(err)
            kwargs["callbacks"] = [*callbacks, *kwargs.get("callbacks", []), BAOC.from_config(checked)]
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
