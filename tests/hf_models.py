"""Tiny random Hugging Face MoE models, built from a config and saved with save_pretrained
(no hub): the whole-model oracle for every backend."""
from __future__ import annotations

import json
import math
import os

import numpy as np

# name -> (model_type, config overrides). Shapes vary on purpose: head_dim != hidden/heads,
# grouped KV heads, top-k 1/2/3, dense layers mixed in, shared experts, norm_topk_prob both ways.
CASES = {
    "mixtral": ("mixtral", dict(hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=24, num_local_experts=4, num_experts_per_tok=2,
                                vocab_size=97, max_position_embeddings=256, rope_theta=10000.0)),
    "mixtral_top1_tied": ("mixtral", dict(hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                                          num_attention_heads=6, num_key_value_heads=6, num_local_experts=3,
                                          num_experts_per_tok=1, vocab_size=80, tie_word_embeddings=True,
                                          max_position_embeddings=256)),
    "qwen2_moe": ("qwen2_moe", dict(hidden_size=64, intermediate_size=72, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=56, num_hidden_layers=4, num_attention_heads=4,
                                    num_key_value_heads=2, num_experts=6, num_experts_per_tok=3, decoder_sparse_step=2,
                                    mlp_only_layers=[3], norm_topk_prob=False, vocab_size=101,
                                    max_position_embeddings=256)),
    "qwen2_moe_norm": ("qwen2_moe", dict(hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=40, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, num_experts=5,
                                         num_experts_per_tok=2, norm_topk_prob=True, vocab_size=90,
                                         max_position_embeddings=256)),
    "qwen3_moe": ("qwen3_moe", dict(hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
                                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=20,
                                    num_experts=6, num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True,
                                    vocab_size=96, max_position_embeddings=256)),
    "olmoe": ("olmoe", dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
                            vocab_size=99, max_position_embeddings=256, eos_token_id=3, pad_token_id=1,
                            bos_token_id=None)),
    # Granite: every multiplier away from 1 (folded into the weights, attention_multiplier the softmax
    # scale), tied embeddings (untied by the fold), top-k 1 and 3, biases on, an ungated shared MLP
    "granitemoe": ("granitemoe", dict(hidden_size=48, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=5,
                                      num_experts_per_tok=3, vocab_size=91, max_position_embeddings=256,
                                      embedding_multiplier=3.0, residual_multiplier=0.6, attention_multiplier=0.3,
                                      logits_scaling=2.5, tie_word_embeddings=True)),
    "granitemoeshared": ("granitemoeshared", dict(hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                                  num_local_experts=4, num_experts_per_tok=1, vocab_size=88,
                                                  max_position_embeddings=256, attention_bias=True,
                                                  embedding_multiplier=2.0, residual_multiplier=0.4,
                                                  attention_multiplier=0.15, logits_scaling=0.5)),
    # ERNIE-4.5: the choice-only correction bias (random, non-zero: randomize), interleaved rope (q/k rows
    # permuted at conversion), top-k 4 and 1, two shared experts and none, dense first and last layers
    # (start / end index), every other layer MoE (interval 2), head_dim unlike hidden/heads, tied and
    # untied, a renormalisation floor that bites (k=1: w = p / max(p, 0.5))
    "ernie4_5_moe": ("ernie4_5_moe", dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                          moe_num_experts=6, moe_k=4, moe_num_shared_experts=2,
                                          moe_layer_start_index=1, moe_layer_end_index=2, vocab_size=93,
                                          max_position_embeddings=256, tie_word_embeddings=True)),
    "ernie4_5_moe_k1": ("ernie4_5_moe", dict(hidden_size=48, intermediate_size=40, moe_intermediate_size=24,
                                             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                                             head_dim=24, moe_num_experts=5, moe_k=1, moe_num_shared_experts=0,
                                             moe_layer_start_index=0, moe_layer_interval=2, moe_norm_min=0.5,
                                             vocab_size=86, max_position_embeddings=256,
                                             tie_word_embeddings=False, rope_theta=10000.0)),
}
# Families with features some backends refuse by name (test_families.py runs them): kept out of CASES,
# whose tests run on every backend. gpt-oss: sliding and full layers (windows shorter than the prompts
# and longer), YaRN, sinks, router and expert biases, the clamped SwiGLU with a limit that bites, top-k
# 2 and 4 (of 5), attention biases on and off, head_dim unlike hidden/heads.
FAMILY_CASES = {
    "gpt_oss": ("gpt_oss", dict(hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=24, num_local_experts=4, num_experts_per_tok=2,
                                vocab_size=97, max_position_embeddings=256, sliding_window=6, swiglu_limit=1.0,
                                rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=8.0,
                                                     beta_fast=32.0, beta_slow=1.0, truncate=False,
                                                     original_max_position_embeddings=32))),
    "gpt_oss_k4": ("gpt_oss", dict(hidden_size=48, intermediate_size=32, num_hidden_layers=2, num_attention_heads=6,
                                   num_key_value_heads=3, head_dim=8, num_local_experts=5, num_experts_per_tok=4,
                                   vocab_size=83, max_position_embeddings=256, sliding_window=40,
                                   layer_types=["full_attention", "sliding_attention"], attention_bias=False,
                                   swiglu_limit=3.0, rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    # widths that are multiples of 32: the MXFP4 checkpoint (mxfp4_checkpoint)
    "gpt_oss_mx": ("gpt_oss", dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=1, head_dim=16, num_local_experts=3, num_experts_per_tok=2,
                                   vocab_size=71, max_position_embeddings=256, sliding_window=5)),
    # Gemma 4 (26B-A4B's layer): sliding layers (head_dim 16, 2 KV heads, window 6 < the prompts) and full
    # layers (head_dim 32, 1 KV head, keys as values, proportional rope), a dense GeGLU MLP beside top-2
    # of 5 experts, soft-capped logits; the wrapped checkpoint (gemma4: a vision tower, the text model under
    # model.language_model) with top-4, a window of 40 (longer than the prompts), k and v projections
    "gemma4": ("gemma4_text", dict(vocab_size=97, hidden_size=64, intermediate_size=48, moe_intermediate_size=32,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
                                   hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=5,
                                   top_k_experts=2, sliding_window=6, final_logit_softcapping=4.0,
                                   max_position_embeddings=256,
                                   layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                "full_attention"])),
    "gemma4_vl": ("gemma4", dict(vocab_size=89, hidden_size=48, intermediate_size=40, moe_intermediate_size=24,
                                 num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=3, head_dim=8,
                                 global_head_dim=16, num_global_key_value_heads=2, attention_k_eq_v=False,
                                 hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=6,
                                 top_k_experts=4, sliding_window=40, final_logit_softcapping=30.0,
                                 max_position_embeddings=256,
                                 layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    # latent attention (issue 17). DeepSeek-V2: a plain q projection, softmax routing within the 2 best of 4
    # groups scored by their maximum, top-6 of 16, not renormalised, scaled; YaRN whose mscale differs from
    # mscale_all_dim (the rope key carries the attention factor, the softmax scale mscale_all_dim's square);
    # a dense first layer, two shared experts
    "deepseek_v2": ("deepseek_v2", dict(vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
                                        num_hidden_layers=3, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=24,
                                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=16,
                                        num_experts_per_tok=6, n_group=4, topk_group=2,
                                        topk_method="group_limited_greedy", n_shared_experts=2,
                                        routed_scaling_factor=1.5, first_k_dense_replace=1,
                                        max_position_embeddings=256,
                                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                             original_max_position_embeddings=64, beta_fast=32,
                                                             beta_slow=1, mscale=0.707, mscale_all_dim=1.0))),
    # DeepSeek-V3 (Moonlight): q through a low rank, sigmoid scores + a (random) correction bias for the
    # choice within the 2 best of 4 groups scored by their top two, top-1, renormalised, x2.5; a rope
    # key of 6 (not half the head), values of 20, one shared expert, interleaved rope
    "deepseek_v3": ("deepseek_v3", dict(vocab_size=89, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
                                        num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3,
                                        q_lora_rank=32, kv_lora_rank=20, qk_nope_head_dim=10, qk_rope_head_dim=6,
                                        v_head_dim=20, n_routed_experts=8, num_experts_per_tok=1, n_group=4,
                                        topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5,
                                        first_k_dense_replace=1, norm_topk_prob=True, rope_interleave=True,
                                        max_position_embeddings=256,
                                        rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    # GLM-4.7-Flash: sigmoid + bias in one group, top-6 of 8, renormalised, x1.8, the half-split rope
    # (rope_interleave off), dense layer first (mlp_layer_types), values wider than the keys
    "glm4_moe_lite": ("glm4_moe_lite", dict(vocab_size=101, hidden_size=64, intermediate_size=80,
                                            moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
                                            num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                                            qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=16,
                                            n_routed_experts=8, num_experts_per_tok=6, n_group=1, topk_group=1,
                                            n_shared_experts=1, routed_scaling_factor=1.8, norm_topk_prob=True,
                                            rope_interleave=False, mlp_layer_types=["dense", "sparse", "sparse"],
                                            max_position_embeddings=256,
                                            rope_parameters=dict(rope_type="default", rope_theta=1000000.0))),
}
# Qwen3.5-MoE (issue 18): gated delta-net layers (3 of 4 by default; here a pattern with two full layers),
# key heads repeating to value heads (2 -> 4), dk != dv, a conv of 4 taps; full layers with the output gate,
# per-head q/k norms, partial rotary (a quarter of head_dim 16); top-3 of 6, always renormalised, a gated
# shared expert; the wrapped checkpoint (qwen3_5_moe: a small vision tower, the text model under
# model.language_model, multi-token-prediction weights added) with 1 key head for 3 value heads, conv of 2
QWEN35_TEXT = dict(vocab_size=97, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=12, linear_value_head_dim=8,
                   linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=24,
                   shared_expert_intermediate_size=40, num_experts=6, num_experts_per_tok=3,
                   max_position_embeddings=256, tie_word_embeddings=False,
                   layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                   rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                        mrope_section=[1, 1, 0], mrope_interleaved=True))
FAMILY_CASES.update({
    "qwen3_5_moe": ("qwen3_5_moe_text", QWEN35_TEXT),
    # multi-token-prediction heads (speculative decoding): Qwen3.5's mtp.* kept (mtp_num_hidden_layers);
    # DeepSeek-V3's and a Mixtral's nextn layer after the decoder's (add_nextn_weights)
    "qwen3_5_moe_mtp": ("qwen3_5_moe_text", dict(QWEN35_TEXT, mtp_num_hidden_layers=1)),
    "deepseek_v3_mtp": (FAMILY_CASES["deepseek_v3"][0], dict(FAMILY_CASES["deepseek_v3"][1], num_nextn_predict_layers=1)),
    "glm4_moe_lite_mtp": ("glm4_moe_lite", dict(FAMILY_CASES["glm4_moe_lite"][1], num_nextn_predict_layers=1)),
    "mixtral_mtp": ("mixtral", dict(CASES["mixtral"][1], num_nextn_predict_layers=1)),
    "qwen3_5_moe_4k": ("qwen3_5_moe_text", dict(QWEN35_TEXT, max_position_embeddings=4096)),   # memory plans
    "qwen3_5_moe_vl": ("qwen3_5_moe", dict(QWEN35_TEXT, vocab_size=89, hidden_size=48, linear_num_key_heads=1,
                                           linear_num_value_heads=3, linear_key_head_dim=16, linear_value_head_dim=16,
                                           linear_conv_kernel_dim=2, num_experts=5, num_experts_per_tok=2,
                                           layer_types=["linear_attention", "linear_attention", "full_attention"],
                                           num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1)),
})
# Qwen3-Next (issue 49): Qwen3.5's layer with the fused in_proj_qkvz / in_proj_ba (2 key heads for 4 value
# heads, dk != dv), a dense layer among the sparse ones (mlp_only_layers), top-2 of 5 not renormalised
FAMILY_CASES["qwen3_next"] = ("qwen3_next", dict(
    vocab_size=101, hidden_size=48, intermediate_size=56, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=12, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=20, shared_expert_intermediate_size=32,
    num_experts=5, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[2], decoder_sparse_step=1,
    max_position_embeddings=256, tie_word_embeddings=False,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)))
