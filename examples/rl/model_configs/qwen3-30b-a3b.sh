# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-30B-A3B-Base): Megatron flags for the published architecture.
# Published size: 30.5B parameters in total, 3.3B activated per token (29.9B non-embedding).
# Mixture of experts: every one of the 48 layers has 128 experts (SwiGLU, moe_intermediate_size 768), top-8
# routing, no shared expert. Qwen3's router (softmax over all experts, top-8, renormalised: norm_topk_prob) is
# megatron-core's default router (top-k on the logits, softmax over the chosen k), which gives the same weights.
# --ffn-hidden-size is the config's intermediate_size (unused: no dense MLP layers).
# Same flags (in the same order) as tools/convert_hf_to_megatron.py writes to <save>/megatron_args.txt.
# Convert: python tools/convert_hf_to_megatron.py --hf-dir <hf dir> --save <ckpt> --target-tensor-parallel-size 2
#
# Recommended on 8xH100 (80 GB): TP=2 with sequence parallelism, EP=8, expert TP=1, PP=1, distributed optimizer.
# Every GPU holds 16 experts of each layer plus half the attention/embeddings: ~4.4B parameters, ~70 GB of bf16
# weights, fp32 grads and Adam state (expert data-parallel size is 1, so expert state is not sharded). That is
# tight: add --recompute-granularity full --recompute-method uniform --recompute-num-layers 1; two nodes
# (EP=8 x DP=2, or PP=2) leave room for long rollouts. Grouped GEMM needs CUDA: GPU_ARGS.
# Use:     source examples/rl/model_configs/qwen3-30b-a3b.sh
#          torchrun ... train_rl.py "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${GPU_ARGS[@]}" ...
MODEL_ARGS=(
    --num-layers 48
    --hidden-size 2048
    --ffn-hidden-size 6144
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 4
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
    --num-experts 128
    --moe-router-topk 8
    --moe-ffn-hidden-size 768
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 0.001
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --sequence-parallel
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size 8
    --expert-tensor-parallel-size 1
    --moe-token-dispatcher-type alltoall
    --use-distributed-optimizer
)

# CUDA only (refused on CPU runs)
GPU_ARGS=(
    --moe-grouped-gemm
)

# Inference layout: TP=1 with EP=8 (the experts stay spread over the node, attention loses its TP
# all-reduces): ~5.1B parameters = 10.2 GB of bf16 weights per GPU. On one node that needs the
# recompute flags above and a smaller KV buffer; two nodes are comfortable.
# Use: train_rl.py ... "${INFERENCE_ARGS[@]}" (README: Inference layout).
INFERENCE_ARGS=(
    --rl-inference-tensor-model-parallel-size 1
    --rl-inference-expert-model-parallel-size 8
)
