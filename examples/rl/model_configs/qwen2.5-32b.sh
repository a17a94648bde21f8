# Qwen2.5-32B (Qwen/Qwen2.5-32B, Qwen/Qwen2.5-32B-Instruct): Megatron flags for the published architecture.
# Published size: 32.5B parameters per the model card (31.0B non-embedding); the safetensors hold 32.76B.
# Same flags (in the same order) as tools/convert_hf_to_megatron.py writes to <save>/megatron_args.txt; a
# converted checkpoint's own megatron_args.txt is authoritative (e.g. --max-position-embeddings differs between
# some base and -Instruct releases, and the checkpoint validates it on --load).
#
# Recommended on 8xH100 (80 GB), RL with colocated generation:
# TP=8 PP=1 (DP=1) on one node: ~18 bytes/parameter of weights, fp32 grads and Adam state is ~590 GB
# of the 640 GB, so add --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 and keep
# rollouts short. Two nodes are comfortable: TP=8 PP=2, or TP=8 DP=2 with --use-distributed-optimizer.
# TP=8 pads the vocab to 152576 rows: convert with --target-tensor-parallel-size 8.
# Convert: python tools/convert_hf_to_megatron.py --hf-dir <hf dir> --save <ckpt> \
#              --target-tensor-parallel-size 8 --target-pipeline-parallel-size 1
# Use:     source examples/rl/model_configs/qwen2.5-32b.sh; torchrun ... train_rl.py "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" ...
MODEL_ARGS=(
    --num-layers 64
    --hidden-size 5120
    --ffn-hidden-size 27648
    --num-attention-heads 40
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --max-position-embeddings 131072
    --position-embedding-type rope
    --rotary-base 1000000
    --normalization RMSNorm
    --norm-epsilon 1e-05
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
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 1
    --sequence-parallel
    --use-distributed-optimizer
)

# Inference layout: trained at TP=8, generate with TP=2 copies (4 replicas per node): 32.5 GB of bf16
# weights per GPU, which fits only when the trainer's Adam state is sharded over >= 4 data-parallel
# replicas (4+ nodes). On one or two nodes use --rl-inference-tensor-model-parallel-size 4 (16.3 GB/GPU).
# Use: train_rl.py ... "${INFERENCE_ARGS[@]}" (README: Inference layout).
INFERENCE_ARGS=(
    --rl-inference-tensor-model-parallel-size 2
)
