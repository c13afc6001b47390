// Model shapes the planner prices and the trainer's model does not compute: leading dense blocks
// (model.first_dense_layers), heads apart from dim / n_heads (model.head_dim), a causal sliding
// window (model.sliding_window, model.full_attention_every) and multi-head latent attention
// (model.kv_lora_rank, ...). Each against figures derived by hand; the trainer refuses each by
// name.
#include <gtest/gtest.h>

#include <string>

#include "core/check.h"
#include "model/params.h"
#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "support/expect_error.h"
#include "support/plan_runs.h"

using namespace moetrain;
using namespace moetrain::plan;
using moetrain::testing::error_of;

namespace {

// C 64, 4 blocks, 4 heads of 16 (2 KV heads), 8 experts of 32 top-2, vocabulary 256.
RunConfig small() {
  RunConfig c;
  ModelConfig& m = c.model;
  m.vocab_size = 256;
  m.dim = 64;
  m.n_layers = 4;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.n_experts = 8;
  m.expert_hidden = 32;
  m.top_k = 2;
  m.max_seq_len = 64;
  c.train.batch_size = 2;
  c.train.seq_len = 32;
  return c;
}

ClusterSpec one_node() {
  ClusterSpec c;
  c.device = builtin_device("h100");
  c.devices_per_node = 8;
  c.nodes = 1;
  c.intra_node_bandwidth = 450e9;
  c.inter_node_bandwidth = 400e9;
  c.intra_node_latency = 3e-6;
  c.inter_node_latency = 10e-6;
  return c;
}

}  // namespace

// The first block dense (FFN of 96), the other three MoE. By hand, per block: attention 2 norms
// (2 · 64) + q, o (64 · 64 each) + k, v (32 · 64 each) = 12416; a dense block + 3 · 96 · 64 =
// 30848; an MoE block's dense part + the router 8 · 64 = 12928 and experts 8 · 3 · 32 · 64 =
// 49152. Embedding 256 · 64 = 16384; final norm and head 64 + 16384 = 16448.
TEST(PlanModelShape, FirstDenseLayersInCountsFlopsMemoryAndExchangeByHand) {
  RunConfig cfg = small();
  cfg.model.first_dense_layers = 1;
  cfg.model.dense_hidden = 96;
  const ModelConfig& m = cfg.model;
  EXPECT_EQ(m.n_moe_layers(), 3);
  const ParamCounts pc = count_params(m);
  EXPECT_DOUBLE_EQ(pc.dense, 16384 + 30848 + 3 * 12928 + 16448);  // 102464
  EXPECT_DOUBLE_EQ(pc.expert, 3 * 49152);
  // Forward FLOPs of a micro-batch of N = 64 tokens: the dense FFN 2 · 64 · 3 · 64 · 96, the
  // experts 3 blocks × 2 · 64 tokens · 2 experts · 3 · 64 · 32, the router 3 × 2 · 64 · 64 · 8.
  const ForwardFlops f = forward_flops(m, 2, 32);
  EXPECT_DOUBLE_EQ(f.shared, 2.0 * 64 * 3 * 64 * 96);
  EXPECT_DOUBLE_EQ(f.experts, 3 * 2.0 * 64 * 2 * 3 * 64 * 32);
  EXPECT_DOUBLE_EQ(f.router, 3 * 2.0 * 64 * 64 * 8);
  // Memory: this trainer's f32 weights of every parameter on a calibrated CPU, one process.
  EXPECT_DOUBLE_EQ(memory_per_device(cfg, {1, 1}).params, 4.0 * (102464 + 147456));
  // The exchange under EP 2 (f32 rows): 4 exchanges per MoE block, 12 a step; a rank sends the
  // half of its 64 · 2 rows bound to the other rank, 64 · 2 / 2 · 64 · 4 = 16384 bytes.
  const Prediction p = predict(cfg, one_node(), {2, 2}, uniform_load(8));
  EXPECT_DOUBLE_EQ(p.comm.a2a_exchanges, 12);
  EXPECT_DOUBLE_EQ(p.comm.a2a_send_bytes, 16384);
  // The dense gradients (f32) over the 2 ranks: a ring moves 2 · (2 − 1)/2 of 4 · 102464 bytes.
  ASSERT_FALSE(p.comm.reductions.empty());
  ASSERT_EQ(p.comm.reductions[0].second.phases.size(), 1u);
  EXPECT_DOUBLE_EQ(p.comm.reductions[0].second.phases[0].bytes, 4.0 * 102464);
}

