#!/usr/bin/env bash
# The GPU checks and benchmarks in one run of at most ~8 minutes, from the repository root:
#
#     OUT=/some/dir bash bench/run_gpu.sh
#
# Needs the wheels of zarr and its dependencies in .whl/ (zarr, numcodecs, donfig,
# google-crc32c: the packages a bare GPU machine with torch, triton and timm lacks); they
# are installed into /tmp/site, which goes first on PYTHONPATH, with the repository root.
#
# Parts, in order of priority, each under `timeout -s INT` (a benchmark run cut off still
# writes the benchmarks it finished, see bench/conftest.py), each run whatever the earlier
# ones gave; every part's limit is also cut to what is left of GPU_BUDGET_S (default
# 465 s; the first SIGINT comes 30 s before the budget ends, SIGKILL at its end), so
# that the whole script ends a few seconds after GPU_BUDGET_S (GPU_PARTS, e.g.
# "training bulk", runs a subset):
#
#   tests      the CUDA tests, as 7 pytest processes side by side (≤ 150 s): the Triton
#              kernel tests (native on CUDA), the fused and the compiled backend (Inductor,
#              CUDA graphs) against the reference on CUDA, the visualization on CUDA;
#              log $OUT/gpu_tests.log
#   compiled   bench/gpu_compiled.py: forward, eager and compiled input × gradient,
#              reference, fused and compiled OMENN on ViT-B/16 and ResNet-50, batch 64
#              bf16: time, peak memory, compile seconds, profiler counts, correctness
#                                                           -> $OUT/compiled_gpu.json   (≤ 330 s)
#   attention  bench/gpu_attention.py: the Triton attention (forward, dV-only backward) against
#              SDPA's forward and full backward, and PyTorch's forwards that return the
#              log-sum-exp, as CUDA graphs                  -> $OUT/attention_gpu.json  (≤ 90 s)
#   training   bench/test_training.py                       -> $OUT/training_gpu.json   (≤ 150 s)
#   bulk       bench/test_targets.py bench/test_pipeline.py -> $OUT/bulk_gpu.json       (≤ 150 s)
#   kernels    bench/test_kernels.py                        -> $OUT/kernels_gpu.json    (≤ 60 s)
#   end2end    bench/test_end_to_end.py, without the torch.compile variant, then that
#              variant alone if ≥ 60 s are left             -> $OUT/end_to_end_gpu.json (what is left)
#
# The benchmarks' pytest output goes to $OUT/bench.log; $OUT/summary.md holds the
# machine, every part's exit code and time, and bench/report.py of each JSON, and is
# printed at the end (exit code 124: the part ran into its limit).

set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/omenn_gpu_out}
mkdir -p "$OUT"
BUDGET=${GPU_BUDGET_S:-465}
GRACE=30  # seconds between SIGINT and SIGKILL
WORK=$(mktemp -d /tmp/omenn_gpu.XXXXXX)
SUMMARY=$OUT/summary.md
BENCH_LOG=$OUT/bench.log
: > "$SUMMARY"
: > "$BENCH_LOG"
declare -a RESULTS=()
PARTS=" ${GPU_PARTS:-tests compiled attention training bulk kernels end2end} "  # a subset reruns only those

want() { [[ $PARTS == *" $1 "* ]] || { RESULTS+=("| $1 | not asked for | 0 s |"); false; }; }

# Seconds a part may run: its cap, cut to what is left of the budget less the grace.
limit() {
    local left=$((BUDGET - SECONDS - GRACE))
    if ((left < $1)); then echo "$left"; else echo "$1"; fi
}

# pytest with KeyboardInterrupt on SIGINT even where the launcher left SIGINT ignored
# (a background job of a non-interactive shell), so `timeout -s INT` ends it cleanly.
PYTEST=(python3 -c 'import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); import pytest; sys.exit(pytest.main(sys.argv[1:]))')

