"""Where does 8-bit state's harm come from, one block at a time? The measurement behind the
8-bit-v term of ``lightning_baoc/risk/model.py``.

It uses the same task, shared fp32 warm-up and paired data orders as ``risk_validation.py``, on its
block-level blocks (the largest 2-D blocks). For each block it reports:

- **one round trip**: the distortion ``||u_q - u||^2 / ||u||^2`` of the Adam direction when ``v`` is
  encoded once in 8 bits at allocation time. This is what a per-block round-trip score sees.
- **along training**: the same distortion averaged over the continuation. The blocks hold ``int8``
  while a shadow fp32 ``m, v`` follows the same gradients.
- **int8 harm**: held-out loss minus fp32's, read from ``risk_validation.py``'s cache (or run).
- **v alone**: the harm when only ``v`` is re-encoded in 8 bits after every step; ``m`` stays fp32.
- **larger steps**: the harm of a uniform step-size change of ``--bump`` (7%) on the block.

It closes with the Spearman correlation of each distortion with the int8 harm.

Run from the repository root (about 20 min on 2 cores for the DDPM):

    python benchmarks/int8_mechanism.py --task ddpm --warmup 300
"""

from __future__ import annotations

import argparse
import json
import statistics as stats
from pathlib import Path
from typing import Any

import torch
from _report import command, machine, markdown_table, write_docs_section
from _tasks import chargpt_task, ddpm_task
from risk_validation import EVAL_POINTS, Runs, _train, largest_blocks, mean_sem, restore, run_config, spearman, warm_up

from lightning_baoc import partition
from lightning_baoc.formats.quant import dequantize_sqrt, num_groups, num_supers, quantize_sqrt
from lightning_baoc.risk import risk_details


def round_trip_v(v: torch.Tensor) -> torch.Tensor:
    """``v`` encoded in the 8-bit sqrt-companded codes of ``int8`` and decoded again."""
    flat = v.reshape(-1).clone()
    n = flat.numel()
    codes = torch.empty(n, dtype=torch.uint8)
    scales, exps = torch.empty(num_groups(n), dtype=torch.float16), torch.empty(num_supers(n), dtype=torch.int8)
    quantize_sqrt(flat, codes, scales, exps)
    return dequantize_sqrt(codes, scales, exps).view_as(v)


class _Stepper:
    """A torch Adam continuation of the warm-up's exact state, with a hook after every step."""

    def __init__(self, model: torch.nn.Module, warm_opt, lr: float, after=None) -> None:
        params = dict(model.named_parameters())
        self.opt = torch.optim.Adam(list(params.values()), lr=lr, betas=(0.9, 0.999), eps=1e-8, foreach=False)
        for name, p in params.items():
            state = warm_opt.param_state(name)
            self.opt.state[p] = {
                "step": torch.tensor(float(warm_opt.step_count(name))),
                "exp_avg": state.exp_avg.clone().float(),
                "exp_avg_sq": state.dense_v().clone().float(),
            }
        self.after = after

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.opt.step()
        if self.after is not None:
            self.after(self.opt)


def direction_distortion(m: torch.Tensor, v: torch.Tensor, v_q: torch.Tensor, eps: float = 1e-8) -> tuple[float, float]:
    """(||u_q - u||^2, ||u||^2) for the Adam direction with ``v`` against ``v_q``."""
    u = m / (v.sqrt() + eps)
    u_q = m / (v_q.sqrt() + eps)
    return float(((u_q - u) ** 2).sum()), float((u * u).sum())


def _arguments() -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=["chargpt", "ddpm"], default="ddpm")
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--orders", type=int, default=3)
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--bump", type=float, default=0.07, help="step-size change of the last column (default: 0.07)")
    parser.add_argument("--layers", type=int, default=4, help="chargpt: transformer blocks (default: 4)")
    parser.add_argument("--embd", type=int, default=64, help="chargpt: embedding width (default: 64)")
    parser.add_argument("--eval-seqs", type=int, default=128, help="chargpt: held-out sequences (default: 128)")
    parser.add_argument("--results-dir", type=Path, default=Path(__file__).parent / "runs")
    parser.add_argument("--no-docs", "--no-readme", dest="no_docs", action="store_true",
                        help="print the table only (--no-readme: former name)")
    return parser.parse_args()


