# Qwen3-8B (Qwen/Qwen3-8B, Qwen/Qwen3-8B-Base): Megatron flags for the published architecture.
# Published size: 8.2B parameters (6.95B non-embedding).
# Same flags (in the same order) as tools/convert_hf_to_megatron.py writes to <save>/megatron_args.txt; a
# converted checkpoint's own megatron_args.txt is authoritative (e.g. --max-position-embeddings differs between
# some base and -Instruct releases, and the checkpoint validates it on --load).
#
# Recommended on 8xH100 (80 GB), RL with colocated generation:
# TP=2 PP=1, DP=4 with the distributed optimizer (~37 GB/GPU of weights, grads and sharded Adam state).
# Convert: python tools/convert_hf_to_megatron.py --hf-dir <hf dir> --save <ckpt> \
#              --target-tensor-parallel-size 2 --target-pipeline-parallel-size 1
# Use:     source examples/rl/model_configs/qwen3-8b.sh; torchrun ... train_rl.py "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" ...
MODEL_ARGS=(
    --num-layers 36
    --hidden-size 4096
    --ffn-hidden-size 12288
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --max-position-embeddings 40960
    --position-embedding-type rope
    --rotary-base 1000000
    --normalization RMSNorm
    --norm-epsilon 1e-06
    --swiglu
    --disable-bias-linear
    --qk-layernorm
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --vocab-size 151936
    --make-vocab-size-divisible-by 128
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 1
    --sequence-parallel
    --use-distributed-optimizer
)

# Inference layout: a TP=1 copy, 8 replicas. It costs 16.4 GB of bf16 weights per GPU.
# Use: train_rl.py ... "${INFERENCE_ARGS[@]}" (README: Inference layout).
INFERENCE_ARGS=(
    --rl-inference-tensor-model-parallel-size 1
)
