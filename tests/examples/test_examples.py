"""The example workloads (``examples/workloads.py``) and scripts: recipes, data, a few real steps.

Each workload trains for a handful of steps on the CPU; the held-out metric must be finite and
better than at initialization. The whole file runs in well under a minute.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import workloads as W  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: much faster for models this small on a busy shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _trainer(steps: int) -> L.Trainer:
    return L.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


# (workload, steps, batch size): enough steps for the held-out metric to move clearly.
FEW_STEPS = [("vit_digits", 25, 64), pytest.param("char_gpt", 15, 16, marks=pytest.mark.slow), ("ddpm_digits", 15, 64)]


@pytest.mark.parametrize("name,steps,batch_size", FEW_STEPS)
def test_workload_trains_and_improves(name: str, steps: int, batch_size: int) -> None:
    module, data = W.build(name, recipe="realistic", max_steps=steps, seed=0, batch_size=batch_size)
    metric = module.quality_metric
    evaluator = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    before = evaluator.validate(module, data, verbose=False)[0]
    trainer = _trainer(steps)
    trainer.fit(module, data)
    assert trainer.global_step == steps
    after = evaluator.validate(module, data, verbose=False)[0]
    assert all(math.isfinite(v) for v in [*before.values(), *after.values()]), (before, after)
    loss_key = "val_denoise" if name == "ddpm_digits" else "val_loss"
    assert after[loss_key] < 0.9 * before[loss_key], (before, after)
    if module.higher_is_better:
        assert after[metric] > before[metric], (before, after)
    else:
        assert after[metric] < before[metric], (before, after)


@pytest.mark.parametrize("name", sorted(W.WORKLOADS))
def test_configure_optimizers_is_plain_adamw_with_two_groups(name: str) -> None:
    module, _ = W.build(name, max_steps=100)
    config = module.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert type(opt) is torch.optim.AdamW
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR) and config["lr_scheduler"]["interval"] == "step"
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == module.recipe.weight_decay > 0 and no_decay["weight_decay"] == 0.0
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) and set(ids) == {id(p) for p in module.parameters()}
    assert all(p.ndim >= 2 for p in decay["params"]) and any(p.ndim < 2 for p in no_decay["params"])


def test_parameter_counts_as_documented() -> None:
    assert 100_000 <= W.build("vit_digits")[0].num_parameters() <= 200_000
    assert 700_000 <= W.build("char_gpt")[0].num_parameters() <= 900_000
    assert 100_000 <= W.build("ddpm_digits")[0].num_parameters() <= 400_000


def test_recipes_warmup_cosine_and_constant() -> None:
    r = W.RECIPES["vit_digits"]["realistic"]
    factors = [r.lr_factor(s, 100) for s in range(101)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)  # 10 warm-up steps
    assert all(a <= b for a, b in zip(factors[:10], factors[1:10]))
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))  # cosine decay
    assert factors[100] == pytest.approx(r.min_lr_ratio)
    for name in W.WORKLOADS:
        stress, realistic = W.RECIPES[name]["stress"], W.RECIPES[name]["realistic"]
        assert stress.lr > realistic.lr
        assert {stress.lr_factor(s, 50) for s in range(50)} == {1.0}
    with pytest.raises(ValueError, match="schedule"):
        W.Recipe(lr=1e-3, schedule="linear")
    with pytest.raises(ValueError, match="recipe"):
        W.ViTDigits(recipe="fast")
    with pytest.raises(ValueError, match="workload"):
        W.build("resnet")


def test_stdlib_corpus_is_embedded_and_held_out() -> None:
    text = W.stdlib_text(200_000)
    assert len(text) == 200_000 and text == W.stdlib_text(200_000)
    data = W.CharDataModule(block_size=32, max_chars=200_000)
    data.setup()
    x, y = data.train_set[0]
    assert x.shape == y.shape == (32,) and torch.equal(x[1:], y[:-1])
    assert int(data.val_set.starts.min()) >= 0 and len(data.val_set) == 128
    assert int(W.encode("\u00e9")[0]) == W.VOCAB.index("?")


def test_ddpm_validation_noise_is_fixed_across_seeds() -> None:
    a = W.DigitsDataModule(seed=0, denoise_pairs=2)
    b = W.DigitsDataModule(seed=1, denoise_pairs=2)
    a.setup(), b.setup()
    assert all(torch.equal(s, t) for s, t in zip(a.val_set.tensors, b.val_set.tensors))
    assert len(a.val_set) == 2 * 397


def test_data_dir_options(tmp_path: Path) -> None:
    from PIL import Image

    for cls in ("a", "b"):
        (tmp_path / "img" / cls).mkdir(parents=True)
        for i in range(5):
            Image.fromarray((torch.rand(12, 12) * 255).byte().numpy(), mode="L").save(tmp_path / "img" / cls / f"{i}.png")
    x_train, y_train, x_val, y_val = W.DigitsDataModule(data_dir=str(tmp_path / "img")).tensors()
    assert x_train.shape == (8, 1, 8, 8) and x_val.shape == (2, 1, 8, 8)
    assert 0.0 <= float(x_train.min()) and float(x_train.max()) <= 1.0
    assert set(torch.cat([y_train, y_val]).tolist()) == {0, 1}

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "a.txt").write_text("hello world\n" * 200)
    text_data = W.CharDataModule(block_size=16, data_dir=str(tmp_path / "text"))
    text_data.setup()
    assert len(text_data.train_set) > 0 and len(text_data.val_set) > 0
    with pytest.raises(FileNotFoundError, match="data_dir"):
        W.CharDataModule(data_dir=str(tmp_path / "missing")).setup()
    with pytest.raises(FileNotFoundError, match="no images"):
        W.DigitsDataModule(data_dir=str(tmp_path / "text")).tensors()


def test_example_script_runs_and_prints(capsys: pytest.CaptureFixture[str]) -> None:
    import vit_digits

    metrics = vit_digits.main(["--steps", "3", "--eval-every", "3", "--no-progress"])
    assert math.isfinite(metrics["val_acc"]) and math.isfinite(metrics["val_loss"])
    out = capsys.readouterr().out
    assert "vit_digits after 3 steps" in out and "val_acc" in out


def test_baoc_flag_prints_the_figures_of_baoc_summary(capsys: pytest.CaptureFixture[str]) -> None:
    """With ``--baoc-budget`` the script prints BAOC's figures from ``BAOC.summary()``, not from the optimizer."""
    import vit_digits

    from lightning_baoc import BAOC

    seen: list[BAOC] = []
    original = BAOC.summary

    def summary(self: BAOC):  # type: ignore[no-untyped-def]
        seen.append(self)
        return original(self)

    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the warm-up is longer than 3 steps: said, and fine here
        patch.setattr(BAOC, "summary", summary)
        vit_digits.main(["--steps", "3", "--eval-every", "3", "--no-progress", "--baoc-budget", "0.35"])
    (s,) = [original(b) for b in seen]
    out = capsys.readouterr().out
    assert (f"optimizer state: {s.state_bytes:,} bytes ({s.state_fraction:.3f} of AdamW's "
            f"{s.baseline_state_bytes:,})") in out, out
    assert s.phase == "warmup" and s.state_bytes <= 0.35 * s.baseline_state_bytes


