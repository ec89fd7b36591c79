"""When does asynchronous training pay on SmolLM2? The measured cost of staleness times a two-device time model.

    python repro/real_model_async_pays.py                # reads the logged runs; measures the weight push (seconds)
    python repro/real_model_async_pays.py --target 0.15 --shares 0.4 0.5 0.6 0.7 0.8

Cost of staleness (measured): every logged run of real_model_staleness.py (K0 = the recipe's grpo.py run; stale arms
async_grpo.py --mode emulated, batch t sampled by version t - 1 - K) gives, per seed, its held-out pass@1 at each
evaluation. Two measures of what K costs in steps:
- steps to --target: the first step at which the held-out pass@1 reaches it, linear between evaluations (evaluations
  are --eval-every steps apart: the interpolation is a model; "> N" where a run never reached it);
- step efficiency: the K = 0 run of the same seed reaches the stale run's final pass@1 after E steps (linear between
  its evaluations); E / N is the share of a synchronous step a stale step is worth (1: staleness costs nothing).

Time model (one generator device, one learner device). Synchronous training (K = 0) samples, then trains: a step
costs S + L. With K >= 1 the generator samples batch t + 1 while the learner trains on batch t, so a step costs
max(S, L) + P, P the weight push from learner to generator. Each run's own per-step S + L (time/rollout_s +
time/train_s, measured on this 2-core CPU, where both phases share the cores) calibrates the step; the sampling share
f = S / (S + L) is the parameter (measured here: the table's "f measured"; large systems report above 0.7), so a step
costs T_t (sync) or max(f, 1 - f) T_t + P (async). P = the policy's float32 bytes over the copy bandwidth measured on
this machine (a lower bound for a push between devices; --push-s overrides it). Async at K reaches the target sooner
iff steps_K / steps_0 < T / (max(f, 1 - f) T + P), i.e. iff its step efficiency exceeds max(f, 1 - f) (P small):
with one device each, overlap at most halves a step (at f = 0.5), and a share far from 0.5 leaves little to hide. An
arm that trains each batch n times (K4_none_2iter: n = 2) has a learner phase of n L: its step costs S + n L = T_t
synchronously and max(S, n L) + P overlapped, so it pays iff e > max(f, n (1 - f)), f still the share of a one-pass step.
Writes repro/results/real_model_async_pays.{md,png}.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import tyro
from real_model_staleness import ARMS as STALENESS_ARMS
from runner import LOGS, evals, k0_logs, pyplot, read_log, save_table

MECHANISM_ARMS = ("K4_none_noclip", "threaded")  # not a setting a user would pick (noclip) or not emulated (threaded)
PARAMETERS = 134_515_008  # SmolLM2-135M-Instruct (tied embeddings counted once)


@dataclass
class Args:
    target: float = 0.15
    """held-out pass@1 to reach (the base model is at 0.07-0.10, K = 0 ends 40 steps at 0.19-0.24)"""
    shares: list[float] = field(default_factory=lambda: [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    push_s: float | None = None
    """seconds to push the weights to the generator; default: measured (float32 copy on this machine)"""


def measured_push_s() -> float:
    """Best of 5 copies of SmolLM2's float32 weights (one tensor of as many elements) on this machine."""
    source, target = torch.randn(PARAMETERS), torch.empty(PARAMETERS)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - t0)
    return best


def crossing(points: list[tuple[int, float]], level: float) -> float | None:
    """The first (fractional) step at which the piecewise-linear curve through points reaches level."""
    for (s0, p0), (s1, p1) in zip(points, points[1:]):
        if p0 >= level:
            return float(s0)
        if p1 >= level:
            return s0 + (s1 - s0) * (level - p0) / (p1 - p0)
    return None


def step_efficiency(k0: list[tuple[int, float]], final: tuple[int, float]) -> float:
    """E / N: K = 0's curve reaches the stale run's final pass@1 after E steps, the stale run took N; 0 where it ended
    at or below K = 0's start (a collapse), inf where K = 0 never reaches it."""
    step, p = final
    reached = crossing(k0, p)
    return float("inf") if reached is None else reached / step