TEST(PlanModelShape, NewKeysAreValidatedNamingKeyAndValue) {
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"model.first_dense_layers=5"}, "model.first_dense_layers = 5: must be in [0, model.n_layers = 4]"},
      {{"model.head_dim=-2"}, "model.head_dim = -2: must be ≥ 0"},
      {{"model.head_dim=15"}, "model.head_dim = 15: must be even for RoPE"},
      {{"model.sliding_window=-1"}, "model.sliding_window = -1: must be ≥ 0"},
      {{"model.full_attention_every=2"}, "model.full_attention_every = 2: needs model.sliding_window > 0"},
      {{"model.q_lora_rank=32"}, "model.q_lora_rank = 32: multi-head latent attention needs model.kv_lora_rank > 0"},
      {{"model.kv_lora_rank=32", "model.qk_rope_head_dim=8", "model.qk_nope_head_dim=16"},
       "model.v_head_dim = 0: must be positive with model.kv_lora_rank = 32"},
      {{"model.kv_lora_rank=32", "model.qk_rope_head_dim=7", "model.qk_nope_head_dim=16",
        "model.v_head_dim=16"},
       "model.qk_rope_head_dim = 7: must be even for RoPE"},
  };
  for (const auto& [sets, message] : cases) {
    const std::string e = error_of([&] { with_overrides(small(), sets); });
    EXPECT_NE(e.find(message), std::string::npos) << sets[0] << ": " << e;
  }
  // model.n_heads must divide model.dim unless model.head_dim gives the head size.
  EXPECT_NE(error_of([] { with_overrides(small(), {"model.n_heads=3", "model.n_kv_heads=1"}); })
                .find("model.n_heads = 3: must divide model.dim = 64"),
            std::string::npos);
  EXPECT_EQ(error_of([] {
              with_overrides(small(), {"model.n_heads=3", "model.n_kv_heads=1", "model.head_dim=16"});
            }),
            "");
}

// The trainer's model refuses every planner-only shape by name (every model it builds passes
// through ParamLayout), and takes model.head_dim where it equals dim / n_heads.
TEST(PlanModelShape, TrainerRefusesPlannerOnlyShapesByName) {
  const std::pair<std::vector<std::string>, std::string> cases[] = {
      {{"model.first_dense_layers=1"}, "model.first_dense_layers = 1: "},
      {{"model.head_dim=32"}, "model.head_dim = 32: the trainer's model has heads of model.dim / model.n_heads (64 / 4)"},
      {{"model.sliding_window=8"}, "model.sliding_window = 8: "},
      {{"model.kv_lora_rank=32", "model.qk_rope_head_dim=8", "model.qk_nope_head_dim=16",
        "model.v_head_dim=16"},
       "model.kv_lora_rank = 32: "},
  };
  for (const auto& [sets, message] : cases) {
    const RunConfig c = with_overrides(small(), sets);
    const std::string e = error_of([&] { ParamLayout layout(c.model); });
    EXPECT_NE(e.find(message), std::string::npos) << sets[0] << ": " << e;
    EXPECT_NE(e.find("planner's only"), std::string::npos) << e;
  }
  EXPECT_EQ(error_of([] { ParamLayout layout(with_overrides(small(), {"model.head_dim=16"}).model); }),
            "");
}

// Through the binary: `moetrain train` (here its dry run) refuses the published GPT-OSS config
// naming the key, where `moetrain plan` prices it.
TEST(PlanModelShape, TrainCommandRefusesAPlannerOnlyConfigByName) {
  const std::string cfg = moetrain::testing::plan_file("gpt_oss_120b_megatron.toml");
  const moetrain::testing::ProcessResult r =
      moetrain::testing::run_moetrain({"train", "-c", cfg, "--dry-run"}, {}, 60);
  EXPECT_NE(r.code, 0) << r.output();
  EXPECT_NE(r.output().find("model.head_dim = 64: the trainer's model has heads of model.dim / "
                            "model.n_heads (2880 / 64)"),
            std::string::npos)
      << r.output();
}

