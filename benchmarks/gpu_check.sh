#!/usr/bin/env bash
# The GPU check: what CI (CPU only) cannot run. On a machine with a CUDA GPU and its own torch:
#   1. the engine's tests on the GPU (COLLM_TEST_DEVICE=cuda: the tiny engines of tests/helpers.py run there)
#      and tests/test_cuda.py (GPU greedy tokens equal the CPU's; training beside serving; an nf4 base's
#      LoRA gradients);
#   2. bench_engine.py's kernels (section 1) and co-scheduling (section 3) on SmolLM2's shape with random
#      weights (benchmarks/shaped_model.py), float32 and bfloat16.
# Prepared on the CPU machine, sent with the lent-GPU tool (docs/gpu-check.md says how):
#   .whl/  wheels the GPU image lacks or holds at another version (see docs/gpu-check.md for the list)
#   .gpu/smollm2-shape/  SmolLM2's config.json and tokenizer files (tokenizer.json.xz), no weights
# Results go to $OUT (the tool's folder) or runs/gpu-check. DEVICE=cpu dry-runs the script on a CPU machine.
set -u
OUT=${OUT:-runs/gpu-check}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
t0=$(date +%s)
say() { echo "[gpu_check +$(( $(date +%s) - t0 ))s] $*"; }

if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/collm . \
    > "$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; exit 1; }
export PYTHONPATH=/tmp/collm${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
'transformers', transformers.__version__, 'peft', peft.__version__)" || exit 1

MODEL=/tmp/smollm2-random
if [ ! -f "$MODEL/config.json" ]; then
    mkdir -p /tmp/smollm2-shape && cp .gpu/smollm2-shape/* /tmp/smollm2-shape/
    [ -f /tmp/smollm2-shape/tokenizer.json.xz ] && xz -d -f /tmp/smollm2-shape/tokenizer.json.xz
    python3 benchmarks/shaped_model.py /tmp/smollm2-shape "$MODEL" || exit 1
fi

say "1. engine tests on the GPU"
# -P: the repo's own collm/ folder must not shadow the installed package (its rooms map elsewhere)
COLLM_TEST_DEVICE=$DEVICE timeout 150 python3 -P -m pytest -q -m "not slow" -p no:cacheprovider -rfEs \
    tests/test_cuda.py tests/test_engine.py tests/test_co_schedule.py tests/test_fused.py tests/test_lora_rank.py \
    tests/test_replica_core.py tests/test_step_cost.py tests/test_models.py 2>&1 | tee "$OUT/tests.log" | tail -40
say "tests done"

# float32: the kernels only; bfloat16 (what a GPU edge serves in): kernels and co-scheduling
for run in "float32 1 90" "bfloat16 1,3 260"; do   # with set-up, under the tool's 590 s
    set -- $run
    say "2. bench_engine on the GPU, $1, sections $2"
    timeout "$3" python3 benchmarks/bench_engine.py --device $DEVICE --dtype $1 --sections $2 --models smollm2 \
        --model-path "$MODEL" --rounds 3 --load-seconds 12 --wait-quiet 0 --max-running "${MAX_RUNNING:-32}" \
        --out "$OUT/bench_engine_$1.json" > "$OUT/bench_engine_$1.log" 2>&1
    echo "exit $?"; grep -v "^\[" "$OUT/bench_engine_$1.log" | grep -v "Failed to load CPU" | tail -45
done
say "done"
