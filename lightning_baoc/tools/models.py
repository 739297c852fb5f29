"""The model a tool works on: a config's ``model`` section, a preset or a ``package.module:factory``,
built on the ``meta`` device (shapes only), and the training device a config names."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from lightning_baoc.config.files import ComponentConfig, Config
from lightning_baoc.tools.presets import build_model


def build_component(component: ComponentConfig, device: str | torch.device = "meta", section: str = "model") -> Any:
    """Instantiate a config's ``model`` (or ``data``) section, ``class_path(**init_args)``, on ``device``.

    Args:
        component: the section.
        device: the default torch device while it is built (default: ``"meta"``: shapes only).
        section: the section's name, for error messages (default: ``"model"``).

    Raises:
        ValueError: the class cannot be imported (the message says how to make it importable),
            or the call fails.

    Example:
        >>> build_component(ComponentConfig("torch.nn.Linear", {"in_features": 4, "out_features": 2})).weight.device
        device(type='meta')
    """
    where = f"{section}.class_path={component.class_path!r}"
    module_name, _, attr = component.class_path.rpartition(".")
    if not module_name:
        raise ValueError(f"{where} must be 'package.module.Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"cannot import {module_name!r} of {where}: {err}. Put its directory on PYTHONPATH (for the "
            f"example configs: PYTHONPATH=examples), or pass --model"
        ) from None
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


def resolve_model(config: Config, model: str | nn.Module | None = None) -> tuple[nn.Module, str]:
    """The model to check and its name: ``model`` (a module, a preset or ``package.module:factory``)
    or else the config's ``model`` section, built on the meta device.

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
    built = build_component(config.model)
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


__all__ = ["build_component", "default_device", "resolve_model"]
