import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import word_problems  # noqa: E402
from common.embedded import tiny_llama_config  # noqa: E402
from common.models import char_tokenizer  # noqa: E402

# A chat template over the character vocabulary, for the chat-model code path.
CHAT_TEMPLATE = "{% for m in messages %}q: {{ m['content'] }} {% endfor %}a: "

# Keys whose values depend on the wall clock, not on the computation.
TIMING_KEYS = ("time/", "throughput/")


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="session")
def problems(tmp_path_factory) -> tuple[str, str, str]:
    """The offline GSM8K-format word problems (common/word_problems.py): train, test and transfer files."""
    return tuple(map(str, word_problems.write(tmp_path_factory.mktemp("word_problems"), n_train=64, n_test=16)))


@pytest.fixture
def tiny_model(tokenizer):
    """A randomly initialised 2-layer Llama over the character vocabulary (fixed seed)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(tokenizer)).eval()


# A few seconds' run of any algorithm script on the embedded job (POSTRL_TEST_DEVICE=cuda runs them on a GPU).
DEVICE = os.environ.get("POSTRL_TEST_DEVICE", "cpu")
SMALL = dict(prompts_per_step=8, num_generations=4, eval_prompts=16, eval_samples=4, eval_k=2, eval_every=2, device=DEVICE)


def small_args(script, tmp_path, **overrides):
    """script.Args for a small run writing to <tmp_path>/run."""
    return script.Args(output_dir=str(tmp_path), run_name="run", **{**SMALL, **overrides})


def latest_weights(run_dir):
    """The policy of a run's latest checkpoint, loaded as any transformers user would."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(sorted((Path(run_dir) / "checkpoints").glob("step_*"))[-1])


def run_script(*argv: str, timeout: float = 300, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command from the repository root, capturing its output."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env_extra or {})}
    return subprocess.run(list(argv), cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)


def launch_two_processes(script: str, *flags: str) -> subprocess.CompletedProcess:
    """Two CPU processes (gloo) of a script, as `accelerate launch --num_processes 2` starts them on GPUs.
    (accelerate's launcher with --cpu starts a single process, so torch's own launcher is used here.)"""
    return run_script(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", script, *flags,
                      timeout=600, env_extra={"OMP_NUM_THREADS": "1"})


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING_KEYS)} for row in rows]


def assert_same_samples(model, a, b, keys, max_new_tokens: int, temperature: float = 1.0, tol: float = 1e-4) -> None:
    """Rollouts a and b of the same rows and noise keys, computed two ways (in one batch and one by one, in micro-batches,
    sharded): the same tokens up to rounding, and where the tokens agree the same log-probs to 1e-5.

    The two ways round the logits differently (other padding, other matrix shapes: ~1e-6), which flips a draw
    y = min{v : cdf(v) > u} only when its uniform u lies within rounding of a CDF boundary. So where a row's tokens
    first differ, the CDF is recomputed at that position and u must lie within tol of the boundary between the two
    tokens. Greedy decoding (temperature 0): their two logits must tie within tol instead."""
    from common.sampling import row_uniforms

    for i in range(len(a.texts)):
        na, nb = int(a.attention_mask[i].sum()), int(b.attention_mask[i].sum())
        ya, yb = a.completion_ids[i, :na], b.completion_ids[i, :nb]
        differ = (ya[: min(na, nb)] != yb[: min(na, nb)]).nonzero()
        if len(differ) == 0:
            assert na == nb, (i, a.texts[i], b.texts[i])
            m = a.completion_mask[i, :na].bool()
            assert temperature == 0 or torch.allclose(a.logprobs[i, :na][m], b.logprobs[i, :nb][m], atol=1e-5), i
            continue
        t = int(differ[0])
        context = torch.cat([a.prompt_ids[i][a.prompt_mask[i].bool()], ya[:t]])[None]
        with torch.no_grad():
            logits = model(input_ids=context).logits[0, -1].float()
        low, high = sorted((int(ya[t]), int(yb[t])))
        if temperature == 0:
            assert (logits[low] - logits[high]).abs() < tol, (i, t, logits[low].item(), logits[high].item())
            continue
        cdf = torch.softmax(logits / temperature, -1).cumsum(-1)
        if a.turn_ids is None:  # single-turn: token t drew u_t of its row's key
            u = row_uniforms([keys[i]], max_new_tokens, "cpu")[0, t]
        else:  # multi-turn: token j of model turn k drew u_j of the key (*key, k)
            k = int(a.turn_ids[i, t])
            u = row_uniforms([(*keys[i], k)], max_new_tokens, "cpu")[0, int((a.turn_ids[i, :t] == k).sum())]
        assert (u - cdf[low]).abs() < tol, (i, t, u.item(), cdf[low].item())


