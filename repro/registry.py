"""The findings registry: every comparison postrl reports, fixed before the runs that decide it.

A finding asks one question of two arms, A against B, on the embedded job and on SmolLM2-135M-Instruct. Each arm is
one command line (its seed as {seed}) and the kept log of each seed's run (under repro/results/logs/). The metric is
read from each log (held-out pass@1 at the last evaluation, unless the comparison names another), the difference
A - B is taken seed by seed (paired), and one rule decides every finding (repro/findings.py):

    n independent seeds, d_s = A_s - B_s, mean d and its Student-t 95 % interval (n - 1 degrees of freedom):
    "A above B" where the interval lies above 0, "A below B" where it lies below, "not resolved at n seeds" else.

An embedded finding and its SmolLM2 counterpart: "holds" where both resolve the same way, "reverses" where they
resolve opposite ways, "unresolved" else. One run per (arm, seed): a rerun of a seed under other code is another arm (a
robustness check), never a second sample. A change after seeing the runs is a new finding, registered as such, with
its date. Every log under repro/results/logs/ is claimed by an arm here or excluded below with its reason.

    python repro/findings.py            # the tables and verdicts, written into README.md and repro/README.md
    python repro/findings.py --check    # exit 1, naming the difference, where the docs or the logs disagree
    python repro/findings.py --run k4   # the registered runs of a finding that have no kept log yet, one at a time
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arm:
    command: str
    """one seed's command line, {seed} standing for the seed"""
    logs: str
    """the kept log of one seed's run, relative to repro/results/logs/, {seed} standing for the seed"""
    key: str = "eval/pass@1"
    """the log's key of the metric in this arm (an arm evaluated another way names its own)"""


@dataclass(frozen=True)
class Comparison:
    a: Arm
    b: Arm | None
    """None: A against its own base evaluation (step 0): the metric's gain over the run"""
    seeds: tuple[int, ...]
    registered: str
    """the date the seeds (and so the runs that decide it) were fixed"""
    step: int | None = None
    """the evaluation the metric is read at (None: the last one)"""
    unpaired: str = ""
    """why pairs whose two runs do not share their code and CPU count anyway (empty: every pair must share both)"""


@dataclass(frozen=True)
class Finding:
    key: str
    title: str
    """the heading of its table in repro/README.md"""
    question: str
    """A against B, in at most ~25 words: the README's first cell"""
    embedded: Comparison | str
    """the comparison on the embedded job, or why it is not measured there"""
    smollm2: Comparison | str


SEEDS = (0, 1, 2, 3, 4, 5)
EARLIER = ("seeds 0-2 ran in issue 34's sessions, before a log recorded its code and CPU (its commit is the one that "
           "kept it); the pairs from seed 3 on share both")
SEED2_LATER = (EARLIER + "; seed 2 of arm A had no kept log and runs under issue 51's code, against arm B's seed 2 "
               "of issue 34")

# ---------------------------------------------------------------- the embedded job (a run is under a minute)
# `reverse`, every flag at its default but those named: GRPO 200 steps of 32 prompts x 8, held-out pass@1 of 128 prompts
# x 8 samples every 10 steps. K = 0 is grpo.py itself (async_grpo.py --mode emulated at K = 0 is grpo.py bit for bit).
E = "findings_embedded/"
GRPO = Arm("python grpo.py --seed {seed}", E + "grpo_s{seed}.jsonl.gz")
PPO = Arm("python ppo.py --seed {seed}", E + "ppo_s{seed}.jsonl.gz")
K2 = Arm("python async_grpo.py --mode emulated --max-staleness 2 --correction none --seed {seed}",
         E + "async_K2_none_s{seed}.jsonl.gz")
K4 = Arm("python async_grpo.py --mode emulated --max-staleness 4 --correction none --seed {seed}",
         E + "async_K4_none_s{seed}.jsonl.gz")
K4_TIS = Arm("python async_grpo.py --mode emulated --max-staleness 4 --correction tis --seed {seed}",
             E + "async_K4_tis_s{seed}.jsonl.gz")