# bench NAME CAP ARGS...: one pytest benchmark run, output to $BENCH_LOG (and its tail here).
bench() {
    local name=$1 cap=$2 seconds rc start=$SECONDS
    shift 2
    seconds=$(limit "$cap")
    if ((seconds < 20)); then
        RESULTS+=("| $name | skipped (no time left) | 0 s |")
        return
    fi
    echo "=== $name: limit ${seconds} s: pytest $*" | tee -a "$BENCH_LOG"
    timeout -s INT -k "$GRACE" "$seconds" "${PYTEST[@]}" -q -p no:cacheprovider "$@" 2>&1 \
        | tee -a "$BENCH_LOG" | tail -n 2
    rc=${PIPESTATUS[0]}
    RESULTS+=("| $name | $rc | $((SECONDS - start)) s |")
}

# script NAME CAP LEAST ARGS...: one Python script under its limit, skipped with under LEAST s left.
script() {
    local name=$1 cap=$2 least=$3 seconds start=$SECONDS
    shift 3
    seconds=$(limit "$cap")
    if ((seconds < least)); then
        RESULTS+=("| $name | skipped (no time left) | 0 s |")
        return
    fi
    echo "=== $name: limit ${seconds} s: python $*" | tee -a "$BENCH_LOG"
    timeout -s INT -k "$GRACE" "$seconds" python3 "$@" 2>&1 | tee -a "$BENCH_LOG" | grep -v "^\[" | tail -n 20
    RESULTS+=("| $name | ${PIPESTATUS[0]} | $((SECONDS - start)) s |")
}

# --- (a) packages and environment -----------------------------------------------------
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl 2>&1 | grep -v "Running pip as the 'root' user" | tail -n 5
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