# MiniMax-M2 (issue 49): q/k norms over the whole projection, partial rotary (half of head_dim 16), a
# sigmoid router with a choice bias, top-3 of 6, no shared expert
FAMILY_CASES["minimax_m2"] = ("minimax_m2", dict(
    vocab_size=97, hidden_size=64, intermediate_size=40, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=6, num_experts_per_tok=3, max_position_embeddings=256,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, rotary_dim=8,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0)))
# Hunyuan-MoE (issue 49): q/k norms after rope, NTK-alpha rope, top-2 of 4 renormalised, a shared MLP
FAMILY_CASES["hunyuan_v1_moe"] = ("hunyuan_v1_moe", dict(
    vocab_size=97, hidden_size=48, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=12, num_experts=4, moe_topk=2, max_position_embeddings=256,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    rope_parameters=dict(type="dynamic", alpha=50.0, factor=1.0, rope_theta=10000.0)))
# LFM2-MoE (issue 49): gated short convolutions (3 taps) beside attention with per-head q/k norms, a dense
# first layer, top-3 of 6 by sigmoid + expert bias, renormalised and scaled, tied embeddings
FAMILY_CASES["lfm2_moe"] = ("lfm2_moe", dict(
    vocab_size=97, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, num_dense_layers=1, num_experts=6, num_experts_per_tok=3,
    conv_L_cache=3, routed_scaling_factor=1.5, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
    pad_token_id=0, layer_types=["conv", "full_attention", "conv", "conv"],
    rope_parameters=dict(rope_type="default", rope_theta=10000.0)))