def test_baoc_flag_fails_clearly_without_the_callback(monkeypatch: pytest.MonkeyPatch) -> None:
    import vit_digits

    import lightning_baoc

    monkeypatch.delattr(lightning_baoc, "BAOC", raising=False)
    monkeypatch.delitem(lightning_baoc._EXPORTS, "BAOC")  # the top level imports it lazily
    with pytest.raises(SystemExit, match="lightning_baoc.BAOC"):
        vit_digits.main(["--steps", "2", "--baoc-budget", "0.35", "--no-progress"])


def test_bf16_example_trains_at_five_bytes_per_parameter() -> None:
    import digits_bf16

    released = digits_bf16.main(["--epochs", "2"])
    assert 5.0 <= released["bytes_per_param"] <= 5.2 and released["test_acc"] > 0.8
    kept = digits_bf16.main(["--epochs", "1", "--no-release"])
    assert 7.0 <= kept["bytes_per_param"] <= 7.2


def test_sgd_lion_example_trains_with_an_int8_buffer() -> None:
    import digits_sgd_lion

    sgd = digits_sgd_lion.main(["--epochs", "2"])
    assert 1.0 < sgd["bytes_per_param"] < 1.2 and sgd["test_acc"] > 0.8
    lion = digits_sgd_lion.main(["--epochs", "2", "--optimizer", "lion", "--format", "bf16"])
    assert lion["bytes_per_param"] == 2.0 and lion["test_acc"] > 0.8