class CustomRuns:
    """Held-out losses (end) of torch-Adam continuations with a change applied to one block after every step,
    cached beside ``risk_validation.py``'s runs: ``"none"`` (the plain continuation), ``"v"`` (v alone
    re-encoded in 8 bits) or ``"bump"`` (the block's steps ``1 + bump`` times larger)."""

    def __init__(self, task: Any, warm: tuple[bytes, bytes], blocks: dict[str, list[str]], args: argparse.Namespace,
                 config: dict) -> None:
        self.task, self.warm, self.blocks, self.steps, self.factor = task, warm, blocks, args.steps, args.bump
        self.path = args.results_dir / f"int8_mechanism_{args.task}.json"
        self.cache = json.loads(self.path.read_text()) if self.path.exists() else {}
        self.mine = self.cache.setdefault(json.dumps({**config, "bump": args.bump}, sort_keys=True), {})

    def __call__(self, kind: str, block: str, order: int) -> float:
        key = json.dumps([kind, block, order])
        if key not in self.mine:
            net, warm_opt = restore(self.task, self.warm)
            targets = [dict(net.named_parameters())[n] for n in self.blocks[block]]
            before: list[torch.Tensor] = []

            def v_alone(opt: torch.optim.Optimizer) -> None:
                for p in targets:
                    opt.state[p]["exp_avg_sq"].copy_(round_trip_v(opt.state[p]["exp_avg_sq"]))

            def bump(opt: torch.optim.Optimizer) -> None:
                with torch.no_grad():
                    for p, q in zip(targets, before):
                        p.add_(p - q, alpha=self.factor)

            stepper = _Stepper(net, warm_opt, self.task.lr, {"v": v_alone, "bump": bump}.get(kind))
            if kind == "bump":
                inner = stepper.step

                def step() -> None:
                    before[:] = [p.detach().clone() for p in targets]
                    inner()

                stepper.step = step  # type: ignore[method-assign]
            gen = torch.Generator().manual_seed(order)
            self.mine[key] = _train(self.task, net, stepper, self.steps, gen, EVAL_POINTS)[0]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(self.cache))
        return self.mine[key]


def main() -> None:
    args = _arguments()
    torch.set_num_threads(1)
    task = chargpt_task(args.layers, args.embd, args.eval_seqs) if args.task == "chargpt" else ddpm_task()
    model = task.make_model()
    blocks = partition(model)
    chosen = largest_blocks(model, blocks, args.blocks)
    warm = warm_up(task, args.warmup)
    orders = list(range(args.orders))

    config = run_config(args)
    runs = Runs(task, warm, blocks, args.steps, args.results_dir / f"risk_validation_{args.task}.json", config)
    base = {o: runs({}, o) for o in orders}
    custom = CustomRuns(task, warm, blocks, args, config)

    # the torch Adam continuation must reproduce BlockwiseAdamW's fp32 one, or the harms are not paired
    plain = custom("none", chosen[0], orders[0])
    if abs(plain - base[orders[0]][0]) > 1e-6 * abs(base[orders[0]][0]):
        raise RuntimeError(f"torch Adam continuation {plain} != BlockwiseAdamW fp32 {base[orders[0]][0]}")

    shares, once, along = _distortions(task, warm, blocks, chosen, args.steps)
    rows, table = [], {}
    for b in chosen:
        int8 = [runs({b: "int8"}, o)[0] - base[o][0] for o in orders]
        v_only = [custom("v", b, o) - base[o][0] for o in orders]
        bumped = [custom("bump", b, o) - base[o][0] for o in orders]
        table[b] = {
            "share": shares[b], "once": once[b][0] / once[b][1], "along": stats.mean(along[b]),
            "int8": mean_sem(int8), "v": mean_sem(v_only), "bump": mean_sem(bumped),
        }
        t = table[b]
        rows.append([b, f"{t['share']:.3f}", f"{t['once']:.2e}", f"{t['along']:.4f}",
                     *(f"{t[k][0]:+.6f} +- {t[k][1]:.6f}" for k in ("int8", "v", "bump"))])
        print(rows[-1], flush=True)
    summary = _summary(args, task, chosen, table, rows)
    print(summary)
    if not args.no_docs:
        write_docs_section("benchmarks/int8-mechanism.md", f"int8_mechanism_{task.name}",
                           f"Machine: {machine()}. Command: `{command()}`\n\n{summary}")