CHAIN_OUTCOME = Arm("python grpo.py --task chain-8 --steps 150 --eval-every 10 --seed {seed}",
                    E + "chain8_outcome_s{seed}.jsonl.gz")
CHAIN_PARTIAL = Arm("python grpo.py --task chain-8-partial --steps 150 --eval-every 10 --seed {seed}",
                    E + "chain8_partial_s{seed}.jsonl.gz")
GRPO_512 = Arm("python grpo.py --train-size 512 --seed {seed}", E + "grpo_train512_s{seed}.jsonl.gz")
DR_GRPO_512 = Arm("python grpo.py --scale-rewards none --train-size 512 --seed {seed}", E + "drgrpo_train512_s{seed}.jsonl.gz")
IS_GRPO_512 = Arm("python is_grpo.py --train-size 512 --seed {seed}", E + "isgrpo_train512_s{seed}.jsonl.gz")
DYNAMIC = Arm("python grpo.py --dynamic-sampling --seed {seed}", E + "grpo_dynamic_s{seed}.jsonl.gz")
HARD = "--task reverse-long --num-iterations 2 --lr 1e-3 --eval-every 20"  # clipping binds from the second pass
GRPO_HARD = Arm(f"python grpo.py {HARD} --eps-low 0.2 --eps-high 0.2 --seed {{seed}}", E + "grpo_long_s{seed}.jsonl.gz")
GAPO_HARD = Arm(f"python gapo.py {HARD} --ratio-level token --eps-low 0.2 --eps-high-max 0.28 --seed {{seed}}",
                E + "gapo_token_long_s{seed}.jsonl.gz")

# ---------------------------------------------------------------- SmolLM2-135M-Instruct (a run is 21-45 minutes)
# The recipe (repro/real_model_recipe.py): word problems, 4 prompts x 8 completions, T 0.7, 128 new tokens, beta 0,
# shaped reward, lr 1e-5, 40 steps; held-out pass@1 of 100 problems x 4 samples at steps 0, 20 and 40. K = 0 and the
# shaped reward are the recipe's own grpo.py run.
S_K0 = Arm("python repro/real_model_recipe.py --runs shaped_lr1e-5:{seed}", "repro_real_model_recipe/shaped_lr1e-5_s{seed}.jsonl")
S_K2 = Arm("python repro/real_model_staleness.py --arms K2_none --seeds {seed}", "repro_real_model_staleness/K2_none_s{seed}.jsonl")
S_K4 = Arm("python repro/real_model_staleness.py --arms K4_none --seeds {seed}", "repro_real_model_staleness/K4_none_s{seed}.jsonl")
S_K4_TIS = Arm("python repro/real_model_staleness.py --arms K4_tis --seeds {seed}",
               "repro_real_model_staleness/K4_tis_s{seed}.jsonl")
S_PPO_LAM1 = Arm("python repro/real_model_ppo.py --arms equal_lam1 --seeds {seed}", "repro_real_model_ppo/equal_lam1_s{seed}.jsonl")
S_TURNS = Arm("python repro/real_model_recipe.py --runs turns_lr1e-5:{seed}", "repro_real_model_recipe/turns_lr1e-5_s{seed}.jsonl",
              key="eval/test/pass@1")  # the same held-out problems asked single-turn, as the shaped arm is asked
S_STEPWISE = Arm("python repro/real_model_recipe.py --runs stepwise_lr1e-5:{seed}",
                 "repro_real_model_recipe/stepwise_lr1e-5_s{seed}.jsonl")

# issue 53: the 2025-26 fixes, registered before any of their runs (4 seeds an arm)
S_PPO = Arm("python repro/real_model_ppo.py --arms equal --seeds {seed}", "repro_real_model_ppo/equal_s{seed}.jsonl")
S_VCPPO = Arm("python repro/real_model_ppo.py --arms equal_vcppo --seeds {seed}", "repro_real_model_ppo/equal_vcppo_s{seed}.jsonl")
S_K4_VCPO = Arm("python repro/real_model_staleness.py --arms K4_vcpo --seeds {seed}",
                "repro_real_model_staleness/K4_vcpo_s{seed}.jsonl")
