// The planner's layout models: pipeline stages and their bubble, and processes sharing this
// machine's cores (oversubscription). Pure arithmetic on hand-made inputs.
#include <gtest/gtest.h>

#include "plan/cluster.h"
#include "plan/cost_model.h"
#include "model/activation_bytes.h"
#include "plan/grad_model.h"
#include "train/memory_estimate.h"
#include "support/expect_error.h"
#include "support/plan_clusters.h"
#include "support/temp_dir.h"

using namespace moetrain;
using namespace moetrain::plan;

namespace {

RunConfig run(int64_t grad_accum) {
  RunConfig cfg;
  cfg.model.vocab_size = 256;
  cfg.model.dim = 512;
  cfg.model.n_layers = 8;
  cfg.model.n_heads = 8;
  cfg.model.n_kv_heads = 4;
  cfg.model.expert_hidden = 1024;
  cfg.model.n_experts = 8;
  cfg.model.top_k = 2;
  cfg.model.max_seq_len = 512;
  cfg.train.batch_size = 2;
  cfg.train.seq_len = 512;
  cfg.train.grad_accum = grad_accum;
  cfg.train.precision = Precision::BF16;
  return cfg;
}


// One micro-batch of a stage: what the bubble is counted in.
double stage_microbatch(const Prediction& p, int64_t A) {
  const StepParts& s = p.parts;
  return (s.compute() - s.optimizer - s.lm_head + s.a2a_exposed + s.tensor_parallel) /
         static_cast<double>(A);
}

}  // namespace

TEST(PlanLayout, PipelineBubbleIsPMinusOneOverVMicroBatches) {
  const ClusterSpec c = moetrain::testing::h100_nodes(2);
  const RunConfig cfg = run(8);
  const LoadModel load = uniform_load(8);
  const Prediction flat = predict(cfg, c, {.procs = 16, .ep = 8}, load);
  const Prediction pp4 = predict(cfg, c, {.procs = 16, .ep = 4, .pp = 4}, load);
  const Prediction vp2 = predict(cfg, c, {.procs = 16, .ep = 4, .pp = 4, .vp = 2}, load);
  EXPECT_EQ(flat.parts.pipeline_bubble, 0);
  // (p − 1)/vp micro-batch times, and the sends on the schedule's path: at least the fill's and
  // the drain's (2(p − 1)), at most a round trip for each of the stage's backward passes too
  // (1F1B's steady state has no slack). A send is one micro-batch's bf16 activations
  // (2 × 512 tokens × 512) to the next stage.
  const double send = pp4.comm.pipeline_send.seconds();
  ASSERT_EQ(pp4.comm.pipeline_send.phases.size(), 1u);
  EXPECT_EQ(pp4.comm.pipeline_send.phases[0].bytes, 2.0 * 512 * 512 * 2);
  EXPECT_GT(send, 0);
  const double mb4 = stage_microbatch(pp4, 8), mb2 = stage_microbatch(vp2, 8);
  EXPECT_GE(pp4.parts.pipeline_bubble, 3.0 * mb4 + 2 * 3 * send - 1e-12);
  EXPECT_LE(pp4.parts.pipeline_bubble, 3.0 * mb4 + 2 * (8 + 3) * send + 1e-12);
  EXPECT_GE(vp2.parts.pipeline_bubble, 1.5 * mb2 + 2 * 3 * send - 1e-12);
  EXPECT_LE(vp2.parts.pipeline_bubble, 1.5 * mb2 + 2 * (16 + 7) * send + 1e-12);
  EXPECT_EQ(pp4.comm.pipe_schedule, "1f1b");
  EXPECT_EQ(vp2.comm.pipe_schedule, "interleaved");
  // A stage holds a quarter of the layers: its dense parameters are a quarter (the embedding
  // and LM head included, spread as the rest), its attention a quarter of the time.
  EXPECT_NEAR(pp4.parts.attention * 4, flat.parts.attention, flat.parts.attention * 1e-9);
  EXPECT_LT(pp4.memory.params, flat.memory.params / 2);
  // Every stage replica runs the whole model: 16 / 4 = 4 replicas of 8 micro-batches.
  EXPECT_NEAR(pp4.tokens_per_s * pp4.step_time_s, 4.0 * 8 * 2 * 512, 1e-6);
}

