"""The real-model studies' settings: repro/real_model_ppo.py asks ppo.py what grpo.py's recipe asks, and the recipes
of repro/real_model_recipe.py fit the 24 GB machine they are run on."""

import sys
from pathlib import Path

import async_grpo
import grpo
import ppo
import pytest
import tyro
from conftest import ROOT

sys.path.insert(0, str(ROOT / "repro"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import study_run  # noqa: E402
import early_warning_across  # noqa: E402
import real_model_async_pays  # noqa: E402
import real_model_engine  # noqa: E402
import real_model_ppo  # noqa: E402
import real_model_recipe  # noqa: E402
import real_model_staleness  # noqa: E402
import real_model_why  # noqa: E402
import runner  # noqa: E402
from real_model_ppo import ARMS, Args, ppo_flags  # noqa: E402
from real_model_recipe import DATA, RECIPES, Args as RecipeArgs, by_turn, flags, rise_in_se, with_recipe  # noqa: E402
from real_model_staleness import ARMS as STALENESS_ARMS  # noqa: E402
from real_model_why import Args as WhyArgs, evaluation_sets, score_model, training_log  # noqa: E402

from common.models import resolve_model  # noqa: E402

SHARED = ["model", "task", "data_path", "eval_data_path", "extra_eval_data_path", "temperature", "max_new_tokens",
          "prompts_per_step", "num_generations", "steps", "eval_every", "eval_prompts", "eval_samples", "eval_k", "reward",
          "reward_weights", "lr"]


@pytest.fixture
def here(problems):
    """The studies' flags with their data files (data/word_problems/, written by the recipe on its first run and not in
    git) taken from conftest's problems instead, so that check_args finds them on a fresh clone."""
    folder = str(Path(problems[0]).parent)
    return lambda args: [a.replace(str(DATA), folder) for a in args]


def test_ppo_arms_get_the_grpo_recipes_setting_and_differ_only_in_what_their_names_say(here):
    recipe = tyro.cli(grpo.Args, args=here(with_recipe(flags(RecipeArgs()), RECIPES["shaped_lr1e-5"])))
    shared = [k for k in SHARED if k not in ("lr", "steps")]  # the lr: but in the arm that multiplies it; steps below
    for arm, extra in ARMS.items():
        args = tyro.cli(ppo.Args, args=here([*ppo_flags(Args()), *extra]))
        ppo.check_args(args, num_processes=1)
        assert {k: getattr(args, k) for k in shared} == {k: getattr(recipe, k) for k in shared}, arm
        warmup = 4 if arm.endswith(("vcppo", "warmup")) else 0  # VC-PPO's value warm-up: batches the policy does not take
        assert (args.value_warmup_steps, args.steps) == (warmup, recipe.steps + warmup), arm  # 40 policy updates
        assert args.critic_lam == (1.0 if arm.endswith(("vcppo", "critic_lam1")) else None), arm
        assert args.vf_lr == (10 * recipe.lr if arm.endswith(("vcppo", "critic_lam1", "warmup")) else None), arm
        assert args.lr == pytest.approx(recipe.lr * (16 if arm.endswith("lr16x") else 1)), arm
        assert recipe.beta == 0 and args.kl_coef == 0 and args.no_eos_penalty is None
        steps = 16 if arm.startswith("defaults") else 4 if arm.startswith(("minibatches4", "epochs4")) else 1
        assert args.ppo_epochs * args.minibatches == steps, arm
        assert args.ppo_epochs == (4 if arm.startswith(("defaults", "epochs4")) else 1), arm  # a sample's uses
        assert args.critic == ("separate" if arm.endswith("separate") else "head")
        # two models' activations, or a whole batch's 4 times over, do not fit 24 GB
        assert args.gradient_checkpointing == (arm.endswith("separate") or arm.startswith("epochs4"))
        actor_lam1 = "lam1" in arm.replace("critic_lam1", "")  # the actor's lam; critic_lam1: the critic's alone
        assert args.lam == pytest.approx(1.0 if actor_lam1 else 0.95) and args.gamma == pytest.approx(1.0)


def test_the_study_run_benchmarks_grpo_run_is_the_recipes_run_of_its_seed(here):
    """benchmarks/study_run.py's kept run stands for a seed's K = 0 run where the recipe study has none (runner.k0_logs;
    seed 2 until 2026-12-05): the same flags."""
    bench = tyro.cli(grpo.Args, args=here(study_run.grpo_flags(study_run.Args())))
    recipe = tyro.cli(grpo.Args, args=here([*with_recipe(flags(RecipeArgs()), RECIPES["shaped_lr1e-5"]), "--seed", "2"]))
    assert bench.seed == 2 and vars(bench) == vars(recipe)


def test_every_study_reads_the_same_k0_run_of_a_seed(tmp_path, monkeypatch):
    """A seed's K = 0 run (grpo.py on the recipe) is the recipe study's kept log, else the study-run benchmark's run of
    the same flags (the test above): the ppo table, the early-warning labels and the async-pays time model all read
    that one, so that no table compares against a K = 0 run another table does not."""
    for module in (runner, real_model_ppo, early_warning_across, real_model_async_pays):
        monkeypatch.setattr(module, "LOGS", tmp_path)

    def log(name: str, accuracy: float) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f'{{"step": 40, "eval/pass@1": {accuracy}}}\n{{"wall_s": 1.0, "peak_rss_mb": 2.0}}\n')
        return path

    recipe0 = log("repro_real_model_recipe/shaped_lr1e-5_s0.jsonl", 0.2)
    log("bench_study_run_onednn/K0_s0_after.jsonl", 0.3)  # seed 0 has the recipe's: this one is not read
    bench3 = log("bench_study_run_onednn/K0_s3_after.jsonl", 0.4)  # seed 3 has only the benchmark's
    assert runner.k0_logs() == {0: recipe0, 3: bench3}
    assert {s: real_model_ppo.grpo_run(s)["rows"][0]["eval/pass@1"] for s in (0, 3)} == {0: 0.2, 3: 0.4}
    assert real_model_ppo.grpo_run(1) is None
    assert {r.seed: r.rows[0]["eval/pass@1"] for r in early_warning_across.real_runs()} == {0: 0.2, 3: 0.4}
    assert {s: rows[0]["eval/pass@1"] for s, rows in real_model_async_pays.logged_runs()["K0"].items()} == {0: 0.2, 3: 0.4}


def test_each_staleness_arm_is_the_recipe_at_its_lag_with_only_what_its_name_says_changed(here):
    """K4_tis_cap5 and K4_tis_cap3 are K4_tis with C = 5 and 3, K4_decoupled_cap2 K4_decoupled with AReaL's cap at 2,
    K4_none_2iter K4_none at two passes, K4_none_noclip K4_none with the clip opened: a misspelt flag would fail a
    30-minute run at its start, a forgotten one would run the wrong question."""
    recipe = with_recipe(flags(RecipeArgs()), RECIPES["shaped_lr1e-5"])
    parsed = {}
    for arm, (script, extra) in STALENESS_ARMS.items():
        module = grpo if script == "grpo.py" else async_grpo
        parsed[arm] = tyro.cli(module.Args, args=here([*recipe, *extra]))
        module.check_args(parsed[arm], num_processes=1)

    def differs(a: str, b: str) -> set[str]:
        return {k for k in vars(parsed[a]) if getattr(parsed[a], k) != getattr(parsed[b], k)}

    assert differs("K4_tis_cap5", "K4_tis") == {"tis_cap"} and parsed["K4_tis_cap5"].tis_cap == pytest.approx(5)
    assert differs("K4_tis_cap3", "K4_tis") == {"tis_cap"} and parsed["K4_tis_cap3"].tis_cap == pytest.approx(3)
    assert differs("K4_decoupled_cap2", "K4_decoupled") == {"decoupled_cap"}
    assert parsed["K4_decoupled_cap2"].decoupled_cap == pytest.approx(2)
    assert differs("K4_none_2iter", "K4_none") == {"num_iterations"} and parsed["K4_none_2iter"].num_iterations == 2
    assert differs("K4_none_noclip", "K4_none") == {"eps_low", "eps_high", "save_every"}
    assert differs("K4_tis", "K4_none") == {"correction"} and differs("K4_none", "K2_none") == {"max_staleness"}
    assert all(parsed[arm].max_staleness == int(arm[1]) for arm in STALENESS_ARMS if arm.startswith("K") and arm != "K0")


def test_the_multi_turn_recipe_trains_one_group_at_a_time(here):
    """Its trajectories (every turn and observation of a problem) are about three single-turn completions long; all 32
    in one forward were killed by the 24 GB machine's out-of-memory killer at the first step. Micro-batches of one
    group each accumulate the same one-batch update (tests/test_grpo.py) in about a quarter of the activations."""
    args = tyro.cli(grpo.Args, args=here(with_recipe(flags(RecipeArgs()), RECIPES["turns_lr1e-5"])))
    grpo.check_args(args, num_processes=1)
    assert args.task == "gsm8k-turns" and args.minibatches == args.prompts_per_step and args.num_iterations == 1


def test_the_two_pass_multi_turn_recipes_differ_from_the_one_pass_one_only_in_what_their_names_say(here):
    """turns2_lr1e-5 asks where in a trajectory the clip binds, which needs a ratio that moves: a second pass;
    turns2_tokenmean_lr1e-5 asks it again with each token weighted alike, whatever its trajectory's length."""
    parsed = {name: tyro.cli(grpo.Args, args=here(with_recipe(flags(RecipeArgs()), RECIPES[name])))
              for name in ("turns_lr1e-5", "turns2_lr1e-5", "turns2_tokenmean_lr1e-5")}
    for args in parsed.values():
        grpo.check_args(args, num_processes=1)

    def differs(a: str, b: str) -> set[str]:
        return {k for k in vars(parsed[a]) if getattr(parsed[a], k) != getattr(parsed[b], k)}

    assert differs("turns2_lr1e-5", "turns_lr1e-5") == {"num_iterations"} and parsed["turns2_lr1e-5"].num_iterations == 2
    assert differs("turns2_tokenmean_lr1e-5", "turns2_lr1e-5") == {"loss_agg"}
    assert parsed["turns2_tokenmean_lr1e-5"].loss_agg == "token-mean"


@pytest.mark.parametrize("study, variants", [
    (real_model_recipe, [{}, {"runs": ["turns2_lr1e-5:0"], "steps": 12, "eval_every": 1000, "eval_prompts": 20,
                              "output_dir": "runs/repro_real_model_turns_clip", "name": "real_model_turns_clip"}]),
    (real_model_why, [{}, {"runs": ["stepwise_lr1e-5_s0", "stepwise_lr1e-5_s1"], "name": "real_model_why_stepwise"},
                      {"problems": 50, "samples": 8, "max_new_tokens": 64, "temperature": 1.0},
                      {"runs": ["turns_lr1e-5_s0"], "multi_turn": True, "name": "real_model_why_turns"}]),
    (real_model_ppo, [{}, {"arms": ["equal"], "seeds": [0, 1, 2], "finished_only": True},
                      {"output_dir": "runs/elsewhere", "name": "real_model_ppo_elsewhere", "steps": 20}]),
    (real_model_staleness, [{}, {"arms": ["K0", "K4_tis_cap3"], "name": "real_model_staleness_part2", "finished_only": True},
                            {"recipe": "accuracy_lr1e-5", "output_dir": "runs/elsewhere", "check_k0": True}]),
    (real_model_engine, [{}, {"arms": ["hf"], "seed": 1, "dtype": "float32", "recipe": "accuracy_lr1e-5",
                              "output_dir": "runs/elsewhere", "name": "real_model_engine_fp32"}]),
])
def test_each_real_model_tables_command_is_the_one_that_wrote_it(study, variants):
    """A table's first line, run, writes the same table into the same directory: every flag not at its default (a
    study read back from another --output-dir would run again; another --recipe would be another study)."""
    for changed in variants:
        args = study.Args(**changed)
        script, *flags = study.command(args).strip("`").split()[1:]
        assert script == f"repro/{study.__name__}.py" and tyro.cli(study.Args, args=flags) == args


def test_the_recipes_flags_bring_the_data_they_name(tmp_path, monkeypatch):
    """data/word_problems/ is not in git: on a fresh clone the staleness, ppo and engine studies, which start from the
    recipe's flags, found no files and every run exited with status 2. The flags write what they name (fixed seeds: the
    same files on every machine)."""
    monkeypatch.setattr(real_model_recipe, "DATA", tmp_path / "word_problems")
    named = flags(RecipeArgs())
    paths = [Path(named[named.index(flag) + 1]) for flag in ("--data-path", "--eval-data-path", "--extra-eval-data-path")]
    assert [p.parent for p in paths] == [tmp_path / "word_problems"] * 3 and all(p.is_file() for p in paths)


def test_the_pooled_line_counts_each_run_once_from_every_table():
    """A rerun of a seed is another draw: the pooled line is each arm's mean ± se over every run the tables hold, a run
    that two tables read (same arm, seed and wall time) once; the early-warning table below the first is not read."""
    table = "\n".join([
        "| arm | seed | held-out pass@1: base -> final | transfer | wall time (s) |", "|---|---|---|---|---|",
        "| K0 | 0 | 0.100 ± 0.015 -> 0.200 ± 0.024 | x | 1365 |",
        "| K2_none | 0 | 0.100 ± 0.015 -> 0.100 ± 0.02 | x | 1519 |",
        "", "| arm | seed | behaviour KL |", "|---|---|---|", "| K0 | 0 | 0 -> 0 |"])
    again = "\n".join([table.split("\n\n")[0], "| K0 | 1 | 0.085 ± 0.015 -> 0.300 ± 0.03 | x | 1254 |",
                       "| K0 | 0 | 0.100 ± 0.015 -> 0.250 ± 0.03 | x | 3433 |",
                       "| K2_none | 1 | 0.085 -> 0.120 ± 0.02 | x | 2126 |",
                       "| threaded | 0 | 0.1 -> 0.025 ± 0.01 | x | 1996 |"])
    runs = real_model_staleness.table_runs(table) | real_model_staleness.table_runs(again)
    assert sorted(runs.values()) == [0.025, 0.1, 0.12, 0.2, 0.25, 0.3]  # K0 seed 0's 1365 s run read by both, once
    # K0: 0.25 ± 0.05 / 3 ** 0.5; K2_none: 0.11 ± 0.01; K0 - K2_none: 0.14 / (0.0289 ** 2 + 0.01 ** 2) ** 0.5 = 4.58
    assert real_model_staleness.pooled(runs, ["K0", "K2_none", "threaded"]) == (
        "K0 0.250 ± 0.029 (3), K2_none 0.110 ± 0.010 (2), threaded 0.025 (1); K0 - K2_none 0.140 (4.6 se)")


def test_a_table_to_pool_with_that_is_not_there_is_refused_before_any_run():
    with pytest.raises(SystemExit, match="--pool-with: 'nope' is not a table in repro/results/"):
        real_model_staleness.main(real_model_staleness.Args(arms=["K0"], pool_with=["nope"]))


def test_a_rise_measured_without_spread_is_zero_when_nothing_moved():
    """A small evaluation can score 0 at both ends (greedy on 20 transfer prompts): both standard errors are 0. No
    rise is 0 standard errors; a move between the two sure ends (0 -> 1) has no finite size in standard errors."""
    zero, one = {"greedy": 0.0, "greedy_se": 0.0}, {"greedy": 1.0, "greedy_se": 0.0}
    assert rise_in_se(zero, zero, "greedy") == 0.0  # exact by construction: the no-spread branch returns the literal 0.0
    assert rise_in_se(zero, one, "greedy") == float("inf") and rise_in_se(one, zero, "greedy") == float("-inf")
    assert rise_in_se({"greedy": 0.1, "greedy_se": 0.03}, {"greedy": 0.5, "greedy_se": 0.04}, "greedy") == pytest.approx(8.0)


def test_the_clip_by_turn_is_each_turns_mean_over_the_steps_that_had_it():
    """Turn 3 appears in one step of two: its mean is that step's, with no se; turn 1's se is the sd over steps / sqrt 2.
    The paired spread difference is taken within each step: turn 1 - turn 2 is -0.1 both times, whatever the steps'
    levels; turn 2 - turn 3 has one step, no se, and is left out."""
    rows = [{"step": 1, "turns/clip_frac_t1": 0.01, "turns/ratio_std_t1": 0.1, "turns/clip_frac_t2": 0.0,
             "turns/ratio_std_t2": 0.2},
            {"step": 2, "turns/clip_frac_t1": 0.03, "turns/ratio_std_t1": 0.3, "turns/clip_frac_t2": 0.02,
             "turns/ratio_std_t2": 0.4, "turns/clip_frac_t3": 0.05, "turns/ratio_std_t3": 0.5},
            {"step": 0, "eval/pass@1": 0.1}]
    assert by_turn(rows) == ("turn 1: 2.00 ± 1.00 % / 0.2000 (n = 2); turn 2: 1.00 ± 1.00 % / 0.3000 (n = 2); "
                             "turn 3: 5.00 ± nan % / 0.5000 (n = 1). Ratio spread, paired by step: "
                             "turn 1 - turn 2: -0.1000 ± 0.0000 (n = 2, 0 above 0)")


def test_the_why_tables_multi_turn_set_asks_the_held_out_problems_one_step_a_turn(problems):
    """--multi-turn adds the held-out rows as gsm8k-turns serves them (as a turns run is evaluated), grouped by the
    same reference steps; a trajectory is cut when any model turn ran to the budget (4 tokens a turn here: each one)."""
    args = WhyArgs(problems=3, samples=1, max_new_tokens=4, multi_turn=True)
    sets, raw = evaluation_sets(args, Path(problems[1]).parent)
    assert list(sets) == ["held-out", "transfer", "held-out, multi-turn"]
    assert sets["held-out, multi-turn"][0].name == "gsm8k-turns" and raw["held-out, multi-turn"] == raw["held-out"]
    chosen = {name: sets[name] for name in ("held-out", "held-out, multi-turn")}
    out = score_model(resolve_model("smollm2-135m-instruct", "gsm8k"), chosen, raw, args)
    assert [p["steps"] for p in out["held-out, multi-turn"]] == [p["steps"] for p in out["held-out"]]
    assert all(p["cut"] == [True] for p in out["held-out, multi-turn"])


def test_the_why_tables_training_row_reads_a_multi_turn_log():
    """A gsm8k-turns run logs no reward parts (its environment credits each turn): the accuracy column is the share of
    trajectories whose final answer is right (accuracy/train, what gsm8k_reward is for one turn), the format '–'."""
    def rows(turns: bool) -> list[dict]:
        out = []
        for step in range(1, 21):
            row = {"step": step, "policy/grad_norm": 1.0, "frac_reward_zero_std": 0.5 if step <= 10 else 0.25,
                   "completions/clipped_frac": 0.1, "accuracy/train": 0.1 if step <= 10 else 0.2}
            if not turns:
                row |= {"reward/gsm8k_reward": row["accuracy/train"], "reward/gsm8k_format_reward": 0.5}
            out.append(row)
        return [{"step": 0, "eval/pass@1": 0.1}, *out]

    assert training_log("turns_lr1e-5_s0", rows(True)) == "| turns_lr1e-5_s0 | 0.50 -> 0.75 | 0.10 -> 0.10 | 0.100 -> 0.200 | – |"
    assert training_log("shaped_lr1e-5_s0", rows(False)) == ("| shaped_lr1e-5_s0 | 0.50 -> 0.75 | 0.10 -> 0.10 | "
                                                             "0.100 -> 0.200 | 0.50 -> 0.50 |")
