#!/usr/bin/env bash
# Issue #13's GPU studies: one LoRA and one QLoRA study of polyglot-ko-1.3b (seq 512, default space),
# each `autotune run` with its own SQLite study, HTML report, best.json and log, into DIR.
#   bash bench/gpu_peft_studies.sh DIR [BUDGET]        (BUDGET per study, default 4m)
# MODEL, SEQ_LEN and METHODS (default "lora qlora") change what is run.
# The wheels a CUDA image lacks come from wheelhouse/ (make wheelhouse); bitsandbytes (QLoRA) from
# BNB_SITE (an unpacked wheel put on PYTHONPATH; default wheelhouse/bnb_site, from make wheelhouse-qlora)
# when it exists, else what is installed.
set -u
dir=${1:?usage: bench/gpu_peft_studies.sh DIR [BUDGET]}
budget=${2:-4m}
mkdir -p "$dir"
python -c "import bench.gpu_acceptance as g; g.ensure_dependencies()" || exit 2
# ensure_dependencies installs into the environment when it can, else into wheelhouse/site
if [ -d wheelhouse/site ]; then export PYTHONPATH="$PWD/wheelhouse/site${PYTHONPATH:+:$PYTHONPATH}"; fi
BNB_SITE=${BNB_SITE:-$PWD/wheelhouse/bnb_site}
if [ -d "$BNB_SITE" ]; then export PYTHONPATH="$BNB_SITE${PYTHONPATH:+:$PYTHONPATH}"; fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$dir/nvidia-smi.csv" 2>&1
python - > "$dir/versions.txt" 2>&1 <<'PY'
import importlib
for name in ("torch", "transformers", "accelerate", "peft", "optuna", "bitsandbytes"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:  # noqa: BLE001 - a version listing
        print(name, "missing:", error)
PY
status=0
for method in ${METHODS:-lora qlora}; do
    start=$(date +%s)
    python -m autotune run --model "${MODEL:-polyglot-ko-1.3b}" --peft "$method" --seq-len "${SEQ_LEN:-512}" --budget "$budget" \
        --storage "sqlite:///$dir/autotune.db" --report-dir "$dir" --output "$dir/best_$method.json" \
        > "$dir/$method.log" 2>&1
    rc=$?
    echo "$method exit $rc wall $(( $(date +%s) - start ))s" | tee -a "$dir/calls.txt"
    [ $rc -eq 0 ] || status=1
done
exit $status
