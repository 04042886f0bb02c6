#!/usr/bin/env bash
# The GPU check of issue #48, in one run of at most 8 minutes on one NVIDIA GPU, from a source checkout with
# nothing installed: the machine's own torch (2.11.0+cu130 on the lent H100/H200s), Triton and transformers.
#
#   bash scripts/gpu-check.sh                 # from the repository root: tests, smoke, bench
#   bash scripts/gpu-check.sh bench           # one part (or two: `tests smoke`)
#   GPU_CHECK_BUDGET=540 bash scripts/gpu-check.sh bench    # seconds for the whole run (default 480)
#
# 1. tests: the cuda-marked tests (tests/test_cuda.py: Triton kernels on CUDA vs references, HF GPT-2/Llama through
#    the engine vs eager, the run-time fallback); the fake-tensor CUDA traces run in the CPU suite;
# 2. smoke (scripts/gpu_smoke.py): HF GPT-2, Llama (GQA), BERT and ViT built from config, through accelerate,
#    torch.compile(backend="graphtrain") and compile_step, fp32 with TF32 off and bf16, a few AdamW steps each
#    against eager, one process per case, five at a time; a case that fell back to eager fails;
#    tests and smoke run side by side (16 cores, one GPU with room for both; they check numbers, not speed);
# 3. bench: `graphtrain bench gpu` (GPT-2 124M, a 155M Llama, BERT-base; bf16, fused AdamW, TF32 allowed), alone on
#    the GPU, with what is left of the budget; variants $GPU_BENCH_VARIANTS (default eager-bf16 compile-bf16
#    graphtrain-bf16: max-autotune's autotuning takes minutes per case); cases finished when time runs out are kept.
# Everything is printed; with $OUT set (the device tool's result folder) the log's parts and the bench's JSON and
# Markdown are copied there. Exit status: 0 when every part that ran passed.
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SCRATCH="$(mktemp -d)"
export GRAPHTRAIN_CACHE="$SCRATCH/graphtrain-cache"   # cold compile caches: no result of an earlier run is reused
export TORCHINDUCTOR_CACHE_DIR="$SCRATCH/inductor-cache"
trap 'rm -rf "$SCRATCH"' EXIT
PY="${PYTHON:-python3}"
BUDGET="${GPU_CHECK_BUDGET:-480}"
PARTS="${*:-tests smoke bench}"
for p in $PARTS; do
    case "$p" in tests | smoke | bench) ;; *) echo "gpu-check.sh: unknown part '$p': choose tests, smoke, bench" >&2; exit 2 ;; esac
done
want() { [[ " $PARTS " == *" $1 "* ]]; }
T0=$SECONDS

"$PY" - <<'PYEOF' || exit 2
import sys, torch
if not torch.cuda.is_available():
    sys.exit("error: no CUDA device visible to torch: scripts/gpu-check.sh needs an NVIDIA GPU")
import graphtrain, triton, transformers
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) | triton {triton.__version__} | transformers "
      f"{transformers.__version__} | {torch.cuda.get_device_name()} | graphtrain at {graphtrain.__file__}")
PYEOF

TESTS=0 SMOKE=0 BENCH=0
if want tests; then
    echo "== tests: the cuda-marked tests (limit 300 s), log $SCRATCH/tests.log"
    if "$PY" -c "import pytest" 2>/dev/null; then
        timeout -k 10 300 "$PY" -m pytest -q -p no:cacheprovider -m cuda -rs tests/test_cuda.py >"$SCRATCH/tests.log" 2>&1 &
        TESTS_PID=$!
    else
        echo "pytest is not installed for $PY: the cuda-marked tests cannot run here" >"$SCRATCH/tests.log"
        TESTS=3
    fi
fi
if want smoke; then
    LEFT=$((BUDGET * 6 / 10 - (SECONDS - T0)))  # the bench, when it runs, keeps the last 40%
    want bench || LEFT=$((BUDGET - 20 - (SECONDS - T0)))
    [ "$LEFT" -lt 60 ] && LEFT=60
    echo "== smoke: budget $LEFT s, five cases at a time"
    timeout -k 10 $((LEFT + 15)) "$PY" scripts/gpu_smoke.py --budget "$LEFT" --case-timeout 150 --jobs 5 \
        >"$SCRATCH/smoke.log" 2>"$SCRATCH/smoke.err.log"
    SMOKE=$?
fi
if want tests && [ -n "${TESTS_PID:-}" ]; then
    wait "$TESTS_PID"
    TESTS=$?
fi
if want tests; then
    cat "$SCRATCH/tests.log"
    echo "== tests: exit $TESTS after $((SECONDS - T0)) s"
fi
if want smoke; then
    cat "$SCRATCH/smoke.log"
    [ "$SMOKE" -ne 0 ] && tail -c 6000 "$SCRATCH/smoke.err.log"
    echo "== smoke: exit $SMOKE after $((SECONDS - T0)) s"
fi

if want bench; then
    LEFT=$((BUDGET - (SECONDS - T0)))
    if [ "$LEFT" -lt 90 ]; then
        echo "== bench: NOT RUN: $LEFT s of the $BUDGET s budget left (GPU_CHECK_BUDGET raises it)"
        BENCH=4
    else
        echo "== bench: graphtrain bench gpu, budget $LEFT s"
        # SIGINT at the budget: the runner stops where it is; the cases it finished are in <suite>-<time>.partial.json
        timeout -s INT -k 20 "$LEFT" "$PY" -m graphtrain bench gpu --no-progress --out "$SCRATCH/bench" \
            --variants ${GPU_BENCH_VARIANTS:-eager-bf16 compile-bf16 graphtrain-bf16} 2>&1 | tail -n 60
        BENCH=${PIPESTATUS[0]}
        if [ "$BENCH" -ne 0 ]; then
            for f in "$SCRATCH"/bench/gpu-*.partial.json; do
                [ -e "$f" ] || continue
                echo "-- the cases finished before the budget ran out ($f):"
                "$PY" -c "import json, sys; from graphtrain.bench import report; \
print(report.terminal_table(json.load(open(sys.argv[1]))))" "$f"
            done
        fi
        echo "== bench: exit $BENCH after $((SECONDS - T0)) s"
    fi
fi

if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    cp "$SCRATCH"/*.log "$OUT"/ 2>/dev/null
    cp "$SCRATCH"/bench/gpu-*.json "$SCRATCH"/bench/gpu-*.md "$OUT"/ 2>/dev/null
fi
echo "== whole check: tests $TESTS, smoke $SMOKE, bench $BENCH (0: passed) in $((SECONDS - T0)) s"
[ "$TESTS" -eq 0 ] && [ "$SMOKE" -eq 0 ] && [ "$BENCH" -eq 0 ]
