"""The model a tool works on: a config's ``model`` section, a preset or a ``package.module:factory``,
built on the ``meta`` device (shapes only), and the training device a config names.

The templates ship as a pair: ``configs/vision.yaml`` names ``workloads.ViTDigits``, which lives in
``examples/workloads.py``. A config's class path that is not importable from the Python path is
therefore also looked for in the ``examples/`` folder beside the config's folder
(:func:`example_folder`), and the tool says where it took it from; anything else still needs its
directory on ``PYTHONPATH`` (the error says so).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_baoc.config.files import ComponentConfig, Config
from lightning_baoc.tools.presets import build_model

#: The folder beside a template's ``configs/`` folder that holds the code its class paths name.
EXAMPLES = "examples"


def example_folder(class_path: str, config_path: str | os.PathLike[str] | None) -> Path | None:
    """The ``examples/`` folder beside the folder of ``config_path`` where ``class_path``'s top-level
    module is, when it is not importable from the Python path; ``None`` otherwise.

    Example:
        >>> example_folder("torch.nn.Linear", "configs/vision.yaml") is None  # importable as it is
        True
    """
    if config_path is None:
        return None
    top = class_path.split(".", 1)[0]
    if not top or importlib.util.find_spec(top) is not None:
        return None
    folder = Path(config_path).resolve().parent.parent / EXAMPLES
    return folder if (folder / f"{top}.py").is_file() or (folder / top / "__init__.py").is_file() else None


def build_component(
    component: ComponentConfig, device: str | torch.device = "meta", section: str = "model",
    search: Sequence[str | os.PathLike[str]] = (),
) -> Any:
    """Instantiate a config's ``model`` (or ``data``) section, ``class_path(**init_args)``, on ``device``.

    Args:
        component: the section.
        device: the default torch device while it is built (default: ``"meta"``: shapes only).
        section: the section's name, for error messages (default: ``"model"``).
        search: folders to import from besides the Python path, while it is built (default: none;
            the tools pass :func:`example_folder`'s).

    Raises:
        ValueError: the class cannot be imported (the message says how to make it importable),
            or the call fails.

    Example:
        >>> build_component(ComponentConfig("torch.nn.Linear", {"in_features": 4, "out_features": 2})).weight.device
        device(type='meta')
    """
    added = [os.fspath(f) for f in search if os.fspath(f) not in sys.path]
    sys.path[:0] = added
    try:
        return _build_component(component, device, section)
    finally:
        for folder in added:
            sys.path.remove(folder)


def _build_component(component: ComponentConfig, device: str | torch.device, section: str) -> Any:
    where = f"{section}.class_path={component.class_path!r}"
    module_name, _, attr = component.class_path.rpartition(".")
    if not module_name:
        raise ValueError(f"{where} must be 'package.module.Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        missing = getattr(err, "name", None)
        if missing and missing.split(".")[0] != module_name.split(".")[0]:  # the module is there, one it imports not
            fix = ("install what it needs (the templates' models: pip install \"lightning_baoc[examples]\")"
                   if missing.split(".")[0] in _EXAMPLE_NEEDS else f"install {missing.split('.')[0]!r}")
        else:
            fix = ("put its directory on PYTHONPATH (PYTHONPATH=examples for the templates' models, when the config "
                   "is not in a configs/ folder beside examples/), or pass --model")
        raise ValueError(f"cannot import {module_name!r} of {where}: {err}; {fix}") from None
    factory = getattr(module, attr, None)
    if factory is None or not callable(factory):
        raise ValueError(f"{where}: {module_name!r} has no callable {attr!r}")
    try:
        with torch.device(device):
            return factory(**component.init_args)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{section} {component.class_path}(**{component.init_args!r}) failed: {err}") from None
    except (RuntimeError, NotImplementedError) as err:  # e.g. data-dependent code on the meta device
        raise ValueError(
            f"{section} {component.class_path}(**{component.init_args!r}) failed on the {device} device: {err}; "
            f"pass --model with a factory that builds the model without reading parameter values"
        ) from None


#: What the templates' models import beyond the package's own dependencies (the ``examples`` extra).
_EXAMPLE_NEEDS = ("sklearn", "torchmetrics", "matplotlib", "jsonargparse", "hydra")


def resolve_model(
    config: Config, model: str | nn.Module | None = None, config_path: str | os.PathLike[str] | None = None
) -> tuple[nn.Module, str]:
    """The model to check and its name: ``model`` (a module, a preset or ``package.module:factory``)
    or else the config's ``model`` section, built on the meta device (its class path also looked for
    in :func:`example_folder` of ``config_path``, the file it was loaded from).

    Raises:
        ValueError: neither is given, or the model cannot be built.
    """

    if isinstance(model, nn.Module):
        return model, type(model).__name__
    if model is not None:
        return build_model(model, "meta"), model
    if config.model is None:
        raise ValueError(
            "no model to check: pass --model (a preset or package.module:factory) or give the config a "
            "model section (class_path, init_args)"
        )
    folder = example_folder(config.model.class_path, config_path)
    built = build_component(config.model, search=[folder] if folder is not None else [])
    if not isinstance(built, nn.Module):
        raise ValueError(f"model.class_path={config.model.class_path!r} built {type(built).__name__}, not a torch.nn.Module")
    return built, config.model.class_path


def default_device(config: Config) -> str:
    """The training device a config implies: ``trainer.accelerator`` if set, else CUDA if present."""
    accelerator = str(config.trainer.get("accelerator", "auto")).lower()
    if accelerator == "cpu":
        return "cpu"
    if accelerator in ("gpu", "cuda"):
        return "cuda"
    if accelerator == "mps":
        return "mps"
    return "cuda" if torch.cuda.is_available() else "cpu"


__all__ = ["EXAMPLES", "build_component", "default_device", "example_folder", "resolve_model"]
