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
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

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


def train(cfg: Any) -> dict[str, float]:
    """Validate a composed config, build BAOC, the model and the data, train; return the metrics."""
    import lightning as L

    from lightning_baoc import BAOC
    from lightning_baoc.config.files import parse_config
    from lightning_baoc.tools.check import build_component

    config = parse_config(cfg, source="the Hydra config")
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
    state = trainer.optimizers[0].state_bytes()
    fp32 = 8 * sum(p.numel() for p in module.parameters() if p.requires_grad)
    print(f"{config.model.class_path}: " + ", ".join(f"{k} {v:.4g}" for k, v in sorted(metrics.items())))
    print(f"optimizer state: {state:,} bytes ({state / fp32:.3f} of fp32 AdamW's {fp32:,}); allocation: {baoc.allocation}")
    return metrics


def main() -> None:
    """Hydra's entry point (``configs/vision.yaml`` unless ``--config-name`` says otherwise)."""
    if hydra is None:
        print(MISSING_HYDRA, file=sys.stderr)
        raise SystemExit(2)
    args = sys.argv[1:]
    if not any(a.startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for a in args):
        sys.argv += ["hydra.run.dir=lightning_logs/hydra/${now:%Y-%m-%d_%H-%M-%S}", "hydra.sweep.dir=lightning_logs/hydra/multirun"]
    entry = hydra.main(version_base=None, config_path=str(HERE.parent / "configs"), config_name="vision")(train)
    entry()


if __name__ == "__main__":
    main()