// The schedule the trainer's pipeline code runs, timed: zero_bubble idles least, GPipe holds
// every micro-batch's activations, 1F1B pp of them (zero_bubble too, with its deferred output
// gradients); too few micro-batches are refused by key.
TEST(PlanLayout, PipelineSchedulesTheirBubbleAndActivations) {
  const ClusterSpec c = moetrain::testing::h100_nodes(2);
  const RunConfig cfg = run(8);
  const LoadModel load = uniform_load(8);
  auto with = [&](PipeSchedule s, int64_t vp = 1) {
    return predict(cfg, c, {.procs = 16, .ep = 4, .pp = 4, .vp = vp, .schedule = s}, load);
  };
  const Prediction gpipe = with(PipeSchedule::GPipe), one = with(PipeSchedule::OneFOneB);
  const Prediction inter = with(PipeSchedule::Interleaved, 2), zb = with(PipeSchedule::ZeroBubble);
  EXPECT_LT(zb.parts.pipeline_bubble, inter.parts.pipeline_bubble);
  EXPECT_LT(inter.parts.pipeline_bubble, one.parts.pipeline_bubble);
  EXPECT_LT(zb.step_time_s, one.step_time_s);
  // The bubble of ZB-H1 with equal passes is a third of 1F1B's, sends aside.
  EXPECT_NEAR(zb.parts.pipeline_bubble / one.parts.pipeline_bubble, 1.0 / 3, 0.05);
  EXPECT_EQ(zb.comm.pipe_schedule, "zero_bubble");
  EXPECT_GT(gpipe.memory.activations, 1.5 * one.memory.activations);
  // zero_bubble holds 1F1B's micro-batches and, between each backward and its weight pass, the
  // deferred weight GEMMs' output gradients.
  EXPECT_GT(zb.memory.activations, one.memory.activations);
  // 1F1B needs a micro-batch per stage; GPipe does not.
  moetrain::testing::expect_error(
      [&] { predict(run(2), c, {.procs = 16, .ep = 4, .pp = 4}, load); },
      {"train.grad_accum = 2", "4 pipeline stages", "1f1b"});
  EXPECT_GT(predict(run(2), c, {.procs = 16, .ep = 4, .pp = 4, .schedule = PipeSchedule::GPipe},
                    load)
                .parts.pipeline_bubble,
            0);
}

TEST(PlanLayout, TensorParallelShardsAttentionAndPaysItsAllReduces) {
  const ClusterSpec c = moetrain::testing::h100_nodes(1);
  const RunConfig cfg = run(1);
  const LoadModel load = uniform_load(8);
  const Prediction tp1 = predict(cfg, c, {.procs = 8, .ep = 8}, load);
  const Prediction tp2 = predict(cfg, c, {.procs = 8, .ep = 4, .tp = 2}, load);
  EXPECT_EQ(tp1.parts.tensor_parallel, 0);
  EXPECT_GT(tp2.parts.tensor_parallel, 0);
  EXPECT_LT(tp2.parts.attention, tp1.parts.attention);
  EXPECT_LT(tp2.memory.activations, tp1.memory.activations);
}