# Phi-3.5-MoE (issue 49): LayerNorms with biases, q/k/v/o and head biases, LongRoPE (random factors and
# mscale, an original context of 128 of 256), the sparsemixer router (top-2 of 6, a wide jitter band so
# that it matters)
FAMILY_CASES["phimoe"] = ("phimoe", dict(
    vocab_size=97, hidden_size=48, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, num_local_experts=6, num_experts_per_tok=2, max_position_embeddings=256,
    attention_bias=True, lm_head_bias=True, router_jitter_noise=0.3, bos_token_id=1, eos_token_id=2,
    sliding_window=None, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=128, short_mscale=1.1,
        long_mscale=1.3, short_factor=[1.0, 1.2, 1.5, 2.0, 3.0, 4.0], long_factor=[1.0, 2.0, 3.0, 5.0, 8.0, 12.0])))
# Llama 4 (issue 49): rope layers in chunks of 5 with L2 q/k norms, no-rope layers (1 and 3) with the query
# temperature (floor_scale 4: it grows within the test's positions), llama3 rope scaling over an original
# context of 64, MoE on layers 1 and 3 (sigmoid top-1 scaling the expert's input, a shared expert), dense
# layers between
FAMILY_CASES["llama4_text"] = ("llama4_text", dict(
    vocab_size=97, hidden_size=48, intermediate_size=24, intermediate_size_mlp=40, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_local_experts=4, num_experts_per_tok=1,
    interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=5, floor_scale=4, attn_scale=0.1,
    max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=64)))
