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

A typo in the ``baoc`` or ``trainer`` section of a config file, in a BAOC's ``init_args`` under
``trainer.callbacks``, or in a ``--baoc.*`` / ``--trainer.*`` / ``--trainer.callbacks.*`` argument stops the
CLI with every error found, each with its closest known key and what to write instead, a line each
(:meth:`BAOCLightningCLI.parse_arguments`)::

    cli.py: error: argument '--trainer.callbacks.warmup_stepz=100': trainer.callbacks.warmup_stepz: unknown key (did you mean trainer.callbacks.warmup_steps?); write --trainer.callbacks.warmup_steps=100

    cli.py: error: 2 errors in the LightningCLI config:
      my.yaml: baoc.sampel_every: unknown key (did you mean baoc.sample_every?); rename sampel_every to sample_every
      my.yaml: trainer.max_step: unknown key (did you mean trainer.max_steps?): not an argument of lightning.Trainer; rename max_step to max_steps
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, NoReturn, Optional

import lightning as L
import yaml
from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `workloads` by class path, from anywhere

from lightning_baoc import BAOC  # noqa: E402
from lightning_baoc.config.files import (  # noqa: E402
    BAOC_CLASS_PATHS,
    BAOCSection,
    ConfigError,
    lightning_cli_errors,
    parse_section,
)

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


class CLIInput(NamedTuple):
    """One input of a command line that can hold BAOC settings or trainer keys
    (:func:`~lightning_baoc.config.files.lightning_cli_errors`' arguments)."""

    source: str  #: the file, or ``"argument '--k=v'"``
    data: Any  #: the input as a config
    argument: Optional[str] = None  #: the argument as written (``None`` for a file)
    callback: Optional[str] = None  #: the class path of the callback a ``--trainer.callbacks.KEY`` sets


def _last_callback(value: Any) -> Optional[str]:
    """The class path of the last callback in a ``trainer.callbacks`` value (a class path, a mapping
    with ``class_path``, or a list of them), or ``None``."""
    if isinstance(value, list):
        value = value[-1] if value else None
    if isinstance(value, Mapping):
        value = value.get("class_path")
    return value if isinstance(value, str) else None


def _nested(parts: Sequence[str], value: Any) -> Any:
    """``{"a": {"b": value}}`` for ``["a", "b"]``."""
    for part in reversed(parts):
        value = {part: value}
    return value


def cli_inputs(args: Sequence[str]) -> list[CLIInput]:
    """The inputs of a command line that hold BAOC settings or trainer keys, each with its source:
    every ``--config`` file, and every ``--baoc...`` / ``--trainer.<key>`` argument as a one-key config.

    A ``--trainer.callbacks.KEY`` (or ``.init_args.KEY``) argument sets an argument of the last callback
    added before it (jsonargparse's rule: ``--trainer.callbacks+=CLASS``, or the last of a config file's
    ``trainer.callbacks``): when that is BAOC, its key and value are checked as BAOC's settings.

    Example:
        >>> args = ["fit", "--baoc.sample_every=5", "--trainer.max_step", "3",
        ...         "--trainer.callbacks+=lightning_baoc.BAOC", "--trainer.callbacks.warmup_stepz=100"]
        >>> for item in cli_inputs(args):
        ...     print(item.source, item.data, item.callback)
        argument '--baoc.sample_every=5' {'baoc': {'sample_every': 5}} None
        argument '--trainer.max_step 3' {'trainer': {'max_step': None}} None
        argument '--trainer.callbacks.warmup_stepz=100' {'trainer': {'callbacks': {'warmup_stepz': 100}}} lightning_baoc.BAOC
    """
    out: list[CLIInput] = []
    args = list(args)
    callback: Optional[str] = None  # the last callback added so far: what --trainer.callbacks.KEY sets
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
                out.append(CLIInput(value, data))
                trainer = data.get("trainer") if isinstance(data, Mapping) else None
                if isinstance(trainer, Mapping) and trainer.get("callbacks") is not None:
                    callback = _last_callback(trainer["callbacks"])
            continue
        parts = option[2:].split(".")
        if parts[0] not in ("baoc", "trainer") or parts[-1] == "help" or (len(parts) == 1 and value is None):
            continue
        if len(parts) == 1:  # --baoc FILE_OR_YAML, --trainer FILE_OR_YAML
            data = _config_file(value) if Path(value).is_file() else _yaml_value(value)
            node: Any = data if isinstance(data, Mapping) else None
        elif parts[0] == "trainer" and parts[1].rstrip("+") == "callbacks":
            if len(parts) == 2:  # --trainer.callbacks+=CLASS (or =CLASS, a mapping, a list): the last one added
                callback = _last_callback(_yaml_value(value)) if value is not None else None
                continue
            if callback not in BAOC_CLASS_PATHS:  # another callback's argument: jsonargparse's to check
                continue
            node = {"callbacks": _nested(parts[2:], _yaml_value(value) if value is not None else None)}
            out.append(CLIInput(f"argument {shown!r}", {"trainer": node}, shown, callback))
            continue
        elif parts[0] == "trainer":  # only the key is checked: its value is Trainer's
            node = {parts[1].rstrip("+"): None}
        else:
            node = _nested(parts[1:], _yaml_value(value) if value is not None else None)
        if node is not None:
            out.append(CLIInput(f"argument {shown!r}", {parts[0]: node}, shown))
    return out


class BAOCLightningCLI(LightningCLI):
    """LightningCLI with an optional ``baoc`` section (:class:`~lightning_baoc.config.files.BAOCSection`),
    whose errors are reported all at once, each with its suggestion.

    The section is parsed and type-checked by jsonargparse like the ``trainer`` section; when it is
    set, a ``BAOC.from_config(section)`` callback joins the trainer's callbacks.

    Why the check before parsing: jsonargparse stops at the first error and prints its whole usage
    (about 60 lines for LightningCLI) above an error that names no close key, so a typo and its fix
    get lost (``--trainer.callbacks.warmup_stepz=100`` gets "Option 'warmup_stepz' is not accepted",
    once for each callback class it tried). :meth:`parse_arguments` first runs the config loader's own
    checks (:func:`~lightning_baoc.config.files.lightning_cli_errors`) on every input that can hold BAOC
    settings or trainer keys (each ``--config`` file, each ``--baoc.*`` / ``--trainer.*`` argument, each
    ``--trainer.callbacks.*`` argument that sets a BAOC: :func:`cli_inputs`): unknown keys with their
    closest known key and the argument to write (or, in a file, the key to rename), 0.1.0's nested keys
    with the key that replaced each, bad values with the setting's message. Any error: all of them are printed,
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
            inputs = [CLIInput("<args>", args.as_dict() if hasattr(args, "as_dict") else args)]
        errors = [
            err
            for item in inputs
            for err in lightning_cli_errors(item.data, item.source, argument=item.argument, callback=item.callback)
        ]
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