// On a CPU (a device with threads) the planner prices tensor parallelism as this trainer runs it
// (docs/tensor-parallel.md), not as Megatron does: whole dense weights on each rank, their
// gradients reduced over every rank of the stage; an f32 all-reduce after the attention and
// its input gradient's, and the MoE layer's all-gathers of its output and input gradient (one
// all-reduce's traffic) where the residual stream is whole; the head's input gradient once a
// micro-batch; every rank sending the whole activations between stages. By hand on 8 MoE layers.
TEST(PlanLayout, TensorParallelOnACpuIsThisTrainers) {
  ClusterSpec cpu = moetrain::testing::h100_nodes(1);
  cpu.device.threads = 1;
  const ClusterSpec gpu = moetrain::testing::h100_nodes(1);
  RunConfig cfg = run(1);
  cfg.train.precision = Precision::F32;
  const LoadModel load = uniform_load(8);
  const Layout tp2{.procs = 4, .ep = 2, .tp = 2};
  const Prediction ours = predict(cfg, cpu, tp2, load);
  const Prediction megatron = predict(cfg, gpu, tp2, load);
  const double N = 2 * 512, C = 512;
  const double dense = count_params(cfg.model).dense;
  // 3 collectives a MoE layer, 8 layers, and the head's.
  EXPECT_DOUBLE_EQ(ours.comm.tp_count, 3.0 * 8 + 1);
  EXPECT_DOUBLE_EQ(megatron.comm.tp_count, 2.0 * 8 + 1);
  ASSERT_EQ(ours.comm.tensor_parallel.phases.size(), 1u);
  EXPECT_DOUBLE_EQ(ours.comm.tensor_parallel.seconds(),
                   ring_allreduce(cpu, N * C * 4, 2, false).seconds());
  EXPECT_NEAR(ours.parts.tensor_parallel, 25 * ours.comm.tensor_parallel.seconds(), 1e-15);
  // Whole dense gradients over all 4 ranks (Megatron: half of them over the 2 data-parallel
  // ranks); each expert's over its 2 replicas either way.
  ASSERT_EQ(ours.comm.reductions.size(), 2u);
  EXPECT_EQ(ours.comm.reductions[0].first, "dense gradients over 4 ranks");
  EXPECT_EQ(megatron.comm.reductions[0].first, "dense gradients over 2 ranks");
  EXPECT_DOUBLE_EQ(ours.comm.reductions[0].second.seconds(),
                   ring_allreduce(cpu, dense * 4, 4, false).seconds());
  EXPECT_EQ(ours.comm.reductions[1].first, megatron.comm.reductions[1].first);
  // Expert tensor parallelism keeps whole experts too: each rank's experts' gradients over all
  // their holders, both ETP positions (Megatron: a shard over its one replica here).
  const Layout etp2{.procs = 4, .ep = 2, .etp = 2};
  const Prediction e = predict(cfg, cpu, etp2, load);
  ASSERT_EQ(e.comm.reductions.size(), 2u);
  EXPECT_EQ(e.comm.reductions[1].first, "expert gradients over 2 ranks");
  EXPECT_DOUBLE_EQ(e.comm.reductions[1].second.seconds(),
                   ring_allreduce(cpu, count_params(cfg.model).expert / 2 * 4, 2, false).seconds());
  EXPECT_EQ(predict(cfg, gpu, etp2, load).comm.reductions[1].first,
            "expert gradients over 1 rank");
  // Sequence parallelism: the MoE layers' tokens are the rank's stream, no collective of theirs.
  cfg.dist.sequence_parallel = true;
  EXPECT_DOUBLE_EQ(predict(cfg, cpu, tp2, load).comm.tp_count, 2.0 * 8 + 1);
  EXPECT_LT(predict(cfg, cpu, tp2, load).parts.norms, ours.parts.norms);
  // Between stages each rank sends the whole micro-batch (Megatron: its sequence share).
  cfg.dist.sequence_parallel = false;
  cfg.train.grad_accum = 2;
  const Layout pp2{.procs = 4, .ep = 1, .tp = 2, .pp = 2};
  ASSERT_EQ(predict(cfg, cpu, pp2, load).comm.pipeline_send.phases.size(), 1u);
  EXPECT_DOUBLE_EQ(predict(cfg, cpu, pp2, load).comm.pipeline_send.phases[0].bytes, N * C * 4);
  EXPECT_DOUBLE_EQ(predict(cfg, gpu, pp2, load).comm.pipeline_send.phases[0].bytes, N * C * 4 / 2);
}