# Granite 4.0-H (issue 49): Mamba-2 layers (3 heads of 16, a state of 8, 4 taps) around one attention layer
# without rope, top-2 of 4 experts beside a shared MLP, every Granite multiplier away from 1
FAMILY_CASES["granitemoehybrid"] = ("granitemoehybrid", dict(
    vocab_size=97, hidden_size=24, intermediate_size=20, shared_intermediate_size=28, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"], mamba_n_heads=3,
    mamba_d_head=16, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_n_groups=1, mamba_chunk_size=8,
    position_embedding_type=None, embedding_multiplier=3.0, residual_multiplier=0.6, logits_scaling=2.0,
    attention_multiplier=0.3, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, pad_token_id=0))
QWEN35_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=4,
                     temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16)
GEMMA4_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                     num_key_value_heads=2, head_dim=16)
MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "ernie4_5_moe")


def config_for(model_type: str, **overrides):
    import transformers
    cls = {"mixtral": transformers.MixtralConfig, "qwen2_moe": transformers.Qwen2MoeConfig,
           "qwen3_moe": transformers.Qwen3MoeConfig, "olmoe": transformers.OlmoeConfig,
           "granitemoe": transformers.GraniteMoeConfig,
           "granitemoeshared": transformers.GraniteMoeSharedConfig,
           "ernie4_5_moe": transformers.Ernie4_5_MoeConfig, "gpt_oss": transformers.GptOssConfig,
           "gemma4_text": transformers.Gemma4TextConfig, "deepseek_v2": transformers.DeepseekV2Config,
           "deepseek_v3": transformers.DeepseekV3Config, "glm4_moe_lite": transformers.Glm4MoeLiteConfig,
           "gemma4": lambda **kw: transformers.Gemma4Config(text_config=kw, vision_config=GEMMA4_VISION,
                                                            audio_config=None),
           "qwen3_5_moe_text": transformers.Qwen3_5MoeTextConfig, "qwen3_next": transformers.Qwen3NextConfig,
           "minimax_m2": transformers.MiniMaxM2Config, "hunyuan_v1_moe": transformers.HunYuanMoEV1Config,
           "lfm2_moe": transformers.Lfm2MoeConfig, "phimoe": transformers.PhimoeConfig,
           "llama4_text": transformers.Llama4TextConfig, "granitemoehybrid": transformers.GraniteMoeHybridConfig,
           "qwen3_5_moe": lambda **kw: transformers.Qwen3_5MoeConfig(text_config=kw, vision_config=QWEN35_VISION,
                                                                    tie_word_embeddings=False)}[model_type]
    return cls(**overrides)


