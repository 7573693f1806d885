#!/usr/bin/env bash
# The whole CUDA run of docs/cuda.md in one command, on a machine with a CUDA GPU:
#     bash tools/cuda_run.sh [OUTPUT_DIR]          (default runs/cuda)
# 1. the test suite with the GPU visible: the CUDA cases of tests/test_devices.py, tests/test_dtypes_compile.py and
#    tests/test_fla_causal.py run instead of skipping (the fla cases need `pip install fla-core`);
# 2. tools.benchmark's CUDA grid in bfloat16 and float32 (resumable: run it again to finish an interrupted grid);
# 3. tools.triton_bench: the fused Triton kernels' exactness (every map) and times against the PyTorch path, SDPA and
#    SDPA's flash kernel;
# 4. tools.triton_causal_bench: our causal Triton kernels against fla's, the PyTorch path and causal SDPA (exactness,
#    float16 at N = 65,536, times at B 8 and 1);
# 5. tools.detr_step: a DETR-R50 DC5 training step at 800 x 1333, softmax against linear encoders, the recommended
#    taylor + DWC + rope encoder among them (its attention in the Triton kernels).
# Every result lands in OUTPUT_DIR: pytest.log, bench_*.json / .png / .log, triton_bench.json,
# triton_causal_bench.json, detr_step*.json.
# Failing tests do not stop the measurements; the last line says whether the tests passed. $PYTHON picks the
# interpreter (python).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/cuda}
py=${PYTHON:-python}
"$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this run needs one')"
mkdir -p "$out"
tests=passed
"$py" -m pytest -q -p no:cacheprovider -rfE tests 2>&1 | tee "$out/pytest.log" || tests="FAILED (see $out/pytest.log)"
for dtype in bfloat16 float32; do
    "$py" -m linear_mha.tools.benchmark --device cuda --dtype "$dtype" --resume --json "$out/bench_$dtype.json" \
        --png "$out/bench_$dtype.png" 2>&1 | tee "$out/bench_$dtype.log"
    LINEAR_MHA_FLA=1 "$py" -m linear_mha.tools.benchmark --device cuda --dtype "$dtype" --resume --methods kernel_elu \
        --masks causal --json "$out/bench_${dtype}_fla_on.json" 2>&1 | tee "$out/bench_${dtype}_fla_on.log"
done
"$py" -m linear_mha.tools.triton_bench --methods kernel_elu taylor focused hedgehog taylor_rope --json "$out/triton_bench.json" 2>&1 \
    | tee "$out/triton_bench.log"
"$py" -m linear_mha.tools.triton_causal_bench --json "$out/triton_causal_bench.json" 2>&1 | tee "$out/triton_causal_bench.log"
"$py" -m linear_mha.tools.detr_step --device cuda --dc5 --batch 2 --json "$out/detr_step.json"
"$py" -m linear_mha.tools.detr_step --device cuda --dc5 --batch 2 --variants softmax kernel taylor-dwc3:rope=True \
    --json "$out/detr_step_recommended.json"
echo "results in $out; tests $tests"