// The experts fold EP over a stage's TP × DP ranks (Megatron-Core's parallel folding): EP 8 over
// TP 2 × DP 4 is a layout, and each tensor shard routes, dispatches and sends its own N / tp
// tokens, so the MoE block is not counted once per shard.
TEST(PlanLayout, ExpertParallelismFoldsOverTensorAndDataParallelRanks) {
  const ClusterSpec c = moetrain::testing::h100_nodes(1);
  const RunConfig cfg = run(1);
  const LoadModel load = uniform_load(8);
  const Layout folded{.procs = 8, .ep = 8, .tp = 2};
  EXPECT_EQ(layout_problem(cfg, c, folded), "");
  EXPECT_EQ(folded.dp(), 1);
  const Prediction tp1 = predict(cfg, c, {.procs = 8, .ep = 8}, load);
  const Prediction tp2 = predict(cfg, c, folded, load);
  // Half the tokens a rank: half the all-to-all bytes, the router's and the dispatch's work.
  EXPECT_DOUBLE_EQ(tp2.comm.a2a_send_bytes, tp1.comm.a2a_send_bytes / 2);
  EXPECT_LT(tp2.parts.router, tp1.parts.router);
  EXPECT_LT(tp2.parts.experts, tp1.parts.experts);
  // MoE layers pay attention's two TP collectives, not four; the LM head one.
  EXPECT_DOUBLE_EQ(tp2.comm.tp_count, 2.0 * 8 + 1);
  // EP must still divide the stage's ranks.
  EXPECT_NE(layout_problem(cfg, c, {.procs = 8, .ep = 8, .tp = 2, .pp = 2}), "");
}

// Expert tensor parallelism folds EP × ETP over the stage's ranks: EP 4 × ETP 2 on 8 devices
// splits each expert's hidden size over 2 ranks. By hand, at a uniform load: the 8 ranks' tokens
// (1024 each, top-2) over 8 experts give each expert 2048 rows, each ETP rank computes its
// 2 experts' 4096 rows (2 × 1024 × 2) over half the columns; it all-gathers those rows and
// reduce-scatters their outputs forward, the gradients backward (2 pairs a layer, bf16), and the
// exchange brings it half of them.
TEST(PlanLayout, ExpertTensorParallelSplitsEachExpertAndGathersItsRows) {
  const ClusterSpec c = moetrain::testing::h100_nodes(1);
  const RunConfig cfg = run(1);
  const LoadModel load = uniform_load(8);
  const Layout etp2{.procs = 8, .ep = 4, .etp = 2};
  ASSERT_EQ(layout_problem(cfg, c, etp2), "");
  EXPECT_EQ(etp2.dp(), 1);
  const Prediction p = predict(cfg, c, etp2, load);
  // Each rank owns half of each of its 2 experts: an eighth of the experts' parameters, as EP 8.
  EXPECT_DOUBLE_EQ(local_params(cfg.model, rank_layout(cfg, etp2, true)).expert,
                   count_params(cfg.model).expert / 8);
  EXPECT_DOUBLE_EQ(local_params(cfg.model, rank_layout(cfg, etp2, true)).expert,
                   local_params(cfg.model, rank_layout(cfg, {.procs = 8, .ep = 4}, true)).expert / 2);
  const double rows = 2.0 * 1024 * 2, bytes = rows * 512 * 2;
  EXPECT_DOUBLE_EQ(p.comm.etp_count, 2.0 * 8);
  EXPECT_DOUBLE_EQ(p.comm.expert_tensor_parallel_bytes, bytes);
  const Collective pair = ring_allreduce(c, bytes, 2, false);
  EXPECT_DOUBLE_EQ(p.comm.expert_tensor_parallel.seconds(), pair.seconds());
  EXPECT_NEAR(p.parts.tensor_parallel, 16 * pair.seconds(), 1e-12);  // TP 1: no other term
  // A rank sends its own tokens' rows to the 3 other EP ranks of its ETP position, and receives
  // as much: half its experts' rows.
  EXPECT_DOUBLE_EQ(p.comm.a2a_hot_recv_bytes, p.comm.a2a_send_bytes);
  EXPECT_DOUBLE_EQ(p.comm.a2a_send_bytes,
                   predict(cfg, c, {.procs = 8, .ep = 4}, load).comm.a2a_send_bytes);
  // Memory: half the expert state of EP 4 alone, and the gathered rows kept for backward.
  const Memory half = memory_per_device(cfg, etp2, true);
  const Memory whole = memory_per_device(cfg, {.procs = 8, .ep = 4}, true);
  EXPECT_LT(half.params, whole.params);
  EXPECT_GT(half.activations, whole.activations);
  // The trainer runs expert tensor parallelism in f32 only: this bf16 config is refused by name.
  EXPECT_FALSE(trainer_runs(cfg, etp2));
  EXPECT_NE(planner_only(cfg, etp2).find("dist.etp = 2 with train.precision = bf16"),
            std::string::npos)
      << planner_only(cfg, etp2);
  // Refused by name: EP × ETP not dividing the stage's ranks, ETP not dividing the experts'
  // hidden size (1024), ETP without experts.
  EXPECT_NE(layout_problem(cfg, c, {.procs = 8, .ep = 8, .etp = 2}).find("--etp 2"),
            std::string::npos);
  EXPECT_NE(layout_problem(cfg, c, {.procs = 6, .ep = 2, .etp = 3}).find("model.expert_hidden"),
            std::string::npos);
  RunConfig dense = cfg;
  dense.model.first_dense_layers = 8;
  EXPECT_NE(layout_problem(dense, c, {.procs = 2, .ep = 1, .etp = 2}).find("no MoE layer"),
            std::string::npos);
}