def randomize(model, cfg):
    """Random weights scaled so logits are O(1), not ~0: std 1/sqrt(fan_in), norms 1 + 0.2 N(0,1),
    biases 0.3 N(0,1), an untied lm_head x3."""
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:            # norms (Gemma's numbered ones, its router scales) and biases
                norm = name.endswith("norm.weight") or "layernorm" in name or name.endswith(("router.scale",
                                                                                             "per_expert_scale"))
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if norm else 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):      # Gemma 4's per-layer output scale (a saved buffer)
                b.copy_(0.6 + 0.8 * torch.rand_like(b))
            if name.endswith(("e_score_correction_bias", "feed_forward.expert_bias")):   # DeepSeek-V3 / GLM /
                # LFM2: non-zero, reordering choices
                b.copy_(0.1 * torch.randn_like(b))
        if "lm_head" in dict(model.named_parameters()) and not cfg.tie_word_embeddings:
            model.lm_head.weight.mul_(3.0)


def build_hf(path: str, case: str, dtype: str = "float32", seed: int = 0, **overrides):
    """Save a random model of `case` to `path`; weights scaled so logits are O(1), not ~0."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    model_type, cfg_kw = {**CASES, **FAMILY_CASES}[case]
    cfg = config_for(model_type, **{**cfg_kw, **overrides})
    torch.manual_seed(seed)
    model = model_class(model_type)._from_config(cfg, attn_implementation="eager") if model_type == "qwen3_5_moe" \
        else AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    randomize(model, cfg)
    model = model.to(getattr(torch, dtype))
    eos = cfg_kw.get("eos_token_id", 2)
    model.generation_config = GenerationConfig(eos_token_id=eos, bos_token_id=cfg_kw.get("bos_token_id", 1))
    model.save_pretrained(path)
    if model_type in ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"):
        add_mtp_weights(path, getattr(cfg, "text_config", cfg))
    elif case.endswith("_mtp"):
        add_nextn_weights(path, cfg)
    return path


def add_nextn_weights(path: str, cfg):
    """DeepSeek-V3's multi-token-prediction layer as its checkpoints store it, after the decoder's layers
    (model.layers.L.: enorm, hnorm, eh_proj [H, 2H], shared_head.norm, and a decoder layer shaped as
    the last one): random tensors added to the saved file (transformers ignores them). Norm weights
    around 1, matrices scaled by 1/sqrt(fan-in)."""
    from safetensors.numpy import load_file, save_file
    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    H, L, rng = cfg.hidden_size, cfg.num_hidden_layers, np.random.default_rng(2)
    dt = t["model.embed_tokens.weight"].dtype
    last, new = f"model.layers.{L - 1}.", f"model.layers.{L}."
    extra = {new + "eh_proj.weight": (H, 2 * H), new + "enorm.weight": (H,), new + "hnorm.weight": (H,),
             new + "shared_head.norm.weight": (H,)}
    extra.update({new + n[len(last):]: t[n].shape for n in t if n.startswith(last)})
    for name, shape in extra.items():
        a = 1 + 0.2 * rng.standard_normal(shape) if "norm" in name else \
            0.1 * rng.standard_normal(shape) if "bias" in name else rng.standard_normal(shape) / np.sqrt(shape[-1])
        t[name] = a.astype(np.float32).astype(dt)
    save_file(t, f, metadata={"format": "pt"})


def model_class(model_type: str):
    """The class a checkpoint of model_type is built and run with: the wrapped vision-language
    Qwen3.5-MoE as itself (its text weights under model.language_model), the rest causal LMs."""
    import transformers
    if model_type == "qwen3_5_moe":
        return transformers.Qwen3_5MoeForConditionalGeneration
    return transformers.AutoModelForCausalLM


def checkpoint_class(path: str):
    archs = json.load(open(os.path.join(path, "config.json"))).get("architectures") or []
    return model_class("qwen3_5_moe" if "Qwen3_5MoeForConditionalGeneration" in archs else "")


def add_mtp_weights(path: str, tc):
    """Qwen3.5's multi-token-prediction head as its checkpoints store it (mtp.fc [H, 2H], mtp.norm, the
    two pre-fc norms and one decoder layer under mtp.layers.0, shaped as the model's last layer): random
    tensors added to the saved file (transformers ignores ^mtp.*; the converters must skip them)."""
    from safetensors.numpy import load_file, save_file
    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    H, rng = tc.hidden_size, np.random.default_rng(1)
    dt = t[next(n for n in t if n.endswith("embed_tokens.weight"))].dtype
    last = next(p for p in (f"model.language_model.layers.{tc.num_hidden_layers - 1}.",
                            f"model.layers.{tc.num_hidden_layers - 1}.") if any(n.startswith(p) for n in t))
    extra = {"mtp.fc.weight": (H, 2 * H), "mtp.norm.weight": (H,), "mtp.pre_fc_norm_embedding.weight": (H,),
             "mtp.pre_fc_norm_hidden.weight": (H,)}
    extra.update({"mtp.layers.0." + n[len(last):]: t[n].shape for n in t if n.startswith(last)})
    for name, shape in extra.items():
        t[name] = (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32).astype(dt)
    save_file(t, f, metadata={"format": "pt"})


def hf_logits(path: str, ids: np.ndarray, **config) -> np.ndarray:
    """transformers' float32 logits for int ids [batch, seq] (weights upcast from the saved dtype);
    config: attributes that override the checkpoint's config (num_experts_per_tok=1, ...)."""
    import torch
    model = checkpoint_class(path).from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **config)
    model.eval()
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


