"""Throughput: postrl's grpo.py against TRL's GRPOTrainer on identical work, async_grpo.py against
grpo.py, and how the cost of a step grows.

    pip install -e ".[bench]"                               # trl, matplotlib
    python benchmarks/throughput.py                         # compare, A B A B ...: ~6 minutes on 2 CPU cores
    python benchmarks/throughput.py --mode growth           # step time as P, G and T double: ~6 minutes
    python benchmarks/throughput.py --mode real             # SmolLM2-135M-Instruct: grpo.py vs TRL, full and LoRA
    python benchmarks/throughput.py --mode memory           # SmolLM2: peak memory and samples/s by option

compare: every arm runs in its own child process (so its peak resident memory is its own), one at a
time, in rounds: each round runs grpo.py, TRL, async_grpo.py --max-staleness 1 and 2 once, in that
order. Identical work: the embedded `reverse` model and tokenizer, its task and exact-match reward,
32 prompts x 8 completions per step, at most 8 new tokens, temperature 1 (no top-k / top-p),
AdamW lr 5e-4 with weight decay 0 and a constant schedule, gradient clipping at 1, beta 0.04 with a
k3 KL to the reference, GRPO's per-sequence loss average and group std scaling, one update per
batch. Each child runs --warmup steps and then --steps measured steps; reported per step:
generation (sampling + scoring) and training seconds, samples/s and generated tokens/s over the
measured steps, the child's peak RSS and its wall time from start to exit (start-up, the warm-up and
measured steps, the evaluations at both ends: the run end to end). Medians and spreads over rounds; ratios
are pair by pair (round i of one arm against round i of the other). Writes benchmarks/results/compare.md.
Other arms (--arms): async_K0; async_K0_all / async_K1_all / async_K2_all, the generation thread with every
core (--generator-threads <cores>; by default it samples with one on a CPU); async_K1_split / async_K2_split, the
cores split evenly between the threads; grpo_gc / trl_gc, grpo_lora / trl_lora (the real model).

real: compare's protocol on a real model: SmolLM2-135M-Instruct (`--model smollm2-135m-instruct`) on the
offline word problems through the GSM8K path (chat template, GSM8K reward), --real-prompts x --real-generations
completions of at most --real-max-new-tokens, float32 on a CPU (bf16 on a GPU with --real-dtype), beta 0.04, lr 1e-6,
one update per batch; arms grpo, trl, and both with LoRA (r 16, alpha 32, all linear layers; TRL through its
peft_config). Writes benchmarks/results/compare_real.md.

memory: peak memory (RSS of each child on a CPU, torch's max allocated on a GPU) and samples/s of grpo.py on
SmolLM2 as options are added one at a time: float32, bf16 mixed precision, + gradient checkpointing, + LoRA,
and async_grpo.py K = 1 without and with LoRA; and the bytes per parameter each takes. Writes
benchmarks/results/memory.md.

growth: grpo.py step time (sampling + training) for prompts per step P, completions per prompt G and
completion length T each doubling from (16, 8, 16), the others fixed. It runs a randomly initialised
model of the embedded architecture (so completions run to the length budget instead of stopping
after the task's 5 tokens), and fits the exponent b of time ~ x^b. Writes benchmarks/results/growth.{md,png}.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from common.logging import read_metrics  # noqa: E402
RESULTS = ROOT / "benchmarks" / "results"

# The work both libraries do: postrl flags and the TRL GRPOConfig fields that mean the same thing.
PROMPTS, G, MAX_NEW, LR, BETA = 32, 8, 8, 5e-4, 0.04
# Timed runs evaluate only the ends, on 8 prompts, and never checkpoint.
NO_EVAL_NO_SAVE = ["--eval-every", "0", "--eval-prompts", "8", "--eval-samples", "1", "--eval-k", "1", "--save-every", "100000"]


@dataclass
class Work:
    """What every arm of a comparison does per step."""
    prompts: int = PROMPTS
    generations: int = G
    max_new: int = MAX_NEW
    lr: float = LR
    beta: float = BETA
    model: str = "embedded"  # or a real model's short name; the task is then gsm8k on the word problems
    dtype: str = "float32"
    device: str = "cpu"

    def flags(self) -> list[str]:
        flags = ["--prompts-per-step", str(self.prompts), "--num-generations", str(self.generations), "--max-new-tokens",
                 str(self.max_new), "--lr", str(self.lr), "--beta", str(self.beta), "--device", self.device, "--dtype", self.dtype]
        if self.model != "embedded":
            data = ROOT / "data" / "word_problems"
            flags += ["--model", self.model, "--task", "gsm8k", "--data-path", str(data / "train.jsonl"),
                      "--eval-data-path", str(data / "test.jsonl")]
        return flags


EMBEDDED_WORK = Work()
LORA_FLAGS = ["--lora-r", "16", "--lora-alpha", "32"]


@dataclass
class Args:
    mode: Literal["compare", "growth", "real", "memory"] = "compare"
    rounds: int = 3
    """compare: A B A B rounds"""
    warmup: int = 3
    """steps run before the measured ones in every child"""
    steps: int = 10
    """measured steps per child"""
    arms: list[str] = field(default_factory=lambda: ["grpo", "trl", "async_K1", "async_K2"])
    output_dir: str = "runs/bench"
    name: str | None = None
    """compare / real: the results file, benchmarks/results/<name>.md (default: compare, compare_real); memory: memory"""
    memory_arms: list[str] | None = None
    """memory: only these options (labels as in the table, e.g. 'float32 + gradient checkpointing'; default: all)"""
    real_prompts: int = 4
    real_generations: int = 4
    real_max_new_tokens: int = 64
    real_dtype: str = "float32"
    real_device: str = "cpu"
    baseline: str | None = None
    """arm grpo_baseline: grpo.py of another checkout of postrl (say `git worktree add /tmp/before <commit>`) on the
    same work, so that before and after are measured in one run, alternating"""


# ---------------------------------------------------------------- children
def run_child(argv: list[str], env: dict | None = None, cwd: Path = ROOT) -> tuple[float, float]:
    """Run a child process; its wall seconds (start-up to exit) and peak RSS in MB. Its stderr goes to a file, not a
    pipe: a long run's progress bar would fill a pipe nobody reads until the child exits, and block it."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **(env or {})})
        _, status, usage = os.wait4(proc.pid, 0)
        if status != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(argv)} failed:\n{err.read().decode(errors='replace')[-3000:]}")
    return time.perf_counter() - t0, usage.ru_maxrss / 1024