# --- (b) the machine ---------------------------------------------------------------------
{
    echo '```'
    nvidia-smi
    echo "cores: $(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"
    python3 - <<'EOF'
import sys
import numpy, torch, triton, timm
print("python", sys.version.split()[0], "| torch", torch.__version__, "| triton", triton.__version__,
      "| timm", timm.__version__, "| numpy", numpy.__version__)
print("cuda", torch.cuda.is_available(), torch.version.cuda,
      torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
try:
    import zarr, numcodecs
    print("zarr", zarr.__version__, "| numcodecs", numcodecs.__version__)
except Exception as error:  # the pipeline benchmark will fail; the rest still runs
    print("zarr NOT importable:", repr(error))
EOF
    echo '```'
} 2>&1 | tee -a "$SUMMARY"

# --- (c) the CUDA tests: 6 processes side by side ------------------------------------------
TEST_GROUPS=(  # name|test paths|-k expression (may be empty)
    "activation-forward|tests/triton_kernels/test_triton_activation.py|not backward"
    "activation-backward|tests/triton_kernels/test_triton_activation.py|backward"
    "conv_bias|tests/triton_kernels/test_triton_conv_bias.py|not TestGPU"
    "conv_bias-gpu|tests/triton_kernels/test_triton_conv_bias.py|TestGPU"
    "attention|tests/triton_kernels/test_triton_attention.py|"
    "fused-visualize|tests/backends/test_fused_backend.py::test_fused_on_cuda_equals_reference tests/test_visualize.py::test_device_preserved_and_matches_cpu|"
    "compiled|tests/backends/test_compiled_backend.py|on_cuda"
)
start=$SECONDS
seconds=$(limit 150)
declare -a PIDS=()
if ! want tests; then
    TEST_GROUPS=()
elif ((seconds < 20)); then
    TEST_GROUPS=()
    RESULTS+=("| tests | skipped (no time left) | 0 s |")
fi
echo "=== tests: ${#TEST_GROUPS[@]} pytest processes side by side, limit ${seconds} s each"
for i in "${!TEST_GROUPS[@]}"; do
    IFS='|' read -r name paths keyword <<< "${TEST_GROUPS[$i]}"
    read -ra args <<< "$paths"
    [[ -n $keyword ]] && args+=(-k "$keyword")
    OMP_NUM_THREADS=2 timeout -s INT -k "$GRACE" "$seconds" "${PYTEST[@]}" -q -p no:cacheprovider \
        -rfE --tb=short --maxfail=20 "${args[@]}" > "$WORK/test$i.log" 2>&1 &
    PIDS[i]=$!
done
: > "$OUT/gpu_tests.log"
for i in "${!TEST_GROUPS[@]}"; do
    wait "${PIDS[$i]}"
    rc=$?
    name=${TEST_GROUPS[$i]%%|*}
    {
        echo "=== tests $name: rc $rc: ${TEST_GROUPS[$i]#*|}"
        cat "$WORK/test$i.log"
        echo
    } >> "$OUT/gpu_tests.log"
    echo "tests $name: rc $rc: $(tail -n 1 "$WORK/test$i.log")"
    RESULTS+=("| tests $name | $rc | (side by side) |")
done
((${#TEST_GROUPS[@]})) && RESULTS+=("| tests, all | | $((SECONDS - start)) s |")

# --- (d) the benchmarks, in order of priority ------------------------------------------------
want compiled && script compiled 330 60 bench/gpu_compiled.py --out "$OUT/compiled_gpu.json" \
    --budget-s $(($(limit 330) - 60))
want attention && script attention 90 20 bench/gpu_attention.py --out "$OUT/attention_gpu.json"
want training && bench training 150 bench/test_training.py --benchmark-json "$OUT/training_gpu.json"
want bulk && bench bulk 150 bench/test_targets.py bench/test_pipeline.py --benchmark-json "$OUT/bulk_gpu.json"
want kernels && bench kernels 60 bench/test_kernels.py --benchmark-json "$OUT/kernels_gpu.json"
if want end2end; then
    bench end2end 600 bench/test_end_to_end.py -k "not omenn_reference_compiled" \
        --benchmark-json "$WORK/end_to_end_eager.json"
    if (($(limit 600) >= 60)); then
        bench end2end-compiled 600 bench/test_end_to_end.py -k omenn_reference_compiled \
            --benchmark-json "$WORK/end_to_end_compiled.json"
    else
        RESULTS+=("| end2end-compiled | skipped (under 60 s left) | 0 s |")
    fi
fi
python3 - "$OUT/end_to_end_gpu.json" "$WORK/end_to_end_eager.json" "$WORK/end_to_end_compiled.json" <<'EOF'
import json, os, sys
parts = [json.load(open(p)) for p in sys.argv[2:] if os.path.exists(p)]
if parts:  # one JSON: the first run's machine, the benchmarks of both runs
    merged = parts[0]
    for extra in parts[1:]:
        merged["benchmarks"] += extra["benchmarks"]
    json.dump(merged, open(sys.argv[1], "w"), indent=1)
EOF

# --- summary -------------------------------------------------------------------------------
{
    echo
    echo "| part | exit code | time |"
    echo "|---|---|---|"
    printf '%s\n' "${RESULTS[@]}"
    echo
    echo "total: $SECONDS s"
    echo
    if [[ -f $OUT/compiled_gpu.json ]]; then
        python3 bench/gpu_compiled.py --report "$OUT/compiled_gpu.json" 2>&1
    fi
    if [[ -f $OUT/attention_gpu.json ]]; then
        python3 bench/gpu_attention.py --report "$OUT/attention_gpu.json" 2>&1
    fi
    echo
    for json in training_gpu bulk_gpu kernels_gpu end_to_end_gpu; do
        if [[ -f $OUT/$json.json ]]; then
            python3 bench/report.py "$OUT/$json.json" 2>&1
        else
            echo "($json.json: not written)"
        fi
        echo
    done
} >> "$SUMMARY"
echo "################ summary"
sed -n '/^| part |/,$p' "$SUMMARY"
rm -rf "$WORK"
