# Shared helpers for the megatron-rl sbatch scripts (sourced, not run). Bash 4+.
#
# Environment the scripts read (all optional except where noted):
#   MEGATRON_RL_DIR   repository root (default: $SLURM_SUBMIT_DIR, i.e. submit from the repo root)
#   MODEL_CONFIG      a model config .sh defining MODEL_ARGS (+ PARALLEL_ARGS, GPU_ARGS); default: the converted
#                     checkpoint's $PRETRAINED_CKPT/megatron_args.sh, else examples/rl/model_configs/qwen2.5-0.5b.sh
#   PRETRAINED_CKPT   converted checkpoint (tools/convert_hf_to_megatron.py --save) to start from
#   TOKENIZER_MODEL   Hugging Face tokenizer dir (default: $PRETRAINED_CKPT/tokenizer when it exists)
#   ENV_CONFIG        --langrl-env-config YAML (default: examples/rl/environment_configs/arithmetic.yaml)
#   RUNS_ROOT         where run directories go (default: $MEGATRON_RL_DIR/runs)
#   RUN_NAME          run directory name (default: <job name>-<job id>; a requeued job keeps its id, so it
#                     finds its own checkpoints; set RUN_NAME to continue a run across submissions)
#   GPUS_PER_NODE     processes per node (default: $SLURM_GPUS_ON_NODE, else 8)
#   MASTER_PORT       rendezvous port (default: 20000 + job id mod 20000)
#   SAVE_INTERVAL     checkpoint every N iterations (default 20)
#   PYTHON_ENV        a venv/conda activate script to source before launching (optional)
# Extra arguments given to sbatch after the script name are appended to train_rl.py's flags.

rl_die() { echo "error: $*" >&2; exit 1; }

