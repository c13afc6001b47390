// The up-front memory check: a config that cannot fit is refused within moments with both
// figures; the small configs pass; the estimate grows as the model does.
#include <gtest/gtest.h>

#include <chrono>
#include <fmt/format.h>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "ft/ft_support.h"
#include "core/check.h"
#include "io/safetensors.h"
#include "model/params.h"
#include "model/transformer.h"
#include "support/small_models.h"
#include "support/temp_dir.h"
#include "train/memory_estimate.h"

namespace moetrain::testing {
namespace {

TEST(MemoryEstimate, CountsParametersOptimizerAndActivations) {
  ModelConfig m;
  const MemoryEstimate e = estimate_memory(m, 16, 128, 0);
  EXPECT_GT(e.parameters, 0);
  EXPECT_EQ(e.gradients, e.parameters);
  EXPECT_EQ(e.optimizer, 2 * e.parameters);
  EXPECT_EQ(e.low_precision, 0);
  EXPECT_GT(e.activations, 0);
  EXPECT_EQ(estimate_memory(m, 16, 128, 2).low_precision, e.parameters / 2);
  ModelConfig twice = m;
  twice.n_layers *= 2;
  EXPECT_GT(estimate_memory(twice, 16, 128, 0).total(), 1.5 * e.total() - e.parameters);
  EXPECT_GT(available_memory(), 0);
}

// Bytes per parameter by ZeRO stage over d ranks, against Megatron-LM's distributed-optimizer
// table (bf16 weights with f32 gradients: 18 bytes, 6 + 12/d with the distributed optimizer;
// f32: 16, 8 + 8/d) and DeepSpeed's stages (2: the gradients too, 3: the weights too).
TEST(MemoryEstimate, StateBytesByZeroStage) {
  const double d = 8;
  auto per_param = [&](const ParamState& s) { return state_memory(s, 1000, d).total() / 1000; };
  EXPECT_DOUBLE_EQ(per_param(mixed_precision_state("adamw", 0)), 18);
  EXPECT_DOUBLE_EQ(per_param(mixed_precision_state("adamw", 1)), 6 + 12 / d);
  EXPECT_DOUBLE_EQ(per_param(mixed_precision_state("adamw", 2)), 2 + 16 / d);
  EXPECT_DOUBLE_EQ(per_param(mixed_precision_state("adamw", 3)), 18 / d);
  EXPECT_DOUBLE_EQ(per_param(trainer_state("adamw", 0, 0)), 16);
  EXPECT_DOUBLE_EQ(per_param(trainer_state("adamw", 0, 1)), 8 + 8 / d);
  // This trainer in bf16: its f32 weights and the bf16 copy, the copy sharded only at stage 3.
  EXPECT_DOUBLE_EQ(per_param(trainer_state("adamw", 2, 1)), 10 + 8 / d);
  EXPECT_DOUBLE_EQ(per_param(trainer_state("adamw", 2, 3)), 18 / d);
  EXPECT_DOUBLE_EQ(per_param(trainer_state("sgd", 0, 0)), 12);
  const MemoryEstimate m = state_memory(mixed_precision_state("adamw", 1), 1000, d);
  EXPECT_DOUBLE_EQ(m.parameters, 2000);
  EXPECT_DOUBLE_EQ(m.gradients, 4000);
  EXPECT_DOUBLE_EQ(m.optimizer, 12000 / d);  // master weights and both moments
  EXPECT_THROW(state_memory(trainer_state("adamw", 0, 4), 1, 1), Error);
}

// A model small enough to count by hand: vocabulary 16, dim 8, 2 layers of 2 heads (head_dim 4)
// and 1 KV head, 4 experts of hidden 6 (top-2) in both.
ModelConfig hand_counted_model() {
  ModelConfig m;
  m.vocab_size = 16;
  m.dim = 8;
  m.n_layers = 2;
  m.n_heads = 2;
  m.n_kv_heads = 1;
  m.n_experts = 4;
  m.expert_hidden = 6;
  m.top_k = 2;
  m.max_seq_len = 8;
  return m;
}

TEST(MemoryEstimate, ParameterCountsByHand) {
  const ParamCounts c = count_params(hand_counted_model());
  // Embedding and head 2·16·8, final norm 8; per layer two norms 2·8, q and o 2·(2·4)·8, k and v
  // 2·(1·4)·8, the router 4·8.
  EXPECT_DOUBLE_EQ(c.dense, 2 * 16 * 8 + 8 + 2 * (2 * 8 + 2 * 8 * 8 + 2 * 4 * 8 + 4 * 8));
  EXPECT_DOUBLE_EQ(c.dense, 744);
  EXPECT_DOUBLE_EQ(c.expert, 2 * 4 * 3 * 6 * 8);  // per layer 4 experts of w1, w3, w2
  EXPECT_DOUBLE_EQ(c.expert, 1152);
}

// The units of the hand-counted model (unit_params): the embedding 16·8; a block's norms 2·8,
// q and o 2·8·8, k and v 2·4·8, router 4·8 (240 dense) and its 4 experts 4·3·6·8 (576); the final
// norm 8 and the head 16·8.
constexpr double kEmbedding = 128, kBlockDense = 240, kBlockExperts = 576, kHead = 136;

// Pipeline stages (dist.pp = 2 on 4 ranks: a stage's 2 copies, one per pipeline). ZeRO-2 and 3
// shard over a stage's copies; ZeRO-3 keeps the stage's half of the dense tensors (its block, the
// embedding or the head) and its block's experts sharded over the 2 copies, and the rest of two
// neighbouring units it gathers (half of each: the other copy's shard); a stage reduces its
// gradients once a step, after its last backward, so at ZeRO-2 and 3 the stage's gradients stay
// resident through the step. A stage of one copy (2 ranks, one pipeline) has nothing to shard
// over or reduce: the whole buffer, as at ZeRO-1, and no reduction buffers.
TEST(MemoryEstimate, PipelineStagesShardOverTheStagesCopies) {
  const ModelConfig m = hand_counted_model();
  const double dense = 744, experts = 1152;
  for (int zero = 1; zero <= 3; ++zero) {
    RankLayout l;
    l.world = 4, l.pp = 2;
    l.whole_params_under_tp = true;  // as the trainer's layout (trainer_layout)
    l.state = trainer_state("adamw", 0, zero);
    const MemoryEstimate e = rank_memory(m, 2, 8, l);
    EXPECT_DOUBLE_EQ(e.parameters,
                     zero == 3 ? 4 * (dense / 2 / 2 + experts / 2 / 2 +
                                      2 * (kBlockDense + kBlockExperts) / 2)
                               : 4 * (dense + experts))
        << zero;
    EXPECT_DOUBLE_EQ(e.gradients,
                     zero >= 2 ? 4 * (dense / 2 + experts / 2) : 4 * (dense + experts))
        << zero;
    EXPECT_DOUBLE_EQ(e.optimizer, 8 * (dense / 2 / 2 + experts / 2 / 2)) << zero;
    RankLayout one = l;
    one.world = 2;
    const MemoryEstimate o = rank_memory(m, 2, 8, one);
    EXPECT_DOUBLE_EQ(o.parameters, 4 * (dense + experts)) << zero;
    EXPECT_DOUBLE_EQ(o.gradients, 4 * (dense + experts)) << zero;
    EXPECT_DOUBLE_EQ(o.buffers, 0) << zero;
  }
}

// 4 ranks with dist.ep = 2 (each owns 2 of the 4 experts, held by 2 replicas), AdamW in f32:
// this trainer keeps every parameter's weight and gradient in its flat buffer and steps its own
// experts, ZeRO-1 sharding their moments (dense over the 4 ranks, experts over their 2
// replicas); ZeRO-3 keeps its shard of the weights and the rest of the units it gathers (two
// blocks of their dense tensors and its 2 experts here, less the shard it holds already: 3/4 of
// the dense tensors, 1/2 of the experts), and its buckets end with the blocks; a trainer that keeps only its experts (GPU
// trainers) shards the gradients at stage 2 and the weights at stage 3 as well.
TEST(MemoryEstimate, RankStateUnderExpertParallelismByZeroStage) {
  const ModelConfig m = hand_counted_model();
  const double dense = 744, experts = 1152, own = experts / 2;
  const double block = kBlockDense + kBlockExperts / 2;  // a block as this rank holds it
  const double block_out = kBlockDense * 3 / 4 + kBlockExperts / 2 / 2;  // outside its shard
  for (int zero = 0; zero <= 3; ++zero) {
    RankLayout l;
    l.world = 4;
    l.ep = 2;
    l.state = trainer_state("adamw", 0, zero);
    const MemoryEstimate e = rank_memory(m, 2, 8, l);
    EXPECT_DOUBLE_EQ(e.parameters,
                     zero == 3 ? 4 * (dense / 4 + own / 2 + 2 * block_out) : 4 * (dense + experts))
        << zero;
    EXPECT_DOUBLE_EQ(e.gradients, zero == 3 ? 4 * 2 * block : 4 * (dense + experts)) << zero;
    EXPECT_DOUBLE_EQ(e.optimizer, zero >= 1 ? 8 * (dense / 4 + own / 2) : 8 * (dense + own))
        << zero;
    EXPECT_DOUBLE_EQ(e.low_precision, 0) << zero;
    // The gradient reduction's shard (dense / 4 + own experts / 2) and two buckets (the packed
    // one and MPI's temporary; each the whole of dense + own here, smaller than a bucket, and
    // under ZeRO-3 a block, where its buckets end); the exchange's rows: 4·K·C floats a token in
    // each of the 2 MoE layers.
    EXPECT_DOUBLE_EQ(e.buffers, 4 * (dense / 4 + own / 2) + 2 * 4 * (zero == 3 ? block : dense + own) +
                                    4 * (4.0 * 2 * 8) * (2 * 8 * 2))
        << zero;
    // ZeRO-2 releases each reduced bucket's gradients: with buckets smaller than a block, the
    // block backward writes and the bucket being reduced stay resident; ZeRO-3 the block
    // backward writes and the one before it.
    RankLayout small = l;
    small.bucket_first_bytes = small.bucket_bytes = 64;
    const double grads[] = {4 * (dense + experts), 4 * (dense + experts), 4 * block + 64,
                            4 * 2 * block};
    EXPECT_DOUBLE_EQ(rank_memory(m, 2, 8, small).gradients, grads[zero]) << zero;
    // Buckets larger than a block (528 floats): two of them; at most the whole buffer.
    small.bucket_first_bytes = small.bucket_bytes = 3072;
    EXPECT_DOUBLE_EQ(rank_memory(m, 2, 8, small).gradients, zero == 2 ? 2 * 3072 : grads[zero])
        << zero;
    small.bucket_first_bytes = small.bucket_bytes = 4096;
    EXPECT_DOUBLE_EQ(rank_memory(m, 2, 8, small).gradients,
                     zero == 2 ? 4 * (dense + experts) : grads[zero])
        << zero;
    l.whole_buffer = false;
    const MemoryEstimate own_only = rank_memory(m, 2, 8, l);
    auto shard = [&](int from) { return zero >= from ? dense / 4 + own / 2 : dense + own; };
    EXPECT_DOUBLE_EQ(own_only.parameters, 4 * shard(3)) << zero;
    EXPECT_DOUBLE_EQ(own_only.gradients, 4 * shard(2)) << zero;
    EXPECT_DOUBLE_EQ(own_only.optimizer, 8 * shard(1)) << zero;
    // A spare replica slot per rank holds one more expert of each layer (not stepped).
    l.spare_slots = 1;
    EXPECT_DOUBLE_EQ(rank_memory(m, 2, 8, l).parameters, 4 * shard(3) + 4 * experts / 4) << zero;
    EXPECT_DOUBLE_EQ(rank_memory(m, 2, 8, l).optimizer, 8 * shard(1)) << zero;
  }
  // Offloaded optimizer state leaves the resident set; its window stays.
  RankLayout off;
  off.state = trainer_state("adamw", 0, 0);
  const MemoryEstimate resident = rank_memory(m, 2, 8, off);
  off.offload = Offload::HostFile;
  const MemoryEstimate offloaded = rank_memory(m, 2, 8, off);
  EXPECT_DOUBLE_EQ(offloaded.optimizer, 0);
  // AdamW: two state buffers, three chunks of 2^20 floats each in the ring.
  EXPECT_DOUBLE_EQ(offloaded.buffers, resident.buffers + 3.0 * 2 * (1 << 20) * 4);
  EXPECT_DOUBLE_EQ(offloaded.parameters, resident.parameters);
}

// dist.tp as the engine runs it: every rank of a tensor-parallel pair keeps the whole parameters,
// gradients and optimizer state (ZeRO-1 shards the state over all 4 ranks, as for 4 data-parallel
// ranks) and fewer activations; Megatron's tensor parallelism (the planner's for GPU trainers)
// keeps half the dense weights' state instead.
TEST(MemoryEstimate, EngineTensorParallelKeepsWholeParametersAndFewerActivations) {
  RunConfig cfg;
  cfg.model = hand_counted_model();
  cfg.train.batch_size = 2, cfg.train.seq_len = 8;
  cfg.train.precision = Precision::F32;
  const ModelConfig& m = cfg.model;
  for (int zero = 0; zero <= 1; ++zero) {
    cfg.dist.zero = zero;
    cfg.dist.tp = 1;
    const RankLayout dp = trainer_layout(cfg, 4, 0);
    cfg.dist.tp = 2;
    const RankLayout tp = trainer_layout(cfg, 4, 0);
    ASSERT_EQ(tp.tp, 2);
    ASSERT_TRUE(tp.whole_params_under_tp);
    const MemoryEstimate a = rank_memory(m, 2, 8, dp), b = rank_memory(m, 2, 8, tp);
    EXPECT_DOUBLE_EQ(b.parameters, a.parameters) << zero;
    EXPECT_DOUBLE_EQ(b.gradients, a.gradients) << zero;
    EXPECT_DOUBLE_EQ(b.optimizer, a.optimizer) << zero;
    EXPECT_DOUBLE_EQ(b.optimizer, zero == 1 ? 8 * (744 + 1152) / 4.0 : 8 * (744 + 1152.0)) << zero;
    EXPECT_LT(b.activations, a.activations) << zero;
    RankLayout megatron = tp;
    megatron.whole_params_under_tp = false;
    const MemoryEstimate c = rank_memory(m, 2, 8, megatron);
    if (zero == 0) {
      EXPECT_DOUBLE_EQ(c.optimizer, 8 * (744 / 2.0 + 1152));
    }
    EXPECT_LT(c.activations, b.activations) << zero;
  }
}

// Interleaved and zero_bubble on its order (dist.vp = 2) hold the same chunks in flight on the
// first stage (2 stages, 8 micro-batches: 5 chunks, 2.5 micro-batches' worth of its layers, as
// the schedule's timeline counts them); zero_bubble adds its deferred output gradients.
TEST(MemoryEstimate, ZeroBubbleWithChunksHoldsInterleavedsActivations) {
  RunConfig cfg;
  cfg.model = hand_counted_model();
  cfg.train.batch_size = 2, cfg.train.seq_len = 8, cfg.train.grad_accum = 8;
  cfg.train.precision = Precision::F32;
  cfg.dist.pp = 2, cfg.dist.vp = 2;
  cfg.dist.pp_schedule = "interleaved";
  const RankLayout inter = trainer_layout(cfg, 2, 0);
  cfg.dist.pp_schedule = "zero_bubble";
  const RankLayout zb = trainer_layout(cfg, 2, 0);
  EXPECT_DOUBLE_EQ(inter.pipe_in_flight, 2.5);
  EXPECT_DOUBLE_EQ(zb.pipe_in_flight, 2.5);
  EXPECT_TRUE(zb.pipe_split_backward);
  EXPECT_FALSE(inter.pipe_split_backward);
  const MemoryEstimate a = rank_memory(cfg.model, 2, 8, inter);
  const MemoryEstimate b = rank_memory(cfg.model, 2, 8, zb);
  EXPECT_GT(b.activations, a.activations);
}

// ZeRO-3's gathered units peak at the larger of the embedding with block 0, two neighbouring
// blocks, and the last block with the head; each block as this rank holds it (its dense tensors
// and its E/ep experts), and of each gathered unit only what lies outside the rank's shard (its
// dense tensors but 1/4, its experts but 1/2). The gradients resident are the largest two neighbouring units (the one
// backward writes, the one reduced); one process shards nothing.
TEST(MemoryEstimate, ZeroThreeGathersTheLargestNeighbouringUnits) {
  RankLayout l;
  l.world = 4;
  l.ep = 2;
  l.state = trainer_state("adamw", 0, 3);
  const double shard = 744.0 / 4 + 1152.0 / 2 / 2;  // dense over 4 ranks, own experts over 2
  const double block = kBlockDense + kBlockExperts / 2;
  const double block_out = kBlockDense * 3 / 4 + kBlockExperts / 2 / 2;
  auto gathered = [&](const ModelConfig& m, double units) {
    const MemoryEstimate e = rank_memory(m, 2, 8, l);
    RankLayout whole = l;
    whole.state.zero = 1;
    const double sharded = state_memory(l.state, count_params(m).dense, 4).parameters +
                           state_memory(l.state, count_params(m).expert / 2, 2).parameters;
    EXPECT_DOUBLE_EQ(e.gradients, 4 * units);
    EXPECT_DOUBLE_EQ(e.optimizer, rank_memory(m, 2, 8, whole).optimizer);
    return e.parameters - sharded;
  };
  ModelConfig m = hand_counted_model();
  // Two blocks: 2 · 528 floats, above the embedding with block 0 (656 floats) and block 1 with the
  // head (664).
  ASSERT_GT(2 * block, kEmbedding + block);
  EXPECT_DOUBLE_EQ(gathered(m, 2 * block), 4 * 2 * block_out);
  EXPECT_DOUBLE_EQ(rank_memory(m, 2, 8, l).parameters, 4 * (shard + 2 * block_out));
  // A vocabulary of 256: the head (8 + 256·8) with the last block.
  m.vocab_size = 256;
  const double head = 8 + 256 * 8, embedding = 256 * 8;
  EXPECT_DOUBLE_EQ(gathered(m, block + head), 4 * (block_out + head * 3 / 4));
  // Block 1 dense (norms, attention 208, FFN 3·12·8 where 12 = top_k · expert_hidden): the
  // embedding with the MoE block 0 is the largest pair of whole units (the gradients), but of
  // what a gather adds the dense block 1 with the head is (both dense: 3/4 of each, where half
  // of block 0's experts are this rank's shard).
  m.dense_every = 2;
  const double dense_block = kBlockDense - 32 + 3 * 12 * 8;
  ASSERT_GT(embedding + block, dense_block + head);
  ASSERT_GT((dense_block + head) * 3 / 4, embedding * 3 / 4 + block_out);
  EXPECT_DOUBLE_EQ(gathered(m, embedding + block), 4 * (dense_block + head) * 3 / 4);
  // Each rank holding all 4 experts (dist.ep = 1, 4 replicas): the blocks grow by the other 2,
  // and 3/4 of each is outside the shard; the shard with two blocks' gathers (474 + 2 · 612
  // floats) stays under the whole buffer (1896). Gradients are written for whole blocks.
  m = hand_counted_model();
  l.ep = 1;
  const double full_block = kBlockDense + kBlockExperts;
  const MemoryEstimate e = rank_memory(m, 2, 8, l);
  EXPECT_DOUBLE_EQ(e.parameters, 4 * (744.0 / 4 + 1152.0 / 4 + 2 * full_block * 3 / 4));
  EXPECT_LT(e.parameters, 4 * (744.0 + 1152.0));
  EXPECT_DOUBLE_EQ(e.gradients, 4 * 2 * full_block);
  m.n_layers = 8;  // 8 blocks: the shard (8 · 816 + 264 floats over 4) and two blocks' gathers
  EXPECT_DOUBLE_EQ(rank_memory(m, 2, 8, l).parameters,
                   4 * ((8 * full_block + kEmbedding + kHead) / 4 + 2 * full_block * 3 / 4));
  // One process: nothing is sharded or gathered.
  m = hand_counted_model();
  l.world = 1;
  EXPECT_DOUBLE_EQ(rank_memory(m, 2, 8, l).parameters, 4 * (744.0 + 1152.0));
  EXPECT_DOUBLE_EQ(rank_memory(m, 2, 8, l).gradients, 4 * (744.0 + 1152.0));
}

// A model whose state dominates (16 blocks of dim 256, 8 experts of hidden 1024, 104 M
// parameters) on 4 ranks: ZeRO-3 holds its quarter of the weights and the other three quarters
// of two blocks gathered, and
// gradients of two blocks, against ZeRO-1's whole buffer of weights and gradients: well under
// half the state, the parameter term by hand from the shapes.
TEST(MemoryEstimate, ZeroThreeHoldsFarLessThanZeroOne) {
  ModelConfig m;
  m.vocab_size = 256;
  m.dim = 256;
  m.n_layers = 16;
  m.n_heads = 4;
  m.n_kv_heads = 2;
  m.n_experts = 8;
  m.expert_hidden = 1024;
  m.top_k = 2;
  m.max_seq_len = 64;
  // A block: norms 2·256, q and o 2·256·256, k and v 2·128·256, router 8·256; 8 experts of
  // 3·1024·256.
  const double block = 2 * 256 + 2 * 256 * 256 + 2 * 128 * 256 + 8 * 256 + 8 * 3 * 1024 * 256;
  const double all = 256 * 256 + 16 * block + 256 + 256 * 256;
  ASSERT_DOUBLE_EQ(all, count_params(m).dense + count_params(m).expert);
  RankLayout l;
  l.world = 4;
  l.state = trainer_state("adamw", 0, 1);
  const MemoryEstimate one = rank_memory(m, 1, 32, l);
  l.state.zero = 3;
  const MemoryEstimate three = rank_memory(m, 1, 32, l);
  EXPECT_DOUBLE_EQ(one.parameters, 4 * all);
  EXPECT_DOUBLE_EQ(one.gradients, 4 * all);
  EXPECT_DOUBLE_EQ(three.parameters, 4 * (all / 4 + 2 * block * 3 / 4));
  EXPECT_DOUBLE_EQ(three.gradients, 4 * 2 * block);
  EXPECT_DOUBLE_EQ(three.optimizer, one.optimizer);  // 8 · all / 4 both
  EXPECT_LT(three.state(), 0.45 * one.state());
  EXPECT_LT(three.total(), 0.6 * one.total());  // activations and buffers the same
}

// Recomputation: moe drops the experts' intermediates of all but one block; full keeps each
// block's input and one block's activations. Both keep less; full least for a deep model.
TEST(MemoryEstimate, RecomputationKeepsLess) {
  ModelConfig m = hand_counted_model();
  m.n_layers = 8;
  RankLayout l;
  const double none = rank_memory(m, 4, 8, l).activations;
  l.recompute = Recompute::Moe;
  const double moe = rank_memory(m, 4, 8, l).activations;
  l.recompute = Recompute::Full;
  const double full = rank_memory(m, 4, 8, l).activations;
  // Per token of a block: 2·(3·K·F) floats of intermediates and their gradients (K 2, F 6).
  EXPECT_DOUBLE_EQ(none - moe, 4.0 * 32 * 7 * 2 * 3 * 2 * 6);
  EXPECT_LT(full, moe);
}

// The estimate's activations are the model's own formula (activation_parts, model/
// activation_bytes.h): without this trainer's backward buffers (a forward as inference and GPU
// trainers hold it) they equal activation_bytes_for, and what a Transformer holds after a forward
// within 2% (the router's backward scratch, which the formula leaves out; the same bound as
// tests/model/recompute_test.cpp), in f32 and bf16 (its rounded GEMM inputs), in every
// recomputation mode, with a dense layer and a shared expert.
TEST(MemoryEstimate, ActivationsAreWhatTheModelHoldsAfterAForward) {
  ModelConfig c = small_lm(40, 32, 24, 4);  // top-4 of 4 experts: N·K rows exactly, dropless
  c.n_layers = 3;
  c.shared_expert_hidden = 16;
  c.dense_every = 3;  // layer 2 dense
  c.max_seq_len = 64;
  const int64_t B = 2, T = 16;
  for (DType lp : {DType::F32, DType::BF16}) {
    for (Recompute r : {Recompute::None, Recompute::Moe, Recompute::Full}) {
      SCOPED_TRACE(fmt::format("{} {}", lp == DType::F32 ? "f32" : "bf16", recompute_name(r)));
      RankLayout l;
      l.state = trainer_state("adamw", lp == DType::F32 ? 0 : 2, 0);
      l.recompute = r;
      l.kept_backward_buffers = false;
      const double estimate = rank_memory(c, B, T, l).activations;
      EXPECT_EQ(estimate, static_cast<double>(activation_bytes_for(c, B, T, r, lp)));
      Transformer model(c);
      model.set_precision(lp);
      model.set_recompute(r);
      std::vector<float> params(static_cast<std::size_t>(model.layout().size()));
      init_params(params.data(), model.layout(), c, 7);
      std::vector<int32_t> in(B * T), tg(B * T);
      for (int64_t i = 0; i < B * T; ++i) in[i] = i % c.vocab_size, tg[i] = (i + 1) % c.vocab_size;
      model.forward(params.data(), in.data(), tg.data(), B, T, MoeStep{});
      const double held = static_cast<double>(model.activation_bytes());
      EXPECT_NEAR(estimate, held, 0.02 * held);
      // This trainer's estimate adds its layers' backward buffers and its workspace on top.
      l.kept_backward_buffers = true;
      EXPECT_GT(rank_memory(c, B, T, l).activations, estimate);
    }
  }
}

TEST(MemoryEstimate, AConfigThatCannotFitIsRefusedAtOnce) {
  TempDir tmp("memory_estimate");
  const std::string cfg = write_tiny_run(tmp.path(), 2, 0).string();
  for (const std::string& set :
       {std::string("model.n_layers=1000000"), std::string("model.dim=65536")}) {
    const auto start = std::chrono::steady_clock::now();
    ProcessResult r = run_moetrain(
        {"train", "-c", cfg, "--set", "train.run_dir=" + (tmp / "run").string(), "--set", set},
        {{"OMP_NUM_THREADS", "1"}}, 60);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_NE(r.code, 0) << set << "\n" << r.output();
    EXPECT_LT(s, 2.0) << set << "\n" << r.output();
    EXPECT_NE(r.output().find("needs about"), std::string::npos) << r.output();
    EXPECT_NE(r.output().find(" available ("), std::string::npos) << r.output();
  }
  ProcessResult ok =
      run_moetrain({"train", "-c", cfg, "--set", "train.run_dir=" + (tmp / "ok").string()},
                   {{"OMP_NUM_THREADS", "1"}}, 60);
  EXPECT_EQ(ok.code, 0) << ok.output();
}

// forward, eval and sample on a Hugging Face directory whose config.json describes a model far
// beyond this machine: refused within moments naming the config's size fields, instead of
// allocating for seconds and dying of std::bad_alloc.
TEST(MemoryEstimate, LoadingAModelThatCannotFitIsRefusedNamingItsSize) {
  TempDir tmp("memory_load");
  namespace fs = std::filesystem;
  const fs::path dir = tmp / "huge";
  fs::create_directories(dir);
  const nlohmann::json config = {
      {"architectures", {"MixtralForCausalLM"}}, {"model_type", "mixtral"},
      {"hidden_act", "silu"}, {"hidden_size", 1024}, {"intermediate_size", 4096},
      {"max_position_embeddings", 128}, {"num_attention_heads", 8},
      {"num_experts_per_tok", 2}, {"num_hidden_layers", 4}, {"num_key_value_heads", 8},
      {"num_local_experts", 4194304}, {"rms_norm_eps", 1e-6}, {"rope_theta", 10000.0},
      {"tie_word_embeddings", false}, {"vocab_size", 256}};
  std::ofstream(dir / "config.json") << config.dump();
  const float one = 1;
  SafetensorsWriter w;
  w.add("model.norm.weight", SafetensorsDType::F32, {1}, &one);
  w.write(dir / "model.safetensors");
  const std::vector<std::vector<std::string>> commands = {
      {"sample", "--checkpoint", dir.string(), "--prompt", "a"},
      {"eval", "--checkpoint", dir.string()},
      {"forward", "--checkpoint", dir.string(), "--input", "a", "--out",
       (tmp / "out.safetensors").string()}};
  for (const auto& args : commands) {
    const auto start = std::chrono::steady_clock::now();
    ProcessResult r = run_moetrain(args, {{"OMP_NUM_THREADS", "1"}}, 60);
    const double s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_NE(r.code, 0) << args[0] << "\n" << r.output();
    EXPECT_LT(s, 5.0) << args[0] << "\n" << r.output();
    for (const char* needle : {"loading", "needs about", "config.json describes a model this large",
                               "num_local_experts = 4194304"})
      EXPECT_NE(r.output().find(needle), std::string::npos) << args[0] << ": " << r.output();
    EXPECT_EQ(r.output().find("bad_alloc"), std::string::npos) << r.output();
  }
}

}  // namespace
}  // namespace moetrain::testing
