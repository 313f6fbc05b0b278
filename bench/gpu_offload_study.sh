#!/usr/bin/env bash
# Issue #43's GPU study: polyglot-ko-5.8b full fine-tuning on one GPU whose memory cannot hold its AdamW state, found
# with DeepSpeed's ZeRO-Offload by `autotune run`, its measured GPU and host peaks beside the memory model's prediction.
#   bash bench/gpu_offload_study.sh DIR [BUDGET]        (default 8m; needs make wheelhouse-deepspeed, carried with the call)
#   CEILING=75GiB bash bench/gpu_offload_study.sh DIR   (a larger card held to an 80 GB card's ceiling: the probes' allocator cap)
#   SPACE=FILE.yaml RUN_ARGS="--warmup-steps 2"          (another space than the one below; more arguments of autotune run)
# Writes into DIR: the prediction (estimate.json, autotune estimate --host-memory), the space, the study
# (autotune.db), its report, best.json, the run's log, nvidia-smi, the host's memory and the versions.
set -u
dir=${1:?usage: bench/gpu_offload_study.sh DIR [BUDGET]}
budget=${2:-8m}
model=${MODEL:-polyglot-ko-5.8b}
ceiling=${CEILING:-}   # empty: 95 % of the card
mkdir -p "$dir"
python -c "import bench.gpu_acceptance as g; g.ensure_dependencies()" || exit 2
if [ -d wheelhouse/site ]; then export PYTHONPATH="$PWD/wheelhouse/site${PYTHONPATH:+:$PYTHONPATH}"; fi
if ! python -c "import deepspeed" 2>/dev/null; then
    python -m pip install --quiet --no-index --find-links wheelhouse deepspeed \
        || python -m pip install --quiet --no-index --find-links wheelhouse --target wheelhouse/site deepspeed || exit 2
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$dir/nvidia-smi.csv" 2>&1
free -b > "$dir/host_memory.txt" 2>&1
python - > "$dir/versions.txt" 2>&1 <<'PY'
import importlib
for name in ("torch", "transformers", "accelerate", "deepspeed", "optuna"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as error:  # noqa: BLE001 - a version listing
        print(name, "missing:", error)
PY
host=$(python -c "import psutil; print(int(0.95 * psutil.virtual_memory().total / 2**20))")MiB
device_memory=${ceiling:-$(python -c "import torch; print(int(0.95 * torch.cuda.get_device_properties(0).total_memory / 2**20))")MiB}
echo "model $model ceiling ${ceiling:-95% of the card} (estimate --device-memory $device_memory) host $host" | tee -a "$dir/calls.txt"
python -m autotune estimate --model "$model" --seq-len 512 --device-memory "$device_memory" \
    --host-memory "$host" --json > "$dir/estimate.json" 2> "$dir/estimate.err"
if [ -n "${SPACE:-}" ]; then cp "$SPACE" "$dir/offload_space.yaml"; else cat > "$dir/offload_space.yaml" <<'YAML'
# Full fine-tuning that fits only with offload: bf16 AdamW, the offload values against none (which does not fit).
per_device_train_batch_size: [1, 2, 4, 8, 16, 32]
gradient_accumulation_steps: [1, 4]
precision: [bf16]
optim: [adamw_torch_fused]
torch_compile: ["off"]
attn_implementation: [sdpa]
dataloader_num_workers: [2]
gradient_checkpointing: [false, true]
sharding: [none, zero2_offload, zero3_offload]
YAML
fi
start=$(date +%s)
python -m autotune run --model "$model" --seq-len 512 --space "$dir/offload_space.yaml" --budget "$budget" ${ceiling:+--memory-ceiling "$ceiling"} ${RUN_ARGS:-} \
    --storage "sqlite:///$dir/autotune.db" --report-dir "$dir" --output "$dir/best.json" > "$dir/run.log" 2>&1
rc=$?
echo "offload run exit $rc wall $(( $(date +%s) - start ))s" | tee -a "$dir/calls.txt"
exit $rc