def mean_efficiency(effs: list[float], floors: list[float]) -> tuple[float, bool]:
    """The seeds' mean e, and whether it is a lower bound: a seed beyond K = 0's reach (e = inf) counts at its floor,
    K = 0's last evaluated step over the stale run's steps (K = 0 would need more steps than it ran)."""
    beyond = [e == float("inf") for e in effs]
    return statistics.mean(floor if out else e for e, floor, out in zip(effs, floors, beyond)), any(beyond)


def curve(rows: list[dict]) -> list[tuple[int, float]]:
    return [(e["step"], e["eval/pass@1"]) for e in evals(rows)]


def step_seconds(rows: list[dict]) -> list[float]:
    """S_t + L_t of each trained step (sampling or waiting for it, then training)."""
    wait = "time/learner_wait_s" if any("time/learner_wait_s" in r for r in rows) else "time/rollout_s"
    return [r[wait] + r["time/train_s"] for r in rows if "time/train_s" in r]


def pays_for(e: float, passes: int = 1) -> tuple[float, float] | None:
    """The sampling shares f at which a stale step worth e synchronous ones pays: e > max(f, n (1 - f)), i.e. the open
    interval (1 - e / n, e); None where it is empty (e <= n / (n + 1))."""
    return (1 - e / passes, e) if 1 - e / passes < e else None


def share(rows: list[dict]) -> float:
    wait = "time/learner_wait_s" if any("time/learner_wait_s" in r for r in rows) else "time/rollout_s"
    trained = [r for r in rows if "time/train_s" in r]
    return sum(r[wait] for r in trained) / sum(r[wait] + r["time/train_s"] for r in trained)


def passes_of(arm: str) -> int:
    """How many times the arm trains on each batch (async_grpo.py's --num-iterations; 1 where the arm leaves it)."""
    flags = STALENESS_ARMS.get(arm, ("", []))[1]
    return int(flags[flags.index("--num-iterations") + 1]) if "--num-iterations" in flags else 1


def seconds_to(rows: list[dict], step: float, f: float, K: int, push: float, passes: int = 1) -> float:
    """Model seconds to reach a (fractional) step: sum of T_t = S + n L (K = 0) or max(S, n L) + P (K >= 1), with
    S : L = f : 1 - f, n the passes a batch (n = 1: max(f, 1 - f) T_t + P)."""
    overlapped = max(f, passes * (1 - f)) / (f + passes * (1 - f))
    per_step = [t if K == 0 else overlapped * t + push for t in step_seconds(rows)]
    whole = int(step)
    return sum(per_step[:whole]) + (step - whole) * (per_step[whole] if whole < len(per_step) else per_step[-1])


def logged_runs() -> dict[str, dict[int, list[dict]]]:
    """{arm: {seed: rows}} of every logged real-model staleness run and its K = 0 runs."""
    runs: dict[str, dict[int, list[dict]]] = {"K0": {s: read_log(p) for s, p in k0_logs().items()}}
    for path in sorted((LOGS / "repro_real_model_staleness").glob("K*_s*.jsonl")):
        arm, seed = path.stem.rsplit("_s", 1)
        if arm not in MECHANISM_ARMS:
            runs.setdefault(arm, {})[int(seed)] = read_log(path)
    return runs