S_GRPO_2ITER = Arm("python repro/real_model_recipe.py --runs shaped_2iter_lr1e-5:{seed}",
                   "repro_real_model_recipe/shaped_2iter_lr1e-5_s{seed}.jsonl")
S_GSPO_2ITER = Arm("python repro/real_model_recipe.py --runs gspo_2iter_lr1e-5:{seed}",
                   "repro_real_model_recipe/gspo_2iter_lr1e-5_s{seed}.jsonl")
FOUR = (0, 1, 2, 3)

REGISTERED = "2026-12-07"
FINDINGS = [
    Finding("rl_lifts", "GRPO against its base model",
            "GRPO's held-out pass@1 at the last step against the base model's (step 0)",
            Comparison(GRPO, None, SEEDS, REGISTERED), Comparison(S_K0, None, SEEDS, REGISTERED, unpaired=EARLIER)),
    Finding("ppo_vs_grpo", "PPO against GRPO at equal samples",
            "ppo.py against grpo.py at equal completions sampled (embedded: step 100; SmolLM2: one optimiser step a "
            "batch, GAE lam 1, step 40)",
            Comparison(PPO, GRPO, SEEDS, REGISTERED, step=100),
            Comparison(S_PPO_LAM1, S_K0, SEEDS, REGISTERED, unpaired=EARLIER)),
    Finding("k2", "Two steps of staleness against none",
            "async_grpo.py at K = 2, uncorrected (the bypass), against K = 0",
            Comparison(K2, GRPO, SEEDS, REGISTERED), Comparison(S_K2, S_K0, SEEDS, REGISTERED, unpaired=EARLIER)),
    Finding("k4", "Four steps of staleness against none",
            "async_grpo.py at K = 4, uncorrected, against K = 0",
            Comparison(K4, GRPO, SEEDS, REGISTERED), Comparison(S_K4, S_K0, SEEDS, REGISTERED, unpaired=EARLIER)),
    Finding("tis_k4", "TIS against no correction at K = 4",
            "async_grpo.py at K = 4 with truncated importance sampling (w capped at 2) against K = 4 uncorrected",
            Comparison(K4_TIS, K4, SEEDS, REGISTERED), Comparison(S_K4_TIS, S_K4, SEEDS, REGISTERED, unpaired=SEED2_LATER)),
    Finding("turns", "One step a turn against the shaped reward",
            "grpo.py asked one step a turn (1/N a right turn) against the shaped single-turn reward, both scored "
            "single-turn on the held-out problems",
            "the embedded chain task is multi-turn in both arms: no single-turn counterpart",
            Comparison(S_TURNS, S_K0, SEEDS, REGISTERED, unpaired=SEED2_LATER)),
    Finding("partial_credit", "Partial credit against the outcome reward",
            "grpo.py rewarded per correct intermediate result against the outcome-only (shaped) reward",
            Comparison(CHAIN_PARTIAL, CHAIN_OUTCOME, SEEDS, REGISTERED),
            Comparison(S_STEPWISE, S_K0, (0, 1), REGISTERED, unpaired=EARLIER)),
    Finding("vcppo_vs_lam095", "VC-PPO against PPO at lam 0.95",
            "ppo.py at one step a batch with decoupled GAE (critic lam 1), 4 batches of value warm-up, the critic at "
            "10x the lr, against lam 0.95 alone",
            "not asked on the embedded job (issue 53: SmolLM2's collapse)",
            Comparison(S_VCPPO, S_PPO, FOUR, "2026-12-07", unpaired=EARLIER)),
    Finding("vcppo_vs_lam1", "VC-PPO against PPO at lam 1",
            "ppo.py at one step a batch with decoupled GAE and value warm-up against lam 1 for both",
            "not asked on the embedded job (issue 53: SmolLM2's collapse)",
            Comparison(S_VCPPO, S_PPO_LAM1, FOUR, "2026-12-07", unpaired=EARLIER)),
    Finding("vcpo_k4", "VCPO against no correction at K = 4",
            "async_grpo.py at K = 4 with VCPO (ESS-scaled step, off-policy optimal baseline) against K = 4 uncorrected",
            "not asked on the embedded job (issue 53: SmolLM2's K = 4)",
            Comparison(S_K4_VCPO, S_K4, FOUR, "2026-12-07", unpaired=EARLIER)),
    Finding("vcpo_vs_tis", "VCPO against TIS at K = 4",
            "async_grpo.py at K = 4 with VCPO against K = 4 with truncated importance sampling (w capped at 2)",
            "not asked on the embedded job (issue 53: SmolLM2's K = 4)",
            Comparison(S_K4_VCPO, S_K4_TIS, FOUR, "2026-12-07", unpaired=EARLIER)),
    Finding("vcpo_vs_k0", "VCPO at K = 4 against K = 0",
            "async_grpo.py at K = 4 with VCPO against K = 0: how much of the stale batches' cost it leaves",
            "not asked on the embedded job (issue 53: SmolLM2's K = 4)",
            Comparison(S_K4_VCPO, S_K0, FOUR, "2026-12-07", unpaired=EARLIER)),
    Finding("gspo", "GSPO against GRPO at two passes a batch",
            "grpo.py with GSPO's sequence ratio (clip 3e-4, 4e-4) against the token ratio (clip 0.2), both two passes "
            "a batch",
            "not asked on the embedded job (issue 53)",
            Comparison(S_GSPO_2ITER, S_GRPO_2ITER, FOUR, "2026-12-07")),
    Finding("dr_grpo", "Dr. GRPO against GRPO",
            "grpo.py without the group std in the advantage (Dr. GRPO) against GRPO (512 training prompts)",
            Comparison(DR_GRPO_512, GRPO_512, SEEDS, REGISTERED), "not asked on SmolLM2"),
    Finding("is_grpo", "IS-GRPO against GRPO",
            "is_grpo.py (prompts drawn in proportion to their reward std) against grpo.py (512 training prompts)",
            Comparison(IS_GRPO_512, GRPO_512, SEEDS, REGISTERED), "not asked on SmolLM2"),
    Finding("dynamic_sampling", "Dynamic sampling against GRPO at equal steps",
            "grpo.py with DAPO's dynamic sampling (all-equal groups refilled) against grpo.py, after 200 steps",
            Comparison(DYNAMIC, GRPO, SEEDS, REGISTERED), "not asked on SmolLM2"),
    Finding("gapo", "GAPO's adaptive clip against a fixed clip",
            "gapo.py (token ratio, eps_high up to 0.28 by the group's correct count) against grpo.py at eps 0.2, "
            "two passes a batch on reverse-long",
            Comparison(GAPO_HARD, GRPO_HARD, SEEDS, REGISTERED), "not asked on SmolLM2"),
]

