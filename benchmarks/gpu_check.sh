#!/usr/bin/env bash
# GPU check: everything hetsplit has to show on a lent GPU, in one run of under 8 minutes, into one report.
#
#   benchmarks/gpu_check.sh [REPORT_DIR]        # default: $OUT if set, else ./gpu_check
#
# Steps, each with its own time limit (445 s in all): `pytest -m gpu`; `hetsplit bench` on
# cuda:0 + cpu (threads); the DDP and FSDP2 examples on cuda:0 + an emulated half-speed
# cuda:0@0.5 rank (two ranks on one GPU; DDP over gloo, since NCCL refuses two ranks on one
# GPU; FSDP2 as the example chooses, and where that is not possible the report shows the log's
# last lines, its error); benchmarks/bench_predict.py on the CUDA device sets (cuda:0,cpu and
# cuda:0,cuda:0@0.5), predicted against measured step time and peak memory per device
# (predicted must never be below measured, at most 10 % above). REPORT_DIR/gpu_check.md is
# the report; beside it each step's log and bench_predict's JSON (7 files).
# Exit status: 0 all passed, 1 a step failed or timed out, 2 no GPU here (one line). A memory
# prediction out of its bounds is a finding of the report, not a failed step.
# GPU_CHECK_DEVICE=cpu runs the same steps on the CPU (bench_predict --quick): a dry run of the script itself.
set -uo pipefail
DIR=$(realpath -m "${1:-${OUT:-gpu_check}}")  # a relative folder is the caller's, before the cd below
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DEV=${GPU_CHECK_DEVICE:-cuda:0}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1  # hetsplit from this checkout, installed or not

if [[ $DEV == cuda* ]] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False, or $PY has no torch); run it where one is lent" >&2
    exit 2
fi
mkdir -p "$DIR" || { echo "gpu_check: cannot create the report folder $DIR" >&2; exit 1; }
REPORT="$DIR/gpu_check.md"
SLOW="$DEV@0.5"                               # cuda:0@0.5: the same GPU, emulated at half its speed
OTHER=cpu
QUICK=()
if [[ $DEV == cpu ]]; then                    # the dry run: a second device that is not the first again, a short run
    OTHER=cpu@0.25
    QUICK=(--quick)
fi
failed=0

{
    echo "# hetsplit GPU check"
    echo
    "$PY" - "$DEV" <<'EOF'
import datetime, subprocess, sys, torch
dev = sys.argv[1]
gpu = torch.cuda.get_device_name(0) if dev.startswith("cuda") else "none (dry run on the CPU)"
def git(*args):
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()
    except OSError:  # no git there
        return ""
commit, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain")
print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; GPU: {gpu}; torch {torch.__version__}; "
      f"commit {commit or '?'}{' with local changes' if dirty else ''}; SYNTHETIC data throughout")
EOF
    echo
} >"$REPORT"

# step NAME LIMIT_S LOG COMMAND...: run it under its limit, log its output, add its status to the report.
step() {
    local name=$1 limit=$2 log=$3
    shift 3
    local began=$SECONDS status
    echo "gpu_check: $name (at most ${limit} s) ..." >&2
    timeout --kill-after=5 "$limit" "$@" >"$DIR/$log" 2>&1
    status=$?
    local took=$((SECONDS - began)) verdict="passed"
    if ((status == 124 || status == 137)); then
        verdict="TIMED OUT after ${limit} s"
    elif ((status != 0)); then
        verdict="FAILED (exit status $status)"
    fi
    ((status == 0)) || failed=1
    {
        echo "## $name: $verdict, ${took} s"
        echo
        echo "\`$*\` (log: $log)"
        echo
    } >>"$REPORT"
    echo "gpu_check: $name: $verdict, ${took} s" >&2
    return "$status"
}

# What of a step's log goes into the report: the lines that carry predictions, plans, step times and
# verdicts; after a failure, the log's last lines (its error).
excerpt() {
    local log=$1 lines=${2:-15} status=$3
    echo '```'
    if ((status == 0)); then
        grep -E -i "predict|plan|passed|failed|skipped|error|step time|ms/step|balanced|split of|ranks on" \
            "$DIR/$log" | tail -n "$lines"
    else
        grep -v -E "^W[0-9]{4} |^\*+$" "$DIR/$log" | tail -n 10
    fi
    echo '```'
    echo
}

step "pytest -m gpu" 90 pytest.log "$PY" -m pytest -q -m gpu -n 0 -p no:cacheprovider tests
excerpt pytest.log 8 $? >>"$REPORT"

step "engine on $DEV + $OTHER (hetsplit bench, threads)" 50 bench.log \
    "$PY" -m hetsplit.apps.cli bench --devices "$DEV,$OTHER" --model lenet --batch-size 256 --steps 10 --budget 8 --quiet
excerpt bench.log 20 $? >>"$REPORT"

step "DDP example on $DEV + $SLOW (gloo)" 60 ddp.log \
    "$PY" -m hetsplit.apps.cli launch --devices "$DEV,$SLOW" examples/torchrun_ddp.py --backend gloo --data synthetic \
    --steps 30 --train-size 8192 --test-size 256 --budget 5 --timeout 60
excerpt ddp.log 15 $? >>"$REPORT"

# Two ranks on one GPU: hetsplit chooses gloo (NCCL refuses them); FSDP2 ran so on an H200 with torch 2.11.
# Where it does not, the log's last lines say why.
step "FSDP2 example on $DEV + $SLOW" 55 fsdp.log \
    "$PY" -m hetsplit.apps.cli launch --devices "$DEV,$SLOW" examples/fsdp_hetero.py --steps 10 --layers 4 \
    --hidden 256 --budget 5 --timeout 60
excerpt fsdp.log 15 $? >>"$REPORT"

step "bench_predict on $DEV,$OTHER and $DEV,$SLOW" 190 predict.log \
    "$PY" benchmarks/bench_predict.py --devices "$DEV,$OTHER" --devices "$DEV,$SLOW" --budget 2 --calibrate-seconds 1 \
    --launch-timeout 90 --markdown --json "$DIR/predict.json" "${QUICK[@]}"
{
    echo "Predicted against measured; memory: the profile's predicted peak against torch.cuda.max_memory_allocated"
    echo "(ok: never below, at most 10 % above)."
    echo
    sed -n '/^| engine | model/,$p' "$DIR/predict.log"
    echo
    "$PY" - "$DIR/predict.json" <<'EOF' || echo "(no results: see predict.log)"
import collections, json, sys
rows = json.load(open(sys.argv[1]))["rows"]
verdicts = collections.Counter(m["verdict"] for r in rows for m in r.get("memory") or [])
print("memory verdicts: " + (", ".join(f"{k} {v}" for k, v in sorted(verdicts.items())) or "none measured"))
EOF
} >>"$REPORT"

echo "gpu_check: report in $REPORT" >&2
exit "$failed"