def hf_greedy(path: str, ids, n: int) -> list:
    import torch
    model = checkpoint_class(path).from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.as_tensor([list(ids)]), max_new_tokens=n, do_sample=False,
                             eos_token_id=None, pad_token_id=0, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def convert_case(tmp, case, dtype="float32", out_dtype=None, **overrides) -> str:
    from colibri_edge.model.convert import convert
    hf = os.path.join(tmp, f"hf_{case}_{dtype}")
    if not os.path.exists(os.path.join(hf, "config.json")):
        build_hf(hf, case, dtype, **overrides)
    out = os.path.join(tmp, f"col_{case}_{dtype}_{out_dtype}")
    if not os.path.exists(os.path.join(out, "config.json")):
        convert(hf, out, dtype=out_dtype, progress=False)
    return hf, out


def dequantised_checkpoint(hf_dir: str, model_dir: str, out_dir: str) -> str:
    """The oracle for a model directory written in a lossy format: hf_dir's checkpoint with every
    tensor replaced by what the directory stores, decoded (widen: the block formats by the NumPy
    reference of quant.py, itself checked against gguf-py), saved for transformers to run. Every
    tensor of the checkpoint must be replaced (a name map that misses one fails here)."""
    import shutil
    from safetensors.numpy import load_file, save_file
    from colibri_edge.model import families
    from colibri_edge.model.dtypes import widen
    from colibri_edge.model.modeldir import ModelDir, split_expert_blob_scaled
    m = ModelDir(model_dir)
    cfg = m.config
    state = {}
    for name in sorted(os.listdir(hf_dir)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(hf_dir, name)))
    out = {}
    names = families.for_model_type(cfg["model_type"]).source_names(cfg)
    for ours in m.tensors:
        if ours.endswith(".scales"):
            continue
        sc = m.raw_tensor(ours + ".scales") if ours + ".scales" in m.tensors else None
        out[names[ours]] = np.asarray(widen(m.raw_tensor(ours), m.tensor_dtype(ours), sc), np.float32)
    if cfg["tie_word_embeddings"] and "lm_head.weight" in state:
        out["lm_head.weight"] = out[names["embed_tokens"]]
    H, I = cfg["hidden_size"], cfg["moe_intermediate_size"]
    for r in m.experts:
        mats = split_expert_blob_scaled(m.expert_blob(r.layer, r.local_id), H, I, r.formats)
        p = f"model.layers.{r.layer}."
        if cfg["model_type"] == "mixtral":
            hf = [p + f"block_sparse_moe.experts.{r.local_id}.{w}.weight" for w in ("w1", "w3", "w2")]
        else:
            hf = [p + f"mlp.experts.{r.local_id}.{w}_proj.weight" for w in ("gate", "up", "down")]
        for n, (raw, sc), fmt in zip(hf, mats, r.formats):
            out[n] = np.asarray(widen(raw, fmt, sc), np.float32).copy()
    missing = sorted(set(state) - set(out))
    extra = sorted(set(out) - set(state))
    assert not missing and not extra, (missing[:5], extra[:5])
    for n, v in out.items():
        assert v.shape == state[n].shape, (n, v.shape, state[n].shape)
    os.makedirs(out_dir, exist_ok=True)
    save_file({n: np.ascontiguousarray(v.reshape(state[n].shape)) for n, v in out.items()},
              os.path.join(out_dir, "model.safetensors"))
    for name in os.listdir(hf_dir):
        if name.endswith(".json") and name != "model.safetensors.index.json":
            shutil.copy(os.path.join(hf_dir, name), os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "config.json")) as f:
        c = json.load(f)
    c["dtype"] = "float32"
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(c, f)
    return out_dir