def main(args: Args) -> None:
    push = args.push_s if args.push_s is not None else measured_push_s()
    runs = logged_runs()
    k0 = runs["K0"]
    arms = {arm: {s: r for s, r in seeds.items() if s in k0} for arm, seeds in runs.items()}
    lines = [f"Weight push P = {push * 1e3:.1f} ms ({PARAMETERS * 4 / 1e6:.0f} MB of float32 weights"
             + (" copied on this machine" if args.push_s is None else ", given") + f"); target held-out pass@1 {args.target}.", "",
             "| arm | seeds | final pass@1 (each seed) | step efficiency (each seed) | steps to target (each seed) | "
             "f measured | " + " | ".join(f"time to target / K = 0's at f = {f:g}" for f in args.shares) + " |",
             "|---" * (6 + len(args.shares)) + "|"]
    efficiency = {}
    for arm, seeds in sorted(arms.items(), key=lambda kv: (int(kv[0][1]), kv[0])):
        if not seeds:
            continue
        K, n = int(arm[1]), passes_of(arm)
        finals = {s: curve(r)[-1] for s, r in seeds.items()}
        eff = {s: step_efficiency(curve(k0[s]), final) for s, final in finals.items()}
        floors = {s: curve(k0[s])[-1][0] / finals[s][0] for s in eff}  # a seed beyond K = 0's reach: e > its floor
        efficiency[arm] = mean_efficiency(list(eff.values()), list(floors.values()))
        reach = {s: crossing(curve(r), args.target) for s, r in seeds.items()}
        ratios = []
        for f in args.shares:
            per_seed = []
            for s, r in seeds.items():
                mine, theirs = reach[s], crossing(curve(k0[s]), args.target)
                if mine is not None and theirs is not None:
                    per_seed.append(seconds_to(r, mine, f, K, push, n) / seconds_to(k0[s], theirs, f, 0, push))
            ratios.append(f"{statistics.mean(per_seed):.2f}" + (f" ({len(per_seed)}/{len(seeds)})" if len(per_seed) < len(seeds) else "")
                          if per_seed else "never")
        steps = ", ".join(f"{x:.0f}" if x is not None else f"> {curve(seeds[s])[-1][0]}" for s, x in reach.items())
        lines.append(f"| {arm} | {', '.join(map(str, seeds))} | {', '.join(f'{p:.3f}' for _, p in finals.values())} | "
                     f"{', '.join(f'> {floors[s]:g}' if e == float('inf') else f'{e:.2f}' for s, e in eff.items())} | {steps} | "
                     f"{statistics.mean(share(r) for r in seeds.values()):.2f} | " + " | ".join(ratios) + " |")
    rule = ["", "The rule (step efficiency e, mean over seeds; async at K >= 1 gains iff e > max(f, n (1 - f)) + P / T, "
                "n the arm's passes a batch, --num-iterations): "]
    for arm, (e, bound) in efficiency.items():
        if arm == "K0":
            continue
        n = passes_of(arm)
        shares, edge = pays_for(e, n), f"{n}/{n + 1}" if n > 1 else "0.5"
        at_least = " at least" if bound else ""  # a seed beyond K = 0's reach: its e is at least its floor
        rule.append(f"- {arm}: e{' >=' if bound else ' ='} {e:.2f}: " + (
            f"pays{at_least} for sampling shares f in ({shares[0]:.2f}, {shares[1]:.2f})" if shares else
            f"pays at no sampling share (e <= {edge}: even a perfect overlap, at f = {edge}, "
            f"{'halves a step' if n == 1 else f'costs {edge} of a one-pass synchronous step'} only)" if not bound else
            f"no share can be named (a lower bound at or below {edge})"))
    out = save_table("real_model_async_pays", "\n".join(lines + rule) + "\n")
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4))
    grid = [i / 100 for i in range(5, 96)]
    for arm, (e, bound) in efficiency.items():
        if arm == "K0":
            continue
        if e == 0:  # ended below the base model: never reaches K = 0's accuracy, at any share
            continue
        n = passes_of(arm)
        ax.plot(grid, [max(f, n * (1 - f)) / e for f in grid], label=f"{arm} (e {'>=' if bound else '='} {e:.2f})")
    ax.axhline(1, color="k", lw=0.8, ls="--")
    ax.axvspan(0.4, 0.6, color="0.9", label="measured here")
    ax.set(xlabel="sampling share of a synchronous step f", ylabel="time to K = 0's accuracy, relative (< 1: async pays)",
           title="Async on two devices: max(f, n (1 - f)) / step efficiency")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "real_model_async_pays.png", dpi=110)


if __name__ == "__main__":
    main(tyro.cli(Args))