// A pipeline layout is checked with the step's micro-batches: 1F1B needs at least pp of them,
// interleaved a multiple of pp; the message names train.grad_accum, and a prediction refuses it.
TEST(PlanLayout, PipelineShapeIsPartOfTheLayoutCheck) {
  const ClusterSpec c = moetrain::testing::h100_nodes(1);
  RunConfig cfg = run(1);
  cfg.train.grad_accum = 2;
  const Layout four{.procs = 4, .ep = 1, .pp = 4};
  EXPECT_NE(layout_problem(cfg, c, four).find("train.grad_accum"), std::string::npos)
      << layout_problem(cfg, c, four);
  EXPECT_THROW(predict(cfg, c, four, uniform_load(8)), Error);
  cfg.train.grad_accum = 4;
  EXPECT_EQ(layout_problem(cfg, c, four), "");
  const Layout interleaved{.procs = 4, .ep = 1, .pp = 4, .vp = 2};
  cfg.train.grad_accum = 6;
  EXPECT_NE(layout_problem(cfg, c, interleaved).find("train.grad_accum"), std::string::npos);
  cfg.train.grad_accum = 8;
  EXPECT_EQ(layout_problem(cfg, c, interleaved), "");
}

// Megatron-Core's account_for_embedding/loss_in_pipeline_split (--pp-account): the embedding
// and the loss each take a block's place, so 6 blocks + 2 units cut into 4 stages of 2 units (the
// first and last stages one block each beside the embedding and the head, the middle two); the
// stage that paces the pipeline is the last where the head costs more than a block (a large
// vocabulary), a middle one where it costs less.
TEST(PlanLayout, PipelineUnitsTakeABlocksPlaceInTheSplit) {
  const ClusterSpec c = moetrain::testing::h100_nodes(1);
  RunConfig cfg = run(8);
  cfg.model.n_layers = 6;
  const LoadModel load = uniform_load(8);
  Layout pp4{.procs = 4, .ep = 1, .pp = 4};
  EXPECT_NE(layout_problem(cfg, c, pp4).find("model.n_layers = 6 must be divisible"),
            std::string::npos)
      << layout_problem(cfg, c, pp4);
  parse_pp_account(pp4, "loss");
  EXPECT_NE(layout_problem(cfg, c, pp4).find("the 1 unit of --pp-account (7)"), std::string::npos)
      << layout_problem(cfg, c, pp4);
  parse_pp_account(pp4, "embedding,loss");
  EXPECT_EQ(pp_account_name(pp4), "embedding,loss");
  EXPECT_EQ(layout_problem(cfg, c, pp4), "");
  Layout flat{.procs = 4, .ep = 1};
  parse_pp_account(flat, "embedding");
  EXPECT_NE(layout_problem(cfg, c, flat).find("only with --pp > 1"), std::string::npos);
  moetrain::testing::expect_error([&] { parse_pp_account(flat, "embedding,head"); },
                                  "'head' is not a unit; allowed are embedding, loss");
  flat = {.procs = 1, .ep = 1};
  // Small vocabulary (256): a block outweighs the head, so a middle stage of 2 blocks paces and
  // the head is off the critical path.
  const Prediction one = predict(cfg, c, flat, load);
  const Prediction small = predict(cfg, c, pp4, load);
  EXPECT_NEAR(small.parts.attention, one.parts.attention * 2 / 6, one.parts.attention * 1e-12);
  EXPECT_EQ(small.parts.lm_head, 0);
  // A vocabulary of 256k: the last stage's block and the head pace.
  cfg.model.vocab_size = 262144;
  const Prediction one_v = predict(cfg, c, flat, load);
  const Prediction large = predict(cfg, c, pp4, load);
  EXPECT_NEAR(large.parts.attention, one_v.parts.attention * 1 / 6, one_v.parts.attention * 1e-12);
  EXPECT_NEAR(large.parts.lm_head, one_v.parts.lm_head, one_v.parts.lm_head * 1e-12);
  EXPECT_GT(large.parts.lm_head, large.parts.attention + large.parts.experts);
}