def postrl_child(script: str, run_dir: Path, steps: int, extra: list[str], work: Work = EMBEDDED_WORK,
                 root: Path = ROOT) -> list[dict]:
    """Per-step seconds of generation and training, and generated tokens, from the script's metrics (the script of
    the checkout at root: this one, or --baseline's)."""
    flags = ["--steps", str(steps), *NO_EVAL_NO_SAVE, *work.flags(), "--output-dir", str(run_dir.parent),
             "--run-name", run_dir.name, *extra]
    wall, rss = run_child([sys.executable, script, *flags], cwd=root)
    rows = [r for r in read_metrics(run_dir) if "time/train_s" in r]
    wait = "time/learner_wait_s" if script == "async_grpo.py" else "time/rollout_s"
    return [{"gen_s": r[wait], "train_s": r["time/train_s"], "samples": work.prompts * work.generations,
             "tokens": r["throughput/tokens_per_s"] * (r[wait] + r["time/train_s"]), "rss_mb": rss, "wall_s": wall,
             "gpu_mb": r.get("memory/max_allocated_mb")} for r in rows]


TRL_CHILD = r'''
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from transformers import AutoModelForCausalLM, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from common.models import load_tokenizer, resolve_model
from common.tasks import load_task

out, steps, w, lora, checkpointing = sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]), sys.argv[5] == "1", sys.argv[6] == "1"
prompts, G = w["prompts"], w["generations"]
torch.manual_seed(0)
if w["model"] == "embedded":
    task, path = load_task("reverse"), resolve_model("embedded", "reverse")
    train = task.train
else:  # the GSM8K path: a chat model gets the chat template; TRL applies it to conversational prompts
    data = sys.argv[1] + "/data/word_problems/"
    task, path = load_task("gsm8k", data + "train.jsonl", data + "test.jsonl"), resolve_model(w["model"], "gsm8k")
    train = task.train.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})
tokenizer = load_tokenizer(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
peft_config = None
if lora:
    from peft import LoraConfig
    peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")

def reward(completions, answer, **kwargs):
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return task.reward(texts, answer)

config = GRPOConfig(
    output_dir=out + "/trl", per_device_train_batch_size=prompts * G, gradient_accumulation_steps=1, num_generations=G,
    max_completion_length=w["max_new"], temperature=1.0, top_p=1.0, top_k=0, learning_rate=w["lr"], weight_decay=0.0,
    lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, beta=w["beta"], loss_type="grpo", scale_rewards="group",
    num_iterations=1, max_steps=steps, logging_steps=100000, save_strategy="no", report_to="none",
    use_cpu=w["device"] == "cpu", bf16=w["dtype"] == "bfloat16", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    gradient_checkpointing=checkpointing,  # TRL's default is True; set explicitly so that the arms match postrl's
)
trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=train, processing_class=tokenizer,
                      peft_config=peft_config)
timings, gen = [], {"s": 0.0, "tokens": 0}
generate_and_score = trainer._generate_and_score_completions

def timed(*a, **k):  # sampling + scoring of a step's batch
    t0 = time.perf_counter()
    result = generate_and_score(*a, **k)
    gen["s"] += time.perf_counter() - t0
    gen["tokens"] += int(result["completion_mask"].sum())
    return result

trainer._generate_and_score_completions = timed

class StepTimer(TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
        self.t0, gen["s"], gen["tokens"] = time.perf_counter(), 0.0, 0
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    def on_step_end(self, args, state, control, **kw):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        total = time.perf_counter() - self.t0
        gpu = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
        timings.append({"gen_s": gen["s"], "train_s": total - gen["s"], "samples": prompts * G, "tokens": gen["tokens"],
                        "gpu_mb": gpu})

trainer.add_callback(StepTimer())
trainer.train()
json.dump(timings, open(out + "/steps.json", "w"))
'''


