"""What the controller measures on the blocks' gradients: the sampler and the shadow moments.

:class:`Instrumentation` holds the two instruments and when they sample:

- the :class:`~lightning_baoc.GradientSampler` copies a fixed random subsample of each block's
  gradient into a ring buffer, whose statistics feed the risk model; it samples every
  ``sample_every`` steps during warm-up and ``sparse_sampling`` times sparser afterwards, and the
  samples taken since the last allocation (:attr:`Instrumentation.ring_samples`) say whether the
  statistics are fresh enough for the next one;
- the :class:`~lightning_baoc.risk.shadow.ShadowMoments` keep fp32 AdamW moments on a sample of
  each tensor, at every step, so the risk of a format is measured against what fp32 state would hold.

Both are sized within the instruments' allowance (:mod:`lightning_baoc.costs.instruments`), outside
the state budget.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_baoc.config.settings import BAOCConfig
from lightning_baoc.control.blocks import Blocks
from lightning_baoc.control.tables import BlockTables
from lightning_baoc.costs.instruments import InstrumentSizes
from lightning_baoc.optim import BlockwiseOptimizer
from lightning_baoc.risk.momentum import shadow_betas
from lightning_baoc.risk.shadow import ShadowMoments
from lightning_baoc.sampling import GradientSampler


class Instrumentation:
    """The gradient sampler and the shadow moments over the blocks, their sizes and sampling schedule.

    Args:
        config: the settings; reads ``sample_every``, ``sparse_sampling``, ``capacity``,
            ``max_elements``, ``instrument_share`` and ``seed``.
        blocks: the partition the instruments watch.
        tables: the blocks' problem, which sizes the instruments within their allowance.

    Attributes:
        sampler: the gradient sampler (``None`` before :meth:`restart_sampler`).
        shadow: the shadow moments (``None`` before :meth:`restart_shadow`).
        sizes: the instruments' sizes (:class:`~lightning_baoc.costs.instruments.InstrumentSizes`).
        ring_samples: samples taken since the statistics last restarted (an allocation).

    Example:
        >>> import torch
        >>> from lightning_baoc import BlockwiseAdamW
        >>> model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)); opt = BlockwiseAdamW(model.parameters())
        >>> config = BAOCConfig(memory_budget=0.5, sample_every=2, calibration="prior")
        >>> blocks = Blocks(config); blocks.build(opt, model); tables = BlockTables(config, blocks); tables.refresh(opt)
        >>> inst = Instrumentation(config, blocks, tables)
        >>> inst.restart_sampler(model); inst.restart_shadow(opt)
        >>> for step in range(4):
        ...     model(torch.randn(4, 8)).sum().backward()
        ...     _ = inst.observe(opt, step, allocated=False); opt.step(); opt.zero_grad()
        >>> inst.ring_samples, inst.nbytes() > 0
        (2, True)
        >>> inst.close()
    """

    def __init__(self, config: BAOCConfig, blocks: Blocks, tables: BlockTables) -> None:
        self.config = config
        self.blocks = blocks
        self.tables = tables
        self.sampler: GradientSampler | None = None
        self.shadow: ShadowMoments | None = None
        self.sizes: InstrumentSizes | None = None
        self.ring_samples = 0
        self._betas_cache: tuple[Any, dict[str, tuple[float, float]]] | None = None  # see betas

    # ------------------------------------------------------------------ building

    def restart_sampler(self, module: nn.Module) -> None:
        """A new sampler over the blocks' trainable parameters (the model's names); empty ring."""
        cfg = self.config
        model_named = dict(module.named_parameters())
        names = self.blocks.model_names
        sampled = {}
        for b, held in self.blocks.params.items():
            trainable = [names[n] for n in held if model_named[names[n]].requires_grad]
            if trainable:
                sampled[b] = trainable
        if self.sampler is not None:
            self.sampler.close()
        problem = self.tables.problem
        assert problem is not None, "the tables are refreshed before the instruments restart"
        sizes = self.sizes = problem.instruments(cfg.capacity, cfg.max_elements, cfg.instrument_share)
        self.sampler = GradientSampler(module, sampled, cfg.sample_every, cfg.capacity, sizes.max_elements, seed=cfg.seed)
        self.ring_samples = 0

    def restart_shadow(self, opt: BlockwiseOptimizer) -> None:
        """Shadow moments over the blocks' parameters (:mod:`lightning_baoc.risk.shadow`); tensors
        already shadowed keep theirs."""
        assert self.sizes is not None, "the sampler is sized (restart_sampler) before the shadow"
        named = opt.named_params
        old = self.shadow
        params = {n: named[n] for n in self.blocks.names()}
        self.shadow = ShadowMoments(params, self.sizes.shadow_elements, seed=self.config.seed)
        if old is not None:
            self.shadow.load_state_dict(old.state_dict())

    # ------------------------------------------------------------------ observing

    def betas(self, opt: BlockwiseOptimizer) -> dict[str, tuple[float, float]]:
        """Parameter name -> the betas of its shadow moments (as floats): its group's for AdamW;
        for SGD and Lion the buffer's own average and 0.999
        (:func:`~lightning_baoc.risk.momentum.shadow_betas`)."""
        groups = opt.param_groups
        key = tuple((str(g.get("betas", g.get("momentum"))), len(g["params"]), id(g)) for g in groups)
        cached = self._betas_cache
        if cached is not None and cached[0] == key:  # rebuilt only when a group or its betas change
            return cached[1]
        if opt.rule != "adamw":
            out = shadow_betas(opt)
        else:
            out = {}
            for group in groups:
                betas = (float(group["betas"][0]), float(group["betas"][1]))
                for p in group["params"]:
                    out[opt.param_name(p)] = betas
        self._betas_cache = (key, out)
        return out

    def sampling_step(self, step: int, allocated: bool) -> bool:
        """Whether the sampler may sample at ``step``: always during warm-up, after the first
        allocation (``allocated``) every ``sparse_sampling``-th sampling step and its follower."""
        every = self.config.sample_every
        if allocated and self.config.sparse_sampling > 1:
            if (step // every) % self.config.sparse_sampling:
                return False
        return True

    def count(self, step: int, took: bool) -> bool:
        """Count a sample the sampler took at ``step`` into :attr:`ring_samples` (a sampling step's,
        not its follower's); returns ``took``."""
        every = self.config.sample_every
        if took and (every == 1 or step % every == 0):
            self.ring_samples += 1
        return took

    def observe(
        self, opt: BlockwiseOptimizer | None, step: int, grad_scale: float | None = None, allocated: bool = False
    ) -> bool:
        """Feed the shadow moments and, on a sampling step, the sampler with ``opt``'s gradients.

        Args:
            opt: the optimizer whose parameters' gradients are read (``None``: nothing installed).
            step: optimizer steps completed before this one.
            grad_scale: the loss scale the gradients still carry, if any (fp16 AMP).
            allocated: whether the first allocation has run (sampling is sparser then).

        Returns:
            whether the sampler took a sample.
        """
        if self.shadow is not None and opt is not None:
            self.shadow.update(opt.named_params, self.betas(opt), grad_scale)
        if self.sampler is None or not self.sampling_step(step, allocated):
            return False
        return self.count(step, self.sampler.sample(step, grad_scale))

    def statistics(self) -> dict[str, dict[str, float]]:
        """The sampled per-block statistics, as floats (local: the samples are whole already)."""
        assert self.sampler is not None
        return {b: {k: float(v) for k, v in s.items()} for b, s in self.sampler.statistics().items()}

    def restart_statistics(self) -> None:
        """Empty the ring (after an allocation: the next one sees fresh statistics only)."""
        assert self.sampler is not None
        self.sampler.reset()
        self.ring_samples = 0

    def nbytes(self) -> int:
        """Bytes the sampler's buffers and the shadow moments hold now (outside the state budget)."""
        held = self.sampler.buffer_bytes() if self.sampler is not None else 0
        return held + (self.shadow.nbytes() if self.shadow is not None else 0)

    def close(self) -> None:
        """Stop the sampler's worker thread (statistics stay available)."""
        if self.sampler is not None:
            self.sampler.close()


__all__ = ["Instrumentation"]