def build_text_model(tmp, case="mixtral", **overrides) -> tuple:
    """A model of CASES[case]'s shape with the demo's byte-level tokenizer (multi-byte characters
    span several tokens) and a chat template: (hf_dir, model_dir, eos id); overrides: config fields."""
    from colibri_edge.model.demo import byte_level_tokenizer
    from colibri_edge.model.convert import convert
    tmp = str(tmp)
    tok = byte_level_tokenizer()
    V = tok.get_vocab_size()
    eos = tok.token_to_id("<|endoftext|>")
    hf = build_hf(os.path.join(tmp, "hf"), case, vocab_size=V, eos_token_id=eos, **overrides)
    tok.save(os.path.join(hf, "tokenizer.json"))
    template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    with open(os.path.join(hf, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": template, "eos_token": "<|endoftext|>",
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f)
    with open(os.path.join(hf, "generation_config.json")) as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = eos
    with open(os.path.join(hf, "generation_config.json"), "w") as f:
        json.dump(cfg, f)
    out = os.path.join(tmp, "col")
    convert(hf, out, progress=False)
    return hf, out, eos


E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _openai_mxfp4(w: np.ndarray):
    """w [..., K] -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8) in OpenAI's checkpoint
    layout: byte b holds values 2b (low nibble) and 2b+1 (high); value = E2M1[nibble] * 2^(e - 127),
    e the smallest exponent whose block max fits in 6, each value to its nearest E2M1 code (a
    stacked [E, ...] tensor one expert at a time: the search is 16 values wide)."""
    if w.ndim == 3:
        parts = [_openai_mxfp4(x) for x in w]
        return np.stack([p[0] for p in parts]), np.stack([p[1] for p in parts])
    g = w.reshape(*w.shape[:-1], -1, 32).astype(np.float64)
    amax = np.abs(g).max(-1)
    e = np.clip(np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), -127, 127).astype(np.int64) + 127
    scaled = g / np.exp2(e - 127.0)[..., None]
    codes = np.abs(scaled[..., None] - E2M1[None, :].astype(np.float64)).argmin(-1).astype(np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8), e.astype(np.uint8)


def mxfp4_checkpoint(tmp: str, case: str = "gpt_oss_mx") -> tuple:
    """A gpt-oss checkpoint as OpenAI ships it (written by hand: save_pretrained cannot write MXFP4 on
    a CPU): the experts' gate_up_proj / down_proj as *_blocks and *_scales, quantization_config
    mxfp4. -> (its directory, the oracle: the same model with the experts dequantised in float32 by
    transformers' own convert_moe_packed_tensors, as a float32 checkpoint)."""
    src = os.path.join(tmp, f"hf_{case}_src")
    mx, oracle = os.path.join(tmp, f"hf_{case}_mxfp4"), os.path.join(tmp, f"hf_{case}_oracle")
    if os.path.exists(os.path.join(oracle, "config.json")):
        return mx, oracle
    build_hf(src, case)
    return pack_mxfp4(src, mx, oracle)


def pack_mxfp4(src: str, mx: str, oracle: str) -> tuple:
    """mxfp4_checkpoint's work on a saved float checkpoint `src` (any tokenizer files are copied)."""
    import shutil
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    t = load_file(os.path.join(src, "model.safetensors"))
    packed, deq = {}, {}
    for name, arr in t.items():
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            blocks, scales = _openai_mxfp4(np.ascontiguousarray(arr.transpose(0, 2, 1)))   # [E, out, in]
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
            deq[name] = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                   dtype=torch.float32).numpy()
            assert deq[name].shape == arr.shape
        else:
            packed[name] = deq[name] = arr
    for d, tensors in ((mx, packed), (oracle, deq)):
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(src):
            if f != "model.safetensors":
                shutil.copy(os.path.join(src, f), os.path.join(d, f))
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    cfg = json.load(open(os.path.join(mx, "config.json")))
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                      "model.layers.*.mlp.router",
                                                                                      "model.embed_tokens", "lm_head"]}
    json.dump(cfg, open(os.path.join(mx, "config.json"), "w"))
    return mx, oracle


# LoRA adapters (tests/test_lora.py): PEFT is the oracle. Which modules each family's adapter changes:
# attention (latent attention's own projections), and the fused experts through target_parameters
LORA_TARGETS = {
    "deepseek_v3": ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"],
    "deepseek_v2": ["q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"],
}
EXPERT_PARAMETERS = ["experts.gate_up_proj", "experts.down_proj"]


