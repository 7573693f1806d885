#!/usr/bin/env bash
# The whole CUDA check of docs/cuda.md in one command, on a machine with a CUDA GPU, in steps that each finish in
# a few minutes and are not run again once done, so that short windows on a GPU add up to the whole run:
#     bash tools/cuda_run.sh [OUTPUT_DIR]          (default runs/cuda; run it again to go on where it stopped)
# Steps, in order (OUTPUT_DIR/<step>.done marks each one finished; delete it to run that step again):
#   tests           the device tests with the GPU visible: the CUDA cases of tests/test_devices.py,
#                   tests/test_dtypes_compile.py, tests/test_fla_causal.py and the Triton tests (fla: pip install fla-core)
#   triton_causal   tools.triton_causal_bench: our causal Triton kernels against fla's, the PyTorch path and causal SDPA
#   triton          tools.triton_bench: the fused non-causal kernels (every map) against the PyTorch path, SDPA, flash
#   detr_dc5, detr_r50   tools.detr_step: a DETR training step at 800 x 1333, softmax against linear encoders, the
#                   recommended taylor + DWC + rope encoder among them, with the DC5 backbone and the plain R50
#   generation      tools.hf_generation_bench: a Llama-style model decoding 2k-32k contexts, state against KV cache
#   bench_bf16, bench_fp32   tools.benchmark's CUDA grid (itself resumable within the step)
# A step stops at STEP_LIMIT seconds (default 480) and is retried on the next run; no step starts once BUDGET seconds
# (default 540) have passed since the run began, so one call fits a 10-minute window. Logs and JSON land in
# OUTPUT_DIR; the last line says which steps are done and which are left. $PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/cuda}
py=${PYTHON:-python}
budget=${BUDGET:-540}
step_limit=${STEP_LIMIT:-480}
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this run needs one')" || exit 1
mkdir -p "$out"
start=$(date +%s)

step() {  # step NAME COMMAND...: run it unless done or out of time; mark it done when it succeeds
    local name=$1; shift
    if [ -e "$out/$name.done" ]; then echo "== $name: done before"; return; fi
    local used=$(( $(date +%s) - start ))
    if [ "$used" -ge "$budget" ]; then echo "== $name: not started (${used}s of the ${budget}s budget used)"; return; fi
    echo "== $name: $*"
    local t0=$(date +%s)
    if timeout "$step_limit" "$@" > "$out/$name.log" 2>&1; then
        touch "$out/$name.done"; echo "== $name: done in $(( $(date +%s) - t0 ))s"
    else
        echo "== $name: FAILED or stopped after $(( $(date +%s) - t0 ))s (see $out/$name.log); run again to retry"
    fi
    tail -n 5 "$out/$name.log"
}

step tests "$py" -m pytest -q -p no:cacheprovider -rfE tests/test_devices.py tests/test_dtypes_compile.py \
    tests/test_fla_causal.py tests/test_triton_kernels.py tests/test_triton_methods.py tests/test_triton_causal.py
step triton_causal "$py" -m linear_mha.tools.triton_causal_bench --json "$out/triton_causal_bench.json"
step triton "$py" -m linear_mha.tools.triton_bench --methods kernel_elu taylor focused hedgehog taylor_rope \
    --n 16384 --blocks 32 64 --json "$out/triton_bench.json"
step detr_dc5 "$py" -m linear_mha.tools.detr_step --device cuda --dc5 --batch 2 \
    --variants softmax kernel taylor-dwc3:rope=True --json "$out/detr_step_dc5.json"
step detr_r50 "$py" -m linear_mha.tools.detr_step --device cuda --batch 2 \
    --variants softmax kernel taylor-dwc3:rope=True --json "$out/detr_step_r50.json"
step generation "$py" -m linear_mha.tools.hf_generation_bench --device cuda --dtype bfloat16 --dim 1024 --depth 8 \
    --heads 16 --kv-heads 4 --contexts 2048 8192 32768 --json "$out/hf_generation.json" --png "$out/hf_generation.png"
for dtype in bfloat16 float32; do
    step "bench_${dtype}" "$py" -m linear_mha.tools.benchmark --device cuda --dtype "$dtype" --resume \
        --json "$out/bench_$dtype.json" --png "$out/bench_$dtype.png"
done
done=$(cd "$out" && ls *.done 2>/dev/null | sed 's/\.done$//' | tr '\n' ' ')
echo "results in $out; done: ${done:-nothing yet}; $(( $(date +%s) - start ))s this run"