def trl_child(run_dir: Path, steps: int, work: Work = EMBEDDED_WORK, lora: bool = False, checkpointing: bool = False) -> list[dict]:
    from dataclasses import asdict

    run_dir.mkdir(parents=True, exist_ok=True)
    wall, rss = run_child([sys.executable, "-c", TRL_CHILD, str(ROOT), str(run_dir), str(steps), json.dumps(asdict(work)),
                        "1" if lora else "0", "1" if checkpointing else "0"])
    return [{**r, "rss_mb": rss, "wall_s": wall} for r in json.loads((run_dir / "steps.json").read_text())]


ALL = ["--generator-threads", str(os.cpu_count() or 2)]
SPLIT = ["--learner-threads", str(max(1, (os.cpu_count() or 2) // 2)), "--generator-threads", str(max(1, (os.cpu_count() or 2) // 2))]


def async_arm(K: int, layout: list[str]):
    return lambda d, n, w: postrl_child("async_grpo.py", d, n, ["--max-staleness", str(K), *layout], w)


ARMS = {  # (run_dir, steps, work) -> per-step rows
    "grpo": lambda d, n, w: postrl_child("grpo.py", d, n, [], w),
    "trl": lambda d, n, w: trl_child(d, n, w),
    # async_K<K>: the default thread layout (on a CPU the generator samples with one intra-op thread); _all: the
    # generator with every core (the default before); _split: the cores split evenly between the two threads
    **{f"async_K{K}{name}": async_arm(K, layout) for K in (0, 1, 2)
       for name, layout in (("", []), ("_all", ALL), ("_split", SPLIT))},
    "grpo_lora": lambda d, n, w: postrl_child("grpo.py", d, n, LORA_FLAGS, w),
    "trl_lora": lambda d, n, w: trl_child(d, n, w, lora=True),
    "grpo_gc": lambda d, n, w: postrl_child("grpo.py", d, n, ["--gradient-checkpointing"], w),
    "trl_gc": lambda d, n, w: trl_child(d, n, w, checkpointing=True),
}
def memory_arms(dtype: str) -> dict[str, tuple[str, list[str]]]:
    """label: (script, flags): the options one at a time, at --real-dtype, and the other precision."""
    other = "bfloat16" if dtype == "float32" else "float32"
    return {dtype: ("grpo.py", []), other: ("grpo.py", ["--dtype", other]),
            f"{dtype} + gradient checkpointing": ("grpo.py", ["--gradient-checkpointing"]),
            f"{dtype} + LoRA": ("grpo.py", LORA_FLAGS),
            f"{dtype} + LoRA + gradient checkpointing": ("grpo.py", [*LORA_FLAGS, "--gradient-checkpointing"]),
            f"async_grpo.py K = 1, {dtype}": ("async_grpo.py", ["--max-staleness", "1"]),
            f"async_grpo.py K = 1, {dtype} + LoRA": ("async_grpo.py", ["--max-staleness", "1", *LORA_FLAGS])}


def real_work(args: Args) -> Work:
    return Work(prompts=args.real_prompts, generations=args.real_generations, max_new=args.real_max_new_tokens, lr=1e-6,
                beta=0.04, model="smollm2-135m-instruct", dtype=args.real_dtype, device=args.real_device)


def summarise(steps: list[dict]) -> dict:
    seconds = sum(s["gen_s"] + s["train_s"] for s in steps)
    return {"samples_per_s": sum(s["samples"] for s in steps) / seconds, "tokens_per_s": sum(s["tokens"] for s in steps) / seconds,
            "gen_s": statistics.mean(s["gen_s"] for s in steps), "train_s": statistics.mean(s["train_s"] for s in steps),
            "rss_mb": steps[0]["rss_mb"], "wall_s": steps[0]["wall_s"], "gpu_mb": max((s.get("gpu_mb") or 0) for s in steps) or None}


def med(values: list[float], fmt: str = ".3g") -> str:
    """median [min, max]"""
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}, {max(values):{fmt}}]"


def compare(args: Args, work: Work = EMBEDDED_WORK, name: str = "compare") -> None:
    if args.baseline:
        ARMS["grpo_baseline"] = lambda d, n, w: postrl_child("grpo.py", d, n, [], w, root=Path(args.baseline))
    results = {arm: [] for arm in args.arms}
    for i in range(args.rounds):
        for arm in args.arms:
            with tempfile.TemporaryDirectory() as tmp:
                steps = ARMS[arm](Path(tmp) / "run", args.warmup + args.steps, work)[args.warmup:]
            results[arm].append(summarise(steps))
            print(f"round {i} {arm}: {results[arm][-1]['samples_per_s']:.3g} samples/s", flush=True)
    name = args.name or name
    command = f"python benchmarks/throughput.py{' --mode real' if work.model != 'embedded' else ''} --rounds {args.rounds} " \
              f"--warmup {args.warmup} --steps {args.steps}" + (f" --arms {' '.join(args.arms)} --name {name}" if args.name else "") + \
              (f" --baseline {args.baseline}" if args.baseline else "")
    lines = [f"`{command}`: {work.model}, {work.prompts} prompts x {work.generations} completions, <= {work.max_new} new "
             f"tokens, {work.dtype} on {work.device}; median [min, max] over {args.rounds} rounds.", "",
             "| arm | samples/s | generated tokens/s | generation s/step | training s/step | peak RSS (MB) | GPU max allocated (MB) "
             "| samples/s vs grpo (pair by pair) | wall s (whole run) | wall vs grpo (pair by pair) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for arm in args.arms:
        r = results[arm]
        ratio = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(r, results["grpo"])] if "grpo" in results else []
        wall = [a["wall_s"] / b["wall_s"] for a, b in zip(r, results["grpo"])] if "grpo" in results else []
        gpu = med([x["gpu_mb"] for x in r], ".0f") if r[0]["gpu_mb"] else "–"
        lines.append(f"| {arm} | {med([x['samples_per_s'] for x in r])} | {med([x['tokens_per_s'] for x in r])} | "
                     f"{med([x['gen_s'] for x in r])} | {med([x['train_s'] for x in r])} | {med([x['rss_mb'] for x in r], '.0f')} | "
                     f"{gpu} | {med(ratio, '.2f') if ratio else '–'} | {med([x['wall_s'] for x in r])} | "
                     f"{med(wall, '.2f') if wall else '–'} |")
    for ours, theirs in (("grpo", "trl"), ("grpo_lora", "trl_lora"), ("grpo_gc", "trl_gc")):
        if ours in results and theirs in results:
            ratio = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(results[ours], results[theirs])]
            memory = [a["rss_mb"] / b["rss_mb"] for a, b in zip(results[ours], results[theirs])]
            lines += ["", f"postrl {ours} / TRL {theirs}, pair by pair: samples/s {med(ratio, '.2f')}, peak RSS {med(memory, '.2f')}"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def memory(args: Args) -> None:
    """Each option's peak memory and samples/s on the real model, one child at a time, in rounds."""
    from common.models import load_model, resolve_model

    work = real_work(args)
    params = load_model(resolve_model(work.model, "gsm8k")).num_parameters()
    arms = {k: v for k, v in memory_arms(work.dtype).items() if args.memory_arms is None or k in args.memory_arms}
    if args.memory_arms and len(arms) != len(args.memory_arms):
        raise SystemExit(f"--memory-arms: unknown option(s); known: {list(memory_arms(work.dtype))}")
    results = {arm: [] for arm in arms}
    for i in range(args.rounds):
        for arm, (script, flags) in arms.items():
            emulated_bf16 = "bfloat16" in flags and work.device == "cpu"  # 25x slower without bf16 units: 1 step
            steps = 1 if emulated_bf16 else args.warmup + args.steps
            with tempfile.TemporaryDirectory() as tmp:
                rows = postrl_child(script, Path(tmp) / "run", steps, flags, work)[-1 if emulated_bf16 else args.warmup:]
            results[arm].append(summarise(rows))
            print(f"round {i} {arm}: {results[arm][-1]['rss_mb']:.0f} MB, {results[arm][-1]['samples_per_s']:.3g} samples/s",
                  flush=True)
    only = (" --memory-arms " + " ".join(f"'{a}'" for a in args.memory_arms) + f" --name {args.name}") if args.memory_arms else ""
    lines = [f"`python benchmarks/throughput.py --mode memory --rounds {args.rounds} --warmup {args.warmup} --steps {args.steps}{only}`: "
             f"{work.model} ({params / 1e6:.1f}M parameters), {work.prompts} prompts x {work.generations} completions, "
             f"<= {work.max_new} new tokens, beta {work.beta} (a reference model, or LoRA's adapters switched off), {work.device}; "
             f"median [min, max] over {args.rounds} rounds.", "",
             "| options | peak RSS (MB) | bytes per parameter | GPU max allocated (MB) | samples/s | training s/step |",
             "|---|---|---|---|---|---|"]
    for arm, r in results.items():
        rss = [x["rss_mb"] for x in r]
        gpu = med([x["gpu_mb"] for x in r], ".0f") if r[0]["gpu_mb"] else "–"
        note = " (bf16 emulated on this CPU: 1 step)" if "bfloat16" in arm and work.device == "cpu" else ""
        lines.append(f"| {arm}{note} | {med(rss, '.0f')} | {statistics.median(rss) * 2**20 / params:.1f} | {gpu} | "
                     f"{med([x['samples_per_s'] for x in r])} | {med([x['train_s'] for x in r])} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name or 'memory'}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def random_model(directory: Path) -> str:
    """The embedded architecture with random weights: completions run to the length budget."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.models import load_tokenizer, resolve_model

    path = resolve_model("embedded", "reverse")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(path).config)
    model.save_pretrained(directory)
    load_tokenizer(path).save_pretrained(directory)
    return str(directory)


def growth(args: Args) -> None:
    base = {"P": 16, "G": 8, "T": 16}
    values = {"P": [8, 16, 32, 64], "G": [4, 8, 16, 32], "T": [8, 16, 32, 64]}
    flag = {"P": "--prompts-per-step", "G": "--num-generations", "T": "--max-new-tokens"}
    rows, tmp = [], Path(tempfile.mkdtemp())
    model = random_model(tmp / "model")
    for var, xs in values.items():
        for x in xs:
            point = {**base, var: x}
            extra = ["--model", model, *[a for k, v in point.items() for a in (flag[k], str(v))]]
            with tempfile.TemporaryDirectory() as d:
                run_dir = Path(d) / "run"
                flags = ["--steps", str(args.warmup + args.steps), *NO_EVAL_NO_SAVE, "--device", "cpu", "--output-dir", d,
                         "--run-name", "run", *extra]
                run_child([sys.executable, "grpo.py", *flags])
                steps = [r for r in read_metrics(run_dir) if "time/train_s" in r][args.warmup:]
            rows.append({"var": var, "x": x, **point, "gen_s": statistics.median(r["time/rollout_s"] for r in steps),
                         "train_s": statistics.median(r["time/train_s"] for r in steps),
                         "length": statistics.mean(r["completions/mean_length"] for r in steps)})
            print(rows[-1], flush=True)
    lines = ["`python benchmarks/throughput.py --mode growth`: grpo.py, random-init embedded architecture, median step time over "
             f"{args.steps} steps after {args.warmup} warm-up steps; base point P={base['P']}, G={base['G']}, T={base['T']}.", "",
             "| varied | P | G | T | mean completion length | sampling s | training s | step s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['var']} | {r['P']} | {r['G']} | {r['T']} | {r['length']:.1f} | {r['gen_s']:.3f} | {r['train_s']:.3f} | "
                     f"{r['gen_s'] + r['train_s']:.3f} |")
    lines += ["", "| varied | exponent b of step time ~ x^b (T: x = mean completion length) | of sampling | of training |",
              "|---|---|---|---|"]
    fits = {}
    for var in values:
        pts = [r for r in rows if r["var"] == var]
        x = np.log([r["length"] if var == "T" else r["x"] for r in pts])  # T: the length reached, not the budget
        fit = {k: np.polyfit(x, np.log([f(r) for r in pts]), 1)[0] for k, f in
               (("step", lambda r: r["gen_s"] + r["train_s"]), ("gen", lambda r: r["gen_s"]), ("train", lambda r: r["train_s"]))}
        fits[var] = fit
        lines.append(f"| {var} | {fit['step']:.2f} | {fit['gen']:.2f} | {fit['train']:.2f} |")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "growth.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for var, color in zip(values, ["C0", "C1", "C2"]):
        pts = [r for r in rows if r["var"] == var]
        xs = [r["length"] / pts[1]["length"] if var == "T" else r["x"] / base[var] for r in pts]
        ax.plot(xs, [r["gen_s"] + r["train_s"] for r in pts], marker="o", color=color,
                label=f"{var} (b = {fits[var]['step']:.2f})")
    ax.set(xscale="log", yscale="log", xlabel="x / base value (T: mean completion length)", ylabel="seconds per step (sampling + training)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(RESULTS / "growth.png", dpi=110)


if __name__ == "__main__":
    args = tyro.cli(Args)
    if args.mode in ("real", "memory") and not (ROOT / "data" / "word_problems" / "train.jsonl").is_file():
        from common import word_problems

        word_problems.write(ROOT / "data" / "word_problems")
    if args.mode == "real":
        compare(args if args.arms != Args().arms else Args(**{**vars(args), "arms": ["grpo", "trl", "grpo_lora", "trl_lora"]}),
                real_work(args), "compare_real")
    else:
        {"compare": compare, "growth": growth, "memory": memory}[args.mode](args)