// Megatron-Core's first and last stage block counts: the other stages share the rest evenly; the
// slowest stage paces (a middle one where the first and last hold fewer blocks and the head is
// small, the last where the head is large).
TEST(PlanLayout, UnevenPipelineSplitSetsTheFirstAndLastStagesBlocks) {
  const ClusterSpec c = moetrain::testing::h100_nodes(1);
  RunConfig cfg = run(8);
  cfg.model.n_layers = 7;
  const LoadModel load = uniform_load(8);
  Layout pp3{.procs = 3, .ep = 1, .pp = 3};
  EXPECT_NE(layout_problem(cfg, c, pp3).find("model.n_layers = 7 must be divisible"),
            std::string::npos);
  pp3.pp_first_layers = 2;
  pp3.pp_last_layers = 2;
  EXPECT_EQ(layout_problem(cfg, c, pp3), "");
  EXPECT_EQ(pp_split_name(pp3, 7), "2/3/2");
  EXPECT_NE(planner_only(cfg, pp3).find("uneven pipeline split"), std::string::npos);
  pp3.pp_last_layers = 0;  // the last shares the rest with the middle: 5 over 2 stages
  EXPECT_NE(layout_problem(cfg, c, pp3).find("the other 5 of model.n_layers = 7 must be shared "
                                             "evenly by the other 2 stages of --pp 3"),
            std::string::npos)
      << layout_problem(cfg, c, pp3);
  pp3.pp_first_layers = 1;  // 6 over 2: 1/3/3
  EXPECT_EQ(layout_problem(cfg, c, pp3), "");
  EXPECT_EQ(pp_split_name(pp3, 7), "1/3/3");
  Layout with_vp = pp3;
  with_vp.vp = 2;
  EXPECT_NE(layout_problem(cfg, c, with_vp).find("need --pp > 1, --vp 1 and no --pp-account"),
            std::string::npos);
  Layout with_units = pp3;
  parse_pp_account(with_units, "loss");
  EXPECT_NE(layout_problem(cfg, c, with_units).find("--pp-account loss"), std::string::npos);

  pp3.pp_first_layers = pp3.pp_last_layers = 2;
  const Layout flat{.procs = 1, .ep = 1};
  // Small vocabulary: a middle stage of 3 blocks paces, the head off the critical path.
  const Prediction one = predict(cfg, c, flat, load);
  const Prediction split = predict(cfg, c, pp3, load);
  EXPECT_EQ(split.pp_split, "2/3/2");
  EXPECT_NEAR(split.parts.attention, one.parts.attention * 3 / 7, one.parts.attention * 1e-12);
  EXPECT_EQ(split.parts.lm_head, 0);
  // A vocabulary of 256k: the last stage's 2 blocks and the head.
  cfg.model.vocab_size = 262144;
  const Prediction one_v = predict(cfg, c, flat, load);
  const Prediction large = predict(cfg, c, pp3, load);
  EXPECT_NEAR(large.parts.attention, one_v.parts.attention * 2 / 7, one_v.parts.attention * 1e-12);
  EXPECT_NEAR(large.parts.lm_head, one_v.parts.lm_head, one_v.parts.lm_head * 1e-12);
}