// A window of W keys: a query t attends to min(t + 1, W) keys, so a sequence of T has
// W(W + 1)/2 + (T − W)·W pairs; with full attention every 2nd block, blocks 1 and 3 have
// T(T + 1)/2. The scores' forward FLOPs are 2 · B · NH · pairs · (q/k width + value width).
TEST(PlanModelShape, SlidingWindowPricesItsPairsByHand) {
  RunConfig cfg = with_overrides(small(), {"model.sliding_window=8",
                                           "model.full_attention_every=2"});
  const ModelConfig& m = cfg.model;
  EXPECT_EQ(m.attention_window(0), 8);
  EXPECT_EQ(m.attention_window(1), 0);
  EXPECT_DOUBLE_EQ(m.attention_pairs(0, 32), 8 * 9 / 2.0 + 24 * 8);  // 228
  EXPECT_DOUBLE_EQ(m.attention_pairs(1, 32), 32 * 33 / 2.0);         // 528
  EXPECT_DOUBLE_EQ(m.attention_pairs(0, 6), 21);  // a window longer than the sequence
  EXPECT_DOUBLE_EQ(forward_flops(m, 2, 32).attention_scores,
                   2.0 * 2 * 4 * (2 * 228 + 2 * 528) * (16 + 16));
  // The windowed model's attention takes less time, its other parts none less.
  const Prediction windowed = predict(cfg, one_node(), {1, 1}, uniform_load(8));
  const Prediction full = predict(small(), one_node(), {1, 1}, uniform_load(8));
  EXPECT_LT(windowed.parts.attention, full.parts.attention);
  EXPECT_DOUBLE_EQ(windowed.parts.experts, full.parts.experts);
}

// model.head_dim apart from dim / n_heads: GPT-OSS's 64 heads of 64 over 2880. By hand, the
// projections of a block: q and o 2880 · 64 · 64, k and v 2880 · 8 · 64 each = 26542080.
TEST(PlanModelShape, HeadDimApartFromDimOverHeadsByHand) {
  const RunConfig cfg =
      load_run_config(moetrain::testing::plan_file("gpt_oss_120b_megatron.toml"), {});
  const ModelConfig& m = cfg.model;
  EXPECT_EQ(m.head_dim(), 64);
  EXPECT_EQ(m.attention_params(), 26542080);
  EXPECT_EQ(m.vocab_size, 201088);  // a vocabulary past 65,536 in the planner
  EXPECT_DOUBLE_EQ(forward_flops(m, 1, 4096).attention_proj, 36 * 2.0 * 4096 * 26542080);
  // Parameters: 36 blocks of 2 norms + 26542080 + a router 128 · 2880 + 128 experts of
  // 3 · 2880 · 2880; embedding and head 201088 · 2880 each; the final norm.
  const ParamCounts pc = count_params(m);
  EXPECT_DOUBLE_EQ(pc.dense, 36 * (2 * 2880 + 26542080.0 + 128 * 2880) + 2 * 201088.0 * 2880 + 2880);
  EXPECT_DOUBLE_EQ(pc.expert, 36 * 128 * 3 * 2880.0 * 2880);
  // 116,789,048,640 in all against the model card's 116.83B (its biases and attention sinks,
  // 0.04B, are not modelled); active a token, the embedding aside as the card counts: 4 of 128
  // experts, 5.131B against 5.13B.
  EXPECT_NEAR((pc.dense + pc.expert) / 116.83e9, 1.0, 0.001);
  EXPECT_NEAR((pc.dense + pc.expert * 4 / 128 - 201088.0 * 2880) / 5.13e9, 1.0, 0.001);
}