def assert_runs_match(a_dir, b_dir, rel: float = 1e-4, abs_: float = 1e-5, atol: float = 1e-4) -> None:
    """Two runs of the same work done two ways (one process and two, say): every logged metric to rel / abs_, and the
    final weights to atol (the ways sum in other orders)."""
    import pytest

    from common.logging import read_metrics

    a, b = without_timing(read_metrics(a_dir)), without_timing(read_metrics(b_dir))
    assert len(a) == len(b), f"{len(a)} metric rows against {len(b)}"
    for x, y in zip(a, b):
        assert x.keys() == y.keys(), f"step {x.get('step')}: keys differ by {sorted(x.keys() ^ y.keys())}"
        for key in x:
            assert x[key] == pytest.approx(y[key], rel=rel, abs=abs_), f"step {x.get('step')}: {key}"
    wa, wb = latest_weights(a_dir), latest_weights(b_dir)
    assert state_dicts_equal(wa, wb, atol=atol), f"weights: {largest_difference(wa, wb)} (atol {atol})"


def state_dicts_equal(a, b, atol: float = 0.0) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.allclose(sa[k], sb[k], rtol=0, atol=atol) for k in sa)


def largest_difference(a, b) -> str:
    """Where two models' weights differ most (for a failure's message)."""
    sa, sb = a.state_dict(), b.state_dict()
    if sa.keys() != sb.keys():
        return f"other tensors: {sorted(sa.keys() ^ sb.keys())}"
    worst = max(sa, key=lambda k: (sa[k].float() - sb[k].float()).abs().max().item())
    return f"{worst} differs by {(sa[worst].float() - sb[worst].float()).abs().max().item():.3g}"


def assert_ctrl_c_checkpoints_and_exits_130(script: str, run_dir: Path, steps: int = 2, sig=signal.SIGINT) -> None:
    """Start `script` on a long run, send it SIGINT (Ctrl-C) or `sig` once `steps` steps are logged: it must exit
    with 130, leave exactly one checkpoint, of the last logged step, loadable by transformers, and say
    how to resume."""
    from common.logging import read_metrics

    argv = [sys.executable, script, "--steps", "500", "--save-every", "1000", "--eval-every", "0", "--prompts-per-step", "8",
            "--output-dir", str(Path(run_dir).parent), "--run-name", Path(run_dir).name]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = Path(run_dir) / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < steps + 1):
        time.sleep(0.2)
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    last_step = read_metrics(run_dir)[-1]["step"]
    checkpoints = sorted((Path(run_dir) / "checkpoints").glob("step_*"))
    assert [c.name for c in checkpoints] == [f"step_{last_step:06d}"]
    assert latest_weights(run_dir).num_parameters() > 0
    assert "resume with --resume" in stderr


def count_onednn(monkeypatch) -> list:
    """Record every product common.models computes through oneDNN (the test would pass unseen if none ran)."""
    import common.models

    calls, real = [], common.models._onednn
    monkeypatch.setattr(common.models, "_onednn", lambda *a: (calls.append(a[0].shape), real(*a))[1])
    return calls
