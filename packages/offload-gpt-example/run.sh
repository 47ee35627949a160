#!/usr/bin/env bash
# Train GPT-2 under a GPU memory budget and log the run (the reference's run.sh).
#
#   bash run.sh                                              # gpt2_medium, batch 64, 16 GB, asyn
#   MODEL_TYPE=gpt2_xl MEMORY_BUDGET=8 SOLVER_TYPE=syn bash run.sh
#   MODEL_TYPE=gpt2_24b bash run.sh --plan_only                 # extra flags go to the script
#
# The output goes to the terminal and to
# ${LOG_DIR}/${MODEL_TYPE}_bs_${BATCH_SIZE}_st_${SOLVER_TYPE}.log (LOG_DIR defaults to
# ./offload_logs in the current folder); the plan JSON and PNG are written beside it.
# It runs the first `python` on PATH (else `python3`; PYTHON overrides). From a checkout
# nothing needs installing beyond torch, transformers, matplotlib and tqdm: the packages'
# src folders are put on PYTHONPATH.
set -euo pipefail

MODEL_TYPE=${MODEL_TYPE:-gpt2_medium}
BATCH_SIZE=${BATCH_SIZE:-64}
MEMORY_BUDGET=${MEMORY_BUDGET:-16}
SOLVER_TYPE=${SOLVER_TYPE:-asyn}
LOG_DIR=${LOG_DIR:-offload_logs}
PYTHON=${PYTHON:-$(command -v python || command -v python3 || echo python3)}

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "${here}/../.." && pwd)"
if [ -d "${root}/packages/offload-solver/src" ]; then
    for pkg in gpt-example optim runtime trace solver; do
        PYTHONPATH="${root}/packages/offload-${pkg}/src${PYTHONPATH:+:${PYTHONPATH}}"
    done
    export PYTHONPATH
fi

mkdir -p "${LOG_DIR}"
log="${LOG_DIR}/${MODEL_TYPE}_bs_${BATCH_SIZE}_st_${SOLVER_TYPE}.log"

# pipefail: the script's exit status is python's, not tee's.
"${PYTHON}" -m offload_gpt_example \
    --model_type="${MODEL_TYPE}" \
    --batch_size="${BATCH_SIZE}" \
    --memory_budget="${MEMORY_BUDGET}" \
    --solver_type="${SOLVER_TYPE}" \
    --log_dir="${LOG_DIR}" \
    "$@" 2>&1 | tee "${log}"