@dataclass(frozen=True)
class Probe:
    """A run looked at, not a comparison decided: one or two seeds of a setting that might explain a finding."""
    key: str
    question: str
    arm: Arm
    seeds: tuple[int, ...]
    registered: str


PROBES = [
    Probe("critic_lam1_alone", "ppo.py at one step a batch, lam 0.95, the critic's returns at lam 1 and 10x the lr (decoupled "
          "GAE alone)",
          Arm("python repro/real_model_ppo.py --arms equal_critic_lam1 --seeds {seed}",
              "repro_real_model_ppo/equal_critic_lam1_s{seed}.jsonl"), (0, 1), "2026-12-07"),
    Probe("warmup_alone", "ppo.py at one step a batch, lam 0.95, 4 batches of value warm-up, the critic at 10x the lr "
          "(warm-up alone)",
          Arm("python repro/real_model_ppo.py --arms equal_warmup --seeds {seed}",
              "repro_real_model_ppo/equal_warmup_s{seed}.jsonl"), (0, 1), "2026-12-07"),
    Probe("seq_tis_k4", "async_grpo.py at K = 4 with seq-tis (sequence weight truncated at 2)",
          Arm("python repro/real_model_staleness.py --arms K4_seq_tis --seeds {seed}",
              "repro_real_model_staleness/K4_seq_tis_s{seed}.jsonl"), (0, 1), "2026-12-07"),
    Probe("seq_mis_k4", "async_grpo.py at K = 4 with seq-mis (a sequence dropped where its weight passes 2)",
          Arm("python repro/real_model_staleness.py --arms K4_seq_mis --seeds {seed}",
              "repro_real_model_staleness/K4_seq_mis_s{seed}.jsonl"), (0, 1), "2026-12-07"),
]