// Selective mla_up_proj recomputation: latent attention's per-head q, k and v are not kept (their
// bytes by hand), the up-projections' forwards run again; refused for a model without latent
// attention.
TEST(PlanLayout, MlaUpProjRecomputationDropsThePerHeadTensors) {
  const ClusterSpec c = moetrain::testing::h100_nodes(1);
  RunConfig cfg = run(8);
  Layout l{.procs = 1, .ep = 1};
  l.recompute_modules = parse_recompute_modules("mla_up_proj");
  EXPECT_EQ(recompute_modules_name(l.recompute_modules), "mla_up_proj");
  EXPECT_NE(layout_problem(cfg, c, l).find("no multi-head latent attention"), std::string::npos);
  cfg.model.q_lora_rank = 192;
  cfg.model.kv_lora_rank = 128;
  cfg.model.qk_rope_head_dim = 32;
  cfg.model.qk_nope_head_dim = 64;
  cfg.model.v_head_dim = 64;
  EXPECT_EQ(layout_problem(cfg, c, l), "");
  const int64_t N = cfg.train.batch_size * cfg.train.seq_len, L = cfg.model.n_layers;
  const ActivationBytes all = activation_parts(cfg.model, 2, 512, Recompute::None, DType::BF16);
  const ActivationBytes kept = activation_parts(cfg.model, 2, 512, Recompute::None, DType::BF16,
                                                1, l.recompute_modules);
  // q and k of 96, v of 64 a head, 8 heads, f32 in the count.
  EXPECT_EQ(all.blocks - kept.blocks, L * 4 * N * 8 * (96 + 96 + 64));
  EXPECT_EQ(all.once, kept.once);
  const Layout plain{.procs = 1, .ep = 1};
  const Prediction keep = predict(cfg, c, plain, uniform_load(8));
  const Prediction recompute = predict(cfg, c, l, uniform_load(8));
  EXPECT_GT(recompute.parts.attention, keep.parts.attention);
  EXPECT_LT(recompute.memory.activations, keep.memory.activations);
}

// The trainer runs gpipe, 1f1b, interleaved (virtual stages) and zero_bubble pipelines with
// expert parallelism and ZeRO-1 or 2 inside the stages, and tensor parallelism with any ZeRO
// stage and offload (in stages: ZeRO ≤ 1, the state in memory); what it refuses, the planner
// says in the trainer's words (its validation).
// tests/plan/trainer_runs_test.cpp checks every layout of a grid against load_run_config.
TEST(PlanLayout, TheTrainersLayoutsAreNamed) {
  const RunConfig cfg = run(4);
  auto refused = [&](const Layout& l) {
    const std::string why = planner_only(cfg, l);
    EXPECT_EQ(why.rfind("planner only: ", 0), 0u) << why;
    return why;
  };
  Layout l{.procs = 4, .ep = 1, .pp = 2};
  EXPECT_TRUE(trainer_runs(cfg, l)) << planner_only(cfg, l);
  l.schedule = PipeSchedule::GPipe;
  l.ep = 2;
  EXPECT_TRUE(trainer_runs(cfg, l)) << planner_only(cfg, l);
  l.zero = 2;
  EXPECT_TRUE(trainer_runs(cfg, l)) << planner_only(cfg, l);
  l.zero = 3;
  EXPECT_TRUE(trainer_runs(cfg, l)) << planner_only(cfg, l);
  l = {.procs = 4, .ep = 2, .pp = 2, .vp = 2};
  l.zero = 2;
  EXPECT_TRUE(trainer_runs(cfg, l)) << planner_only(cfg, l);
  l = {.procs = 4, .ep = 1, .pp = 2};
  l.schedule = PipeSchedule::ZeroBubble;
  l.recompute = Recompute::Moe;
  EXPECT_TRUE(trainer_runs(cfg, l)) << planner_only(cfg, l);
  l.recompute = Recompute::Full;
  EXPECT_NE(refused(l).find("dist.pp_schedule = zero_bubble and train.recompute = full"),
            std::string::npos);
  // Tensor parallelism: without stages, with expert parallelism folded over TP × DP and ZeRO-1.
  l = {.procs = 4, .ep = 4, .tp = 2};
  l.zero = 1;
  EXPECT_TRUE(trainer_runs(cfg, l)) << planner_only(cfg, l);
  l.recompute = Recompute::Full;
  EXPECT_TRUE(trainer_runs(cfg, l)) << planner_only(cfg, l);
  l.zero = 2;
  EXPECT_TRUE(trainer_runs(cfg, l)) << planner_only(cfg, l);
  l.zero = 3;
  EXPECT_TRUE(trainer_runs(cfg, l)) << planner_only(cfg, l);
  l.zero = 1;
  l.offload = true;
  EXPECT_TRUE(trainer_runs(cfg, l)) << planner_only(cfg, l);
  // Pipeline stages of tensor-parallel groups run.
  l = {.procs = 4, .ep = 1, .tp = 2, .pp = 2};
  EXPECT_TRUE(trainer_runs(cfg, l)) << planner_only(cfg, l);
  // The configuration's own keys meet the trainer's checks too: fp16 runs under tensor
  // parallelism, expert replication does not.
  RunConfig fp16 = cfg;
  fp16.train.precision = Precision::FP16;
  const Layout tp2{.procs = 2, .ep = 1, .tp = 2};
  EXPECT_TRUE(trainer_runs(fp16, tp2)) << planner_only(fp16, tp2);
  RunConfig spare = cfg;
  spare.placement.spare_slots = 1;
  const Layout tp2_ep4{.procs = 4, .ep = 4, .tp = 2};
  EXPECT_NE(planner_only(spare, tp2_ep4).find("dist.tp = 2 with placement.spare_slots"),
            std::string::npos)
      << planner_only(spare, tp2_ep4);
}

