# Qwen2.5-1.5B (Qwen/Qwen2.5-1.5B, Qwen/Qwen2.5-1.5B-Instruct): Megatron flags for the published architecture.
# Published size: 1.54B parameters (1.31B non-embedding; tied embeddings counted once).
# Same flags (in the same order) as tools/convert_hf_to_megatron.py writes to <save>/megatron_args.txt; a
# converted checkpoint's own megatron_args.txt is authoritative (e.g. --max-position-embeddings differs between
# some base and -Instruct releases, and the checkpoint validates it on --load).
#
# Recommended on 8xH100 (80 GB), RL with colocated generation:
# TP=1 PP=1, DP=8 with the distributed optimizer (~12 GB/GPU of weights, grads and sharded Adam state).
# Convert: python tools/convert_hf_to_megatron.py --hf-dir <hf dir> --save <ckpt> \
#              --target-tensor-parallel-size 1 --target-pipeline-parallel-size 1
# Use:     source examples/rl/model_configs/qwen2.5-1.5b.sh; torchrun ... train_rl.py "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" ...
MODEL_ARGS=(
    --num-layers 28
    --hidden-size 1536
    --ffn-hidden-size 8960
    --num-attention-heads 12
    --group-query-attention
    --num-query-groups 2
    --kv-channels 128
    --max-position-embeddings 131072
    --position-embedding-type rope
    --rotary-base 1000000
    --normalization RMSNorm
    --norm-epsilon 1e-06
    --swiglu
    --disable-bias-linear
    --add-qkv-bias
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --vocab-size 151936
    --make-vocab-size-divisible-by 128
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --use-distributed-optimizer
)

# Inference layout: generate with the trainer itself (TP=1 already).
# Use: train_rl.py ... "${INFERENCE_ARGS[@]}" (README: Inference layout).
INFERENCE_ARGS=(
)