@dataclass(frozen=True)
class Warning:
    """Which per-step diagnostic warns of a collapse before its onset: thresholds set on the embedded job's healthy
    runs, then scored on the embedded runs and on every SmolLM2 run of the staleness study (repro/findings.py)."""
    key: str
    title: str
    question: str
    embedded: tuple[Arm, ...]
    """the embedded runs scored (and whose runs without an onset set the thresholds)"""
    seeds: tuple[int, ...]
    smollm2: tuple[str, ...]
    """globs of the SmolLM2 logs scored, under repro/results/logs/"""
    registered: str


K8_FAST = Arm("python async_grpo.py --mode emulated --max-staleness 8 --correction none --lr 2e-3 --steps 100 --seed {seed}",
              E + "async_K8_none_lr2e-3_s{seed}.jsonl.gz")  # async_early_warning.py's collapse setting
WARNING = Warning(
    "early_warning", "Early warning of a collapse",
    "which per-step diagnostic crosses a threshold set on the embedded job's healthy runs before a collapse's onset "
    "(read from training length and reward)",
    (GRPO, K2, K4, K4_TIS, K8_FAST), SEEDS,
    ("repro_real_model_staleness/*.jsonl", "repro_real_model_recipe/shaped_lr1e-5_s*.jsonl"), REGISTERED)

# Logs no arm claims, each with its reason.
EXCLUDED = {
    "bench_study_run/*": "timing benchmark (benchmarks/study_run.py): K = 0 seed 2 rerun before and after a speed-up, "
                         "torch's products",
    "bench_study_run_onednn/*": "timing benchmark: K = 0 seed 2 rerun before and after oneDNN's products (a rerun of a "
                                "seed, not a sample)",
    "repro_real_model_staleness/K1_tis_s*": "probe (issue 34, part 1): K = 1 with tis, one seed",
    "repro_real_model_staleness/K4_decoupled_*": "probe (issue 34, part 2): decoupled at K = 4, capped at 2 or not, "
                                                 "two seeds each",
    "repro_real_model_staleness/K4_icepop_s*": "probe (issue 34, part 2): icepop at K = 4, two seeds",
    "repro_real_model_staleness/K4_none_2iter_s*": "probe (issue 34, part 2): K = 4 at two passes a batch, three seeds",
    "repro_real_model_staleness/K4_none_noclip_s*": "probe (issue 34, part 1): K = 4 with the clip opened, two seeds",
    "repro_real_model_staleness/K4_tis_cap*": "probe (issue 34, part 2): tis capped at 3 or 5, two seeds each",
    "repro_real_model_ppo/defaults_*": "probe (issue 34, part 4): ppo.py at 4 epochs x 4 minibatches (its defaults "
                                       "then), lam 0.95 or 1, two seeds each",
    "repro_real_model_ppo/equal_separate_s*": "probe (issue 34, part 4): a separate critic, three seeds",
    "repro_real_model_ppo/equal_lam1_lr16x_s*": "probe (issue 34, part 4): one step at 16x the lr, one seed",
    "repro_real_model_ppo/minibatches4_lam1_s*": "probe (issue 34, part 4): 1 epoch x 4 minibatches, one seed",
    "repro_real_model_ppo_first_batch/*": "probe (issue 34, part 4): the first batch's passes at equal steps, one seed",
    "repro_real_model_turns_clip/*": "probe (issue 34, part 3): the clip by turn position, one seed each",
}