def _distortions(task: Any, warm: tuple[bytes, bytes], blocks: dict[str, list[str]], chosen: list[str],
                 steps: int) -> tuple[dict[str, float], dict[str, list[float]], dict[str, list[float]]]:
    """Each block's share of progress, the distortion of one round trip of v (error and norm summed over the
    block's tensors), and the distortion along training (int8 on all chosen blocks, shadow fp32 m, v)."""
    _, warm_opt = restore(task, warm)
    shares = {b: d.share for b, d in risk_details(warm_opt, blocks, horizon=steps).items()}
    once: dict[str, list[float]] = {b: [0.0, 0.0] for b in chosen}
    for b in chosen:
        for name in blocks[b]:
            step = warm_opt.step_count(name)  # an fp32 warm-up: m and v share the step count
            state = warm_opt.param_state(name)
            m = state.exp_avg.float() / (1 - 0.9**step)
            v = state.dense_v().float() / (1 - 0.999**step)
            err, usq = direction_distortion(m, v, round_trip_v(v))
            once[b][0] += err
            once[b][1] += usq
    net, opt = restore(task, warm)
    params = dict(net.named_parameters())
    names = [n for b in chosen for n in blocks[b]]
    shadow = {n: [opt.param_state(n).exp_avg.clone().float(), opt.param_state(n).dense_v().clone().float()] for n in names}
    opt.set_formats({b: "int8" for b in chosen}, blocks=blocks)
    along: dict[str, list[float]] = {b: [] for b in chosen}
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        task.loss(net, step, gen).backward()
        for n in names:
            g = params[n].grad.float()
            shadow[n][0].mul_(0.9).add_(g, alpha=0.1)
            shadow[n][1].mul_(0.999).addcmul_(g, g, value=0.001)
        opt.step()
        if step % 20 == 19:
            for b in chosen:
                err = usq = 0.0
                for n in blocks[b]:
                    m, v = shadow[n]
                    e, s = direction_distortion(m, v, opt.param_state(n).dense_v().float())
                    err, usq = err + e, usq + s
                along[b].append(err / usq)
    return shares, once, along


def _summary(args: argparse.Namespace, task: Any, chosen: list[str], table: dict[str, dict], rows: list) -> str:
    harm = [table[b]["int8"][0] for b in chosen]
    rho = {k: spearman([table[b][k] for b in chosen], harm) for k in ("once", "along", "share")}
    agree = max(abs(table[b]["v"][0] - table[b]["int8"][0]) for b in chosen)
    bump_max = max(abs(table[b]["bump"][0]) for b in chosen)
    return (
        f"Task `{task.name}`: fp32 warm-up {args.warmup} steps, then {args.steps} steps, {args.orders} paired data "
        f"orders; the {len(chosen)} largest 2-D blocks, one at a time; harm at the end, mean +- sem.\n\n"
        + markdown_table(["block", "share of progress", "distortion, one round trip", "distortion along training",
                          "int8 harm", "v alone in 8 bits", f"steps {1 + args.bump:.2f}x"], rows)
        + f"\n\nSpearman with the int8 harm: one round trip {rho['once']:+.2f}, along training {rho['along']:+.2f}, "
        f"share of progress {rho['share']:+.2f}. Re-encoding v alone matches int8's harm within {agree:.1e} "
        f"on every block; {1 + args.bump:.2f}x larger steps move the loss by at most {bump_max:.1e}."
    )

if __name__ == "__main__":
    main()