TEST(PlanLayout, OversubscribedProcessesGetTheirShareOfTheCores) {
  moetrain::testing::TempDir tmp("plan_layout");
  DeviceModel all;
  all.peak_flops_f32 = 40e9;
  all.memory_bytes = 8e9;
  all.memory_bandwidth = 20e9;
  all.threads = 2;
  all.gemm_f32_dims = {32, 1024};
  all.gemm_f32_flops = {10e9, 40e9};
  DeviceModel one = all;
  one.threads = 1;
  one.peak_flops_f32 = 18e9;
  one.memory_bandwidth = 9e9;
  one.gemm_f32_flops = {4e9, 18e9};
  const std::string profile = (tmp.path() / "profile.toml").string();
  save_profile(all, one, 5e9, 3e-6, {}, profile);
  // One process, its two threads: the all-thread figures.
  EXPECT_DOUBLE_EQ(local_cluster(profile, 1, 2).device.peak_flops_f32, 40e9);
  // Two processes of one thread each: one-thread figures.
  EXPECT_DOUBLE_EQ(local_cluster(profile, 2, 1).device.peak_flops_f32, 18e9);
  // Two processes of two threads on two cores: no faster than one thread each.
  EXPECT_DOUBLE_EQ(local_cluster(profile, 2, 2).device.peak_flops_f32, 18e9);
  // Four one-thread processes on two cores: half a core each.
  const ClusterSpec four = local_cluster(profile, 4, 1);
  EXPECT_DOUBLE_EQ(four.device.peak_flops_f32, 9e9);
  EXPECT_DOUBLE_EQ(four.device.gemm_f32_flops.back(), 9e9);
  EXPECT_DOUBLE_EQ(four.device.memory_bandwidth, 4.5e9);
  // Pipeline stages on shared cores: four processes of two stages on two cores, every part timed
  // at the all-busy share; a waiting stage's cores go to the other stage's two processes, which
  // fill them, so no bubble is added. Two processes (one a stage) on two cores do not share:
  // a waiting stage's core idles, the bubble counts.
  RunConfig cfg = run(2);
  cfg.train.precision = Precision::F32;
  const LoadModel load = uniform_load(8);
  EXPECT_EQ(four.shared_cores, 2);
  EXPECT_EQ(predict(cfg, four, {.procs = 4, .ep = 1, .pp = 2}, load).parts.pipeline_bubble, 0);
  EXPECT_GT(predict(cfg, local_cluster(profile, 2, 1), {.procs = 2, .ep = 1, .pp = 2}, load)
                .parts.pipeline_bubble,
            0);
}