def build_lora(hf_dir: str, out_dir: str, targets=None, parameters=EXPERT_PARAMETERS, seed: int = 1, r: int = 4,
               alpha: float = 8, std: float = 0.15, **config) -> str:
    """A PEFT LoRA adapter of the checkpoint at hf_dir saved to out_dir, every factor random and non-zero
    (B too: an adapter at PEFT's init would change nothing); config: other LoraConfig fields."""
    import torch
    from peft import LoraConfig, get_peft_model
    model = checkpoint_class(hf_dir).from_pretrained(hf_dir, dtype=torch.float32)
    mt = json.load(open(os.path.join(hf_dir, "config.json")))["model_type"]
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets or LORA_TARGETS.get(mt, ["q_proj", "k_proj",
                                                                                             "v_proj", "o_proj"]),
                     target_parameters=list(parameters) or None, init_lora_weights=False, **config)
    torch.manual_seed(seed)
    pm = get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, std)
    pm.save_pretrained(out_dir)
    return out_dir


def peft_logits(hf_dir: str, adapter_dir, ids) -> np.ndarray:
    """PeftModel's float32 logits for ids [batch, seq] with the adapter at adapter_dir (None: the base)."""
    import torch
    from peft import PeftModel
    model = checkpoint_class(hf_dir).from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids), dtype=torch.long)).logits.float().numpy()


def reference_mtp_logits(hf: str, ids: np.ndarray, tmp: str) -> np.ndarray:
    """The oracle of an MTP head (DeepSeek-V3 report, section 2.2; vLLM's and llama.cpp's graphs), in torch
    on the checkpoint's own tensors: [T-1, V], row i the head's logits at position i (token ids[i+1], the model's hidden at i). The
    head's decoder layer is transformers' own: the checkpoint loaded with one more layer (Qwen3.5's
    mtp.layers.0 renamed to that layer, a full-attention one), so transformers reads its weights."""
    import copy
    import shutil
    import torch
    from safetensors.numpy import load_file, save_file
    cls = checkpoint_class(hf)
    model = cls.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    cfg = model.config
    L = cfg.num_hidden_layers
    raw = load_file(os.path.join(hf, "model.safetensors"))
    extra = {"num_hidden_layers": L + 1}
    if getattr(cfg, "mlp_layer_types", None):                  # GLM-4.7-Flash: the head's layer is sparse
        extra["mlp_layer_types"] = list(cfg.mlp_layer_types) + ["sparse"]
    if any(k.startswith("mtp.") for k in raw):                 # Qwen3.5's names
        pre = "mtp."
        names = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "norm": "norm"}
        os.makedirs(tmp, exist_ok=True)
        for f in os.listdir(hf):
            if f != "model.safetensors":
                shutil.copy(os.path.join(hf, f), tmp)
        save_file({(f"model.layers.{L}." + k[len("mtp.layers.0."):] if k.startswith("mtp.layers.0.") else k): v
                   for k, v in raw.items()}, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        extra["layer_types"] = list(json.load(open(os.path.join(hf, "config.json")))["layer_types"]) + \
            ["full_attention"]
        longer = tmp
    else:                                                      # DeepSeek-V3's
        pre = f"model.layers.{L}."
        names = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"}
        longer = hf
    w = {k: torch.from_numpy(raw[pre + v + ".weight"].astype(np.float32)) for k, v in names.items()}
    if cfg.model_type == "mixtral" and f"model.layers.{L}.mlp.gate_proj.weight" in raw:
        # a dense head layer on a Mixtral (the demo model's): Mistral's layer, the same attention and a SwiGLU
        import transformers
        mcfg = transformers.MistralConfig(**{k: v for k, v in cfg.to_dict().items() if k not in (
            "model_type", "architectures", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef",
            "router_jitter_noise", "output_router_logits")}, )
        mcfg.num_hidden_layers = L + 1
        cls = transformers.MistralForCausalLM
        extra = {"config": mcfg}
    layer = cls.from_pretrained(longer, dtype=torch.float32, attn_implementation="eager", **extra).model.layers[L]
    base = model.model
    seen = {}
    hook = base.layers[L - 1].register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    x = torch.as_tensor(ids[None, :-1], dtype=torch.long)
    with torch.no_grad():
        h = base(x, use_cache=False).last_hidden_state                          # final-normed, positions 0..T-2
        hook.remove()

        def norm(v, weight):
            n = copy.deepcopy(base.norm)
            n.weight.copy_(weight)
            return n(v)
        e = base.embed_tokens(torch.as_tensor(ids[None, 1:], dtype=torch.long))
        y = torch.cat([norm(e, w["enorm"]), norm(h, w["hnorm"])], dim=-1) @ w["eh_proj"].T
        y = layer(y, **{k: v for k, v in seen.items() if k not in ("hidden_states", "cache", "past_key_values",
                                                                   "use_cache")})
        y = y[0] if isinstance(y, tuple) else y
        return model.lm_head(norm(y, w["norm"]))[0].numpy()