// Multi-head latent attention has a key and a value per head: tensor parallelism splits the
// heads, whatever model.n_kv_heads says; grouped-query attention's KV heads must divide.
TEST(PlanModelShape, LatentAttentionSplitsHeadsNotKvHeadsUnderTensorParallelism) {
  RunConfig cfg = with_overrides(small(), {"model.n_kv_heads=1"});
  EXPECT_NE(layout_problem(cfg, one_node(), {2, 1, 2}).find("model.n_kv_heads = 1"),
            std::string::npos);
  cfg = with_overrides(cfg, {"model.kv_lora_rank=32", "model.qk_rope_head_dim=8",
                             "model.qk_nope_head_dim=16", "model.v_head_dim=16"});
  EXPECT_EQ(layout_problem(cfg, one_node(), {2, 1, 2}), "");
  // Its projections by hand at C 64, 4 heads, no query rank: W_q 4 · 24 · 64 = 6144, W_kva
  // (32 + 8) · 64 = 2560, the latent norm 32, W_kvb 4 · (16 + 16) · 32 = 4096, W_o 4 · 16 · 64 =
  // 4096.
  EXPECT_EQ(cfg.model.attention_params(), 6144 + 2560 + 32 + 4096 + 4096);
  EXPECT_GT(predict(cfg, one_node(), {2, 1, 2}, uniform_load(8)).parts.attention, 0);
}

// DeepSeek-V3 (configs/plan/deepseek_v3_671b.toml): 671B parameters, 37B activated. By hand,
// C = 7168, 128 heads:
//   attention of a block (multi-head latent): W_qa 7168 · 1536 = 11010048, its norm 1536,
//     W_qb 1536 · 128 · (128 + 64) = 37748736, W_kva 7168 · (512 + 64) = 4128768, its norm 512,
//     W_kvb 512 · 128 · (128 + 128) = 16777216, W_o 128 · 128 · 7168 = 117440512: 187107328;
//     with the block's two norms (2 · 7168) 187121664, × 61 blocks = 11414421504;
//   3 dense FFNs of 3 · 7168 · 18432 = 396361728: 1189085184;
//   58 MoE blocks of a router 256 · 7168 = 1835008, a shared expert 3 · 7168 · 2048 = 44040192
//     and 256 experts of 44040192 (11274289152): 58 · 11320164352 = 656569532416;
//   embedding and LM head 129280 · 7168 = 926679040 each, the final norm 7168.
// Total 671026404352 (671.03B). Activated a token: all but 248 of 256 experts in each MoE block,
// 671026404352 − 58 · 248 · 44040192 = 37552282624 (37.55B; the paper's 37B).
TEST(PlanModelShape, DeepSeekV3ParameterCountByHand) {
  const RunConfig cfg =
      load_run_config(moetrain::testing::plan_file("deepseek_v3_671b.toml"), {});
  const ModelConfig& m = cfg.model;
  EXPECT_EQ(m.attention_params(), 187107328);
  EXPECT_EQ(m.n_moe_layers(), 58);
  const ParamCounts pc = count_params(m);
  EXPECT_DOUBLE_EQ(pc.dense + pc.expert, 671026404352.0);
  const double activated = pc.dense + pc.expert * static_cast<double>(m.top_k) /
                                          static_cast<double>(m.n_experts);
  EXPECT_DOUBLE_EQ(activated, 37552282624.0);
  EXPECT_NEAR((pc.dense + pc.expert) / 671e9, 1.0, 0.001);
  EXPECT_NEAR(activated / 37e9, 1.0, 0.02);
  // Forward FLOPs of one sequence of 4096: the projections' GEMM weights (the attention's less
  // its two latent norms, 187105280) once a token; the scores over 4096 · 4097 / 2 pairs per
  // head at q/k width 192 and value width 128.
  const ForwardFlops f = forward_flops(m, 1, 4096);
  EXPECT_DOUBLE_EQ(f.attention_proj, 61 * 2.0 * 4096 * 187105280);
  EXPECT_DOUBLE_EQ(f.attention_scores, 61 * 2.0 * 128 * (4096 * 4097 / 2.0) * (192 + 128));
  EXPECT_DOUBLE_EQ(f.shared, 58 * 6.0 * 4096 * 7168 * 2048 + 3 * 6.0 * 4096 * 7168 * 18432);
}