# Repository root, model config, and the run's directories.
rl_setup() {
    MEGATRON_RL_DIR="${MEGATRON_RL_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}"
    [[ -f "$MEGATRON_RL_DIR/train_rl.py" ]] || rl_die "MEGATRON_RL_DIR=$MEGATRON_RL_DIR has no train_rl.py; submit from the repository root or set MEGATRON_RL_DIR"
    if [[ -n "${PYTHON_ENV:-}" ]]; then
        # shellcheck disable=SC1090
        source "$PYTHON_ENV"
    fi
    if [[ -z "${MODEL_CONFIG:-}" ]]; then
        if [[ -n "${PRETRAINED_CKPT:-}" && -f "$PRETRAINED_CKPT/megatron_args.sh" ]]; then
            MODEL_CONFIG="$PRETRAINED_CKPT/megatron_args.sh"
        else
            MODEL_CONFIG="$MEGATRON_RL_DIR/examples/rl/model_configs/qwen2.5-0.5b.sh"
        fi
    fi
    [[ -f "$MODEL_CONFIG" ]] || rl_die "MODEL_CONFIG=$MODEL_CONFIG: no such file"
    MODEL_ARGS=(); PARALLEL_ARGS=(); GPU_ARGS=()
    # shellcheck disable=SC1090
    source "$MODEL_CONFIG"
    [[ ${#MODEL_ARGS[@]} -gt 0 ]] || rl_die "MODEL_CONFIG=$MODEL_CONFIG defines no MODEL_ARGS"

    ENV_CONFIG="${ENV_CONFIG:-$MEGATRON_RL_DIR/examples/rl/environment_configs/arithmetic.yaml}"
    GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
    GPUS_PER_NODE="${GPUS_PER_NODE%%(*}"   # SLURM_GPUS_ON_NODE may read like "8(x2)" on some setups
    RUNS_ROOT="${RUNS_ROOT:-$MEGATRON_RL_DIR/runs}"
    RUN_NAME="${RUN_NAME:-${SLURM_JOB_NAME:-megatron-rl}-${SLURM_JOB_ID:-local}}"
    RUN_DIR="$RUNS_ROOT/$RUN_NAME"
    CKPT_DIR="$RUN_DIR/checkpoints"
    LOG_DIR="$RUN_DIR/logs"
    TB_DIR="$RUN_DIR/tensorboard"
    mkdir -p "$CKPT_DIR" "$LOG_DIR" "$TB_DIR"
    # what this attempt ran with, for the record (a requeue appends a new attempt)
    {
        echo "# attempt ${SLURM_RESTART_COUNT:-0} of job ${SLURM_JOB_ID:-?} on ${SLURM_JOB_NODELIST:-?} at $(date -u +%FT%TZ)"
        echo "MODEL_CONFIG=$MODEL_CONFIG PRETRAINED_CKPT=${PRETRAINED_CKPT:-} ENV_CONFIG=$ENV_CONFIG"
    } >> "$RUN_DIR/launches.txt"
}

# First node of the allocation, the torchrun rendezvous host.
rl_master_addr() {
    local nodelist="${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}"
    [[ -n "$nodelist" ]] || { echo localhost; return; }
    # Read all of scontrol's output (no `| head -n 1`): under `set -o pipefail`, head closing the pipe early
    # kills scontrol with SIGPIPE and fails the job with status 141 on large allocations.
    local hosts
    hosts=$(scontrol show hostnames "$nodelist")
    echo "${hosts%%$'\n'*}"
}

rl_master_port() {
    echo "${MASTER_PORT:-$(( 20000 + ${SLURM_JOB_ID:-0} % 20000 ))}"
}

# train_rl.py flags: model config, run directories, tokenizer, environment config, then the user's extras.
# --load is the run's own checkpoint directory: a requeued attempt resumes from its latest checkpoint there.
# On a fresh run it is passed only when there is something to fall back to (--pretrained-checkpoint), since
# --load of an empty directory without one is an error.
rl_train_args() {
    TRAIN_ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}")
    if [[ "${RL_CUDA:-1}" == 1 ]]; then
        TRAIN_ARGS+=("${GPU_ARGS[@]}" --bf16)
    fi
    # --exit-signal-handler: on the SIGTERM the requeue path forwards, finish the iteration, save, exit 0.
    TRAIN_ARGS+=(--save "$CKPT_DIR" --save-interval "${SAVE_INTERVAL:-20}" --exit-signal-handler)
    if [[ -f "$CKPT_DIR/latest_checkpointed_iteration.txt" || -n "${PRETRAINED_CKPT:-}" ]]; then
        TRAIN_ARGS+=(--load "$CKPT_DIR")
    fi
    if [[ -n "${PRETRAINED_CKPT:-}" ]]; then
        TRAIN_ARGS+=(--pretrained-checkpoint "$PRETRAINED_CKPT")
    fi
    local tok="${TOKENIZER_MODEL:-}"
    if [[ -z "$tok" && -n "${PRETRAINED_CKPT:-}" && -d "$PRETRAINED_CKPT/tokenizer" ]]; then
        tok="$PRETRAINED_CKPT/tokenizer"
    fi
    if [[ -n "$tok" ]]; then
        TRAIN_ARGS+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$tok")
    fi
    TRAIN_ARGS+=(--tensorboard-dir "$TB_DIR" --log-interval 1 --langrl-env-config "$ENV_CONFIG" "$@")
}

# Run "$@" in the background and wait; on SIGUSR1 (#SBATCH --signal=B:USR1@<secs>, sent before the time
# limit) or SIGTERM (scancel / preemption), requeue the job and stop the run with SIGTERM. The requeued job
# gets the same job id, hence the same RUN_DIR, and resumes from the last checkpoint (--save-interval).
rl_run_requeueable() {
    RL_CHILD=""
    RL_REQUEUED=0
    _rl_on_signal() {
        local sig="$1"
        echo "[$(date -u +%T)] caught SIG$sig: requeueing job ${SLURM_JOB_ID:-?} and stopping the run" >&2
        if [[ $RL_REQUEUED == 0 && -n "${SLURM_JOB_ID:-}" ]]; then
            scontrol requeue "$SLURM_JOB_ID" || echo "scontrol requeue failed (is the job --requeue-able?)" >&2
            RL_REQUEUED=1
        fi
        [[ -n "$RL_CHILD" ]] && kill -TERM "$RL_CHILD" 2>/dev/null || true
    }
    trap '_rl_on_signal USR1' USR1
    trap '_rl_on_signal TERM' TERM
    "$@" &
    RL_CHILD=$!
    local rc=0
    # `wait` returns early (status > 128) when a trapped signal arrives: keep waiting for the child to exit
    while true; do
        wait "$RL_CHILD" && rc=0 || rc=$?
        kill -0 "$RL_CHILD" 2>/dev/null || break
    done
    trap - USR1 TERM
    return "$rc"
}
