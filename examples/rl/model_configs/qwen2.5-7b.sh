# Qwen2.5-7B (Qwen/Qwen2.5-7B, Qwen/Qwen2.5-7B-Instruct): Megatron flags for the published architecture.
# Published size: 7.61B parameters (6.53B non-embedding).
# Same flags (in the same order) as tools/convert_hf_to_megatron.py writes to <save>/megatron_args.txt; a
# converted checkpoint's own megatron_args.txt is authoritative (e.g. --max-position-embeddings differs between
# some base and -Instruct releases, and the checkpoint validates it on --load).
#
# Recommended on 8xH100 (80 GB), RL with colocated generation:
# TP=2 PP=1, DP=4 with the distributed optimizer (~35 GB/GPU of weights, grads and sharded Adam state;
# TP must divide the 28 heads and 4 query groups: 1, 2 or 4).
# Convert: python tools/convert_hf_to_megatron.py --hf-dir <hf dir> --save <ckpt> \
#              --target-tensor-parallel-size 2 --target-pipeline-parallel-size 1
# Use:     source examples/rl/model_configs/qwen2.5-7b.sh; torchrun ... train_rl.py "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" ...
MODEL_ARGS=(
    --num-layers 28
    --hidden-size 3584
    --ffn-hidden-size 18944
    --num-attention-heads 28
    --group-query-attention
    --num-query-groups 4
    --kv-channels 128
    --max-position-embeddings 131072
    --position-embedding-type rope
    --rotary-base 1000000
    --normalization RMSNorm
    --norm-epsilon 1e-06
    --swiglu
    --disable-bias-linear
    --add-qkv-bias
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --vocab-size 152064
    --make-vocab-size-divisible-by 128
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 1
    --sequence-parallel
    --use-distributed-optimizer
)

# Inference layout: a TP=1 copy, 8 replicas (no TP all-reduce per decode step). It costs 15.2 GB of bf16
# weights per GPU on top of the ~35 GB above; the KV cache is freed outside rollouts.
# Use: train_rl.py ... "${INFERENCE_ARGS[@]}" (README: Inference layout).
INFERENCE_ARGS=(
    --rl-inference-tensor-model-parallel-size 1
)
