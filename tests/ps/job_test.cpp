// Parameter-server jobs as real processes on loopback: `moetrain ps launch` forks the scheduler,
// servers and workers of the built binary; they talk over real ZeroMQ sockets on ports the
// system picks, so parallel test runs do not collide.
#include <gtest/gtest.h>

#include <zmq.hpp>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "io/checkpoint.h"
#include "io/file.h"
#include "io/run_lock.h"
#include "model/params.h"
#include "optim/sparse_experts.h"
#include "optim/clip.h"
#include "io/metrics.h"
#include "io/report.h"
#include "ps/message.h"
#include "ps/process.h"  // tests/ps/process.h
#include "ps/security.h"
#include "ps/server_checkpoint.h"
#include "support/corpus.h"
#include "support/report_defaults.h"
#include "support/temp_dir.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

struct Job {
  int code = -1;
  std::string output;
};

Job launch(const TempDir& tmp, const std::vector<std::string>& ps_args, int steps, int batch,
           const std::string& run = "run", const std::vector<std::string>& sets = {}) {
  write_corpus(tmp / "data", 60000);
  std::vector<std::string> args = {"ps", "launch", "--timeout", "150"};
  args.insert(args.end(), ps_args.begin(), ps_args.end());
  args.insert(args.end(), {"--", "train"});
  for (const auto& s : as_set_args(tiny_ps_overrides(tmp / "data", tmp / run, steps, batch)))
    args.push_back(s);
  for (const auto& s : as_set_args(sets)) args.push_back(s);
  Process p(args, tmp / (run + ".log"));
  Job j;
  j.code = p.wait(180);
  j.output = p.output();
  return j;
}

std::map<int64_t, double> losses(const fs::path& run) {
  std::map<int64_t, double> out;
  for (const auto& j : read_metrics(run))
    if (j.contains("loss")) out[j["step"].get<int64_t>()] = j["loss"].get<double>();
  return out;
}

// The single-process run over the same global batch (`rows` a step: the workers' rows
// together) in tmp/ref, with the keys `extra` on top; its final parameters.
std::vector<float> reference_run(const TempDir& tmp, int steps, int rows,
                                 const std::vector<std::string>& extra = {}) {
  std::vector<std::string> sets = tiny_ps_overrides(tmp / "data", tmp / "ref", steps, rows);
  sets.insert(sets.end(), extra.begin(), extra.end());
  Trainer t(load_run_config("", sets), false);
  t.run();
  return t.params();
}

// Every step's loss of `run` within `rel` (relative) of the same step's in `ref`, which has
// `steps` of them.
void expect_losses_follow(const fs::path& run, const fs::path& ref, int steps, double rel) {
  auto a = losses(run), b = losses(ref);
  ASSERT_EQ(a.size(), static_cast<std::size_t>(steps)) << run;
  for (auto [step, loss] : b) {
    ASSERT_TRUE(a.count(step)) << run << " step " << step;
    EXPECT_LE(std::fabs(a[step] - loss), rel * std::fabs(loss)) << run << " step " << step;
  }
}

double final_val_loss(const fs::path& run) {
  double v = -1;
  for (const auto& j : read_metrics(run))
    if (j.contains("val_loss")) v = j["val_loss"].get<double>();
  return v;
}

// bf16 workers compute with bf16 copies of the weights they pulled, refreshed after every pull
// (a copy kept from the first step would train on stale weights): the sync job's losses follow
// the single-process bf16 run's. Not bitwise: the f32 parameters differ by the sums' order
// (about 1e-7 relative), which can move a weight's bf16 rounding by one step (2^-8 relative) now
// and then; 1e-3 of the loss bounds that, while stale weights would stay at the first step's loss
// (here 0.3 above the tenth step's).
TEST(PsJob, Bf16WorkersFollowTheSingleProcessRun) {
  TempDir tmp("ps_bf16");
  const int steps = 10, W = 2, B = 4;
  Job job = launch(tmp, {"--servers", "2", "--workers", "2"}, steps, B, "run",
                   {"train.precision=bf16"});
  ASSERT_EQ(job.code, 0) << job.output;
  reference_run(tmp, steps, W * B, {"train.precision=bf16"});
  expect_losses_follow(tmp / "run", tmp / "ref", steps, 1e-3);
}

// The sync job equals the single-process run over the same global batch.
TEST(PsJob, SyncEqualsSingleProcess) {
  TempDir tmp("ps_sync");
  const int steps = 20, W = 2, B = 4;
  Job job = launch(tmp, {"--servers", "2", "--workers", "2", "--consistency", "sync"}, steps, B);
  ASSERT_EQ(job.code, 0) << job.output;

  const std::vector<float> ref_params = reference_run(tmp, steps, W * B);
  expect_losses_follow(tmp / "run", tmp / "ref", steps, 1e-5);
  LoadedModel m = load_model(tmp / "run");
  EXPECT_EQ(m.step, steps);
  ASSERT_EQ(m.params.size(), ref_params.size());
  const double distance = relative_l2(m.params, ref_params);
  EXPECT_LE(distance, 1e-5);
  EXPECT_NE(job.output.find("pushes:"), std::string::npos) << job.output;
}

// With one server, whose range is the whole gradient, optim.grad_clip clips by the global norm
// as the single-process run does (a small threshold, so that most steps clip).
TEST(PsJob, OneServerClipsByTheGlobalNormLikeTheSingleProcessRun) {
  TempDir tmp("ps_clip");
  const int steps = 12, W = 2, B = 2;
  Job job = launch(tmp, {"--servers", "1", "--workers", "2"}, steps, B, "run",
                   {"optim.grad_clip=0.05"});
  ASSERT_EQ(job.code, 0) << job.output;
  reference_run(tmp, steps, W * B, {"optim.grad_clip=0.05"});
  int clipped = 0;
  for (const auto& j : read_metrics(tmp / "ref"))
    if (j.contains("grad_norm")) clipped += j["grad_norm"].get<double>() > 0.05;
  EXPECT_GE(clipped, steps / 2) << "the threshold should clip most steps";
  expect_losses_follow(tmp / "run", tmp / "ref", steps, 1e-5);
}

// With two servers the global norm is the scheduler's sum of the servers' partial sums of
// squares (ps/global_norm.h): the sync job clips every update by the factor the single-process
// run over the same global batch computes. The tolerances: the two runs add the same per-row
// gradients in another order (the pushes per server against the micro-batch accumulation, and
// the squares in other blocks), about 1e-7 relative per step, which the steps carry forward as
// SyncEqualsSingleProcess measures; 1e-5 relative bounds it for the losses, the parameters (L2)
// and the norms. The scale is max_norm / (norm + 1e-6), so its relative error is the norm's.
// A threshold no update reaches leaves the job's bits as they are without clipping.
TEST(PsJob, TwoServersClipByTheGlobalNormLikeTheSingleProcessRun) {
  TempDir tmp("ps_clip2");
  const int steps = 12, W = 2, B = 2;
  const double clip = 0.05;
  const std::vector<std::string> ps = {"--servers", "2", "--workers", "2", "--consistency",
                                       "sync"};
  Job job = launch(tmp, ps, steps, B, "run", {"optim.grad_clip=0.05"});
  ASSERT_EQ(job.code, 0) << job.output;
  const std::vector<float> ref_params = reference_run(tmp, steps, W * B, {"optim.grad_clip=0.05"});
  std::map<int64_t, double> ref_norm, norm, scale;
  for (const auto& j : read_metrics(tmp / "ref"))
    if (j.contains("grad_norm")) ref_norm[j["step"].get<int64_t>()] = j["grad_norm"].get<double>();
  for (const auto& j : read_metrics(tmp / "run"))
    if (j.contains("clip_scale")) {
      norm[j["step"].get<int64_t>()] = j["grad_norm"].get<double>();
      scale[j["step"].get<int64_t>()] = j["clip_scale"].get<double>();
    }
  ASSERT_EQ(scale.size(), static_cast<std::size_t>(steps));
  int clipped = 0;
  double worst_norm = 0;
  for (auto [step, n] : ref_norm) {
    ASSERT_TRUE(scale.count(step)) << "step " << step;
    clipped += n > clip;
    worst_norm = std::max(worst_norm, std::fabs(norm[step] - n) / n);
    EXPECT_LE(std::fabs(norm[step] - n), 1e-5 * n) << "step " << step;
    const double want = clip_coefficient(n, clip);
    EXPECT_LE(std::fabs(scale[step] - want), 1e-5 * want) << "step " << step;
  }
  EXPECT_GE(clipped, steps / 2) << "the threshold should clip most steps";
  expect_losses_follow(tmp / "run", tmp / "ref", steps, 1e-5);
  LoadedModel m = load_model(tmp / "run");
  ASSERT_EQ(m.params.size(), ref_params.size());
  EXPECT_LE(relative_l2(m.params, ref_params), 1e-5);
  std::printf("largest relative norm difference %.3g, parameters' relative L2 distance %.3g\n",
              worst_norm, relative_l2(m.params, ref_params));

  // Not binding: the same bits as the job without clipping.
  Job loose = launch(tmp, ps, steps, B, "loose", {"optim.grad_clip=1000"});
  ASSERT_EQ(loose.code, 0) << loose.output;
  Job off = launch(tmp, ps, steps, B, "off");
  ASSERT_EQ(off.code, 0) << off.output;
  for (const auto& j : read_metrics(tmp / "loose"))
    if (j.contains("clip_scale")) {
      EXPECT_EQ(j["clip_scale"].get<double>(), 1.0);
    }
  EXPECT_EQ(load_model(tmp / "loose").params, load_model(tmp / "off").params);
}

// Expert reweighting (grad_norm) and the clip over two servers: each sync update's per-expert
// figures, then its squared norm, are summed over the servers' ranges by the scheduler, and
// every server takes the factors and the scale with the trainers' code. Against the
// single-process run over the same global batch only the sums' order differs (as
// SyncEqualsSingleProcess: 1e-5 relative bounds the losses and the parameters' L2 distance).
TEST(PsJob, TwoServersReweightExpertsLikeTheSingleProcessRun) {
  TempDir tmp("ps_reweight");
  const int steps = 12, W = 2, B = 2;
  const std::vector<std::string> extra = {"grad.expert_reweight=grad_norm",
                                          "optim.grad_clip=0.05"};
  Job job = launch(tmp, {"--servers", "2", "--workers", "2"}, steps, B, "run", extra);
  ASSERT_EQ(job.code, 0) << job.output;
  const std::vector<float> ref_params = reference_run(tmp, steps, W * B, extra);
  expect_losses_follow(tmp / "run", tmp / "ref", steps, 1e-5);
  LoadedModel m = load_model(tmp / "run");
  ASSERT_EQ(m.params.size(), ref_params.size());
  EXPECT_LE(relative_l2(m.params, ref_params), 1e-5);
  std::printf("reweighted: parameters' relative L2 distance %.3g\n",
              relative_l2(m.params, ref_params));
  // Without the reweighting the run differs by far more than that bound: the test sees it.
  Job plain = launch(tmp, {"--servers", "2", "--workers", "2"}, steps, B, "plain",
                     {"optim.grad_clip=0.05"});
  ASSERT_EQ(plain.code, 0) << plain.output;
  const double unweighted = relative_l2(load_model(tmp / "plain").params, ref_params);
  EXPECT_GT(unweighted, 1e-4);
  std::printf("without the reweighting: parameters' relative L2 distance %.3g\n", unweighted);
}

// Each step's `key` (a number) from a run's metrics.jsonl.
std::map<int64_t, double> per_step(const fs::path& run, const char* key) {
  std::map<int64_t, double> out;
  for (const auto& j : read_metrics(run))
    if (j.contains(key) && j.contains("step")) out[j["step"].get<int64_t>()] = j[key].get<double>();
  return out;
}

// Sparse expert gradients in sync mode: each worker pushes the tokens each expert received in
// each of its micro-batches on the expert count keys; the server holding them (with two servers,
// the scheduler's sum of the servers' parts) gives every server the step's mask, and each zeroes
// its inactive experts' summed rows and steps its optimizer around them, as the trainers do.
// 16 experts, top-1, one 32-token row per worker and micro-batch, two micro-batches of which an
// expert must be reached in both (min_accum_fraction = 1): experts freeze at every step. Against
// the single-process run over the same global batch: the same number of frozen experts at every
// step (the same routing gives the same integer counts, exact in f32), the losses and the
// parameters' L2 distance within 1e-5 relative (only the sums' order differs, as in
// SyncEqualsSingleProcess), and every expert the reference never updated keeps bitwise its
// initial values in the ps runs too. Without the mask the job is more than 1e-4 away.
TEST(PsJob, SparseExpertsFreezeLikeTheSingleProcessRun) {
  TempDir tmp("ps_sparse");
  const int steps = 12, W = 2, B = 1;
  const std::vector<std::string> moe = {"model.n_experts=16", "model.top_k=1",
                                        "train.grad_accum=2"};
  std::vector<std::string> sparse = moe;
  sparse.insert(sparse.end(), {"grad.sparse_experts=true", "grad.min_accum_fraction=1"});
  for (const char* servers : {"1", "2"}) {
    Job job = launch(tmp, {"--servers", servers, "--workers", "2"}, steps, B,
                     std::string("run") + servers, sparse);
    ASSERT_EQ(job.code, 0) << job.output;
  }
  const std::vector<float> ref_params = reference_run(tmp, steps, W * B, sparse);
  const std::map<int64_t, double> ref_frozen = per_step(tmp / "ref", "experts_frozen");
  ASSERT_EQ(ref_frozen.size(), static_cast<std::size_t>(steps));
  double frozen = 0;
  for (auto [step, f] : ref_frozen) frozen += f;
  EXPECT_GT(frozen, 0) << "the configuration should freeze experts";

  std::vector<std::string> sets = tiny_ps_overrides(tmp / "data", tmp / "ref", steps, W * B);
  sets.insert(sets.end(), sparse.begin(), sparse.end());
  const RunConfig cfg = load_run_config("", sets);
  const ParamLayout layout(cfg.model);
  std::vector<float> init(static_cast<std::size_t>(layout.size()));
  init_params(init.data(), layout, cfg.model, cfg.train.seed);
  const std::vector<ExpertPiece> pieces = expert_pieces(layout);
  auto same = [](const std::vector<float>& a, const std::vector<float>& b, const ExpertPiece& p) {
    return std::equal(a.begin() + p.offset, a.begin() + p.offset + p.size, b.begin() + p.offset);
  };
  for (const char* run : {"run1", "run2"}) {
    expect_losses_follow(tmp / run, tmp / "ref", steps, 1e-5);
    EXPECT_EQ(per_step(tmp / run, "experts_frozen"), ref_frozen) << run;
    const std::vector<float> params = load_model(tmp / run).params;
    ASSERT_EQ(params.size(), ref_params.size());
    EXPECT_LE(relative_l2(params, ref_params), 1e-5) << run;
    int64_t never = 0;
    for (const ExpertPiece& p : pieces)
      if (same(ref_params, init, p)) {
        ++never;
        EXPECT_TRUE(same(params, init, p)) << run << ": expert key " << p.key;
      }
    std::printf("%s: %.0f experts frozen over %d steps, %lld expert tensors never updated, "
                "parameters' relative L2 distance %.3g\n",
                run, frozen, steps, static_cast<long long>(never),
                relative_l2(params, ref_params));
  }
  Job plain = launch(tmp, {"--servers", "2", "--workers", "2"}, steps, B, "plain", moe);
  ASSERT_EQ(plain.code, 0) << plain.output;
  const double unmasked = relative_l2(load_model(tmp / "plain").params, ref_params);
  EXPECT_GT(unmasked, 1e-4);
  std::printf("without the mask: parameters' relative L2 distance %.3g\n", unmasked);
}

// Utilisation reweighting in sync mode: the servers take each layer's loads from the clock's
// expert token counts (the count keys, shared as for sparse experts) and the factors with the
// trainers' utilisation_factors, before the clip round. Thresholds close to the mean load
// (0.9, 1.1) make most experts ×2 or ×0.5 and a small clip makes every factor count. Against
// the single-process run: the losses and the parameters' L2 distance within 1e-5 relative (the
// sums' order; the factors themselves come from integer loads and are the same); the job
// without the reweighting is more than 1e-4 away.
TEST(PsJob, UtilisationReweightsExpertsLikeTheSingleProcessRun) {
  TempDir tmp("ps_util");
  const int steps = 12, W = 2, B = 2;
  const std::vector<std::string> extra = {"grad.expert_reweight=utilisation", "grad.util_low=0.9",
                                          "grad.util_high=1.1", "optim.grad_clip=0.05"};
  for (const char* servers : {"1", "2"}) {
    Job job = launch(tmp, {"--servers", servers, "--workers", "2"}, steps, B,
                     std::string("run") + servers, extra);
    ASSERT_EQ(job.code, 0) << job.output;
  }
  const std::vector<float> ref_params = reference_run(tmp, steps, W * B, extra);
  for (const char* run : {"run1", "run2"}) {
    expect_losses_follow(tmp / run, tmp / "ref", steps, 1e-5);
    const std::vector<float> params = load_model(tmp / run).params;
    ASSERT_EQ(params.size(), ref_params.size());
    EXPECT_LE(relative_l2(params, ref_params), 1e-5) << run;
    std::printf("%s: utilisation-reweighted, parameters' relative L2 distance %.3g\n", run,
                relative_l2(params, ref_params));
  }
  Job plain = launch(tmp, {"--servers", "2", "--workers", "2"}, steps, B, "plain",
                     {"optim.grad_clip=0.05"});
  ASSERT_EQ(plain.code, 0) << plain.output;
  const double unweighted = relative_l2(load_model(tmp / "plain").params, ref_params);
  EXPECT_GT(unweighted, 1e-4);
  std::printf("without the reweighting: parameters' relative L2 distance %.3g\n", unweighted);
}

// Importance reweighting in sync mode: every server keeps the moving averages of each expert's
// mean |g| (the same on every server: they come from the reweight round's sums over every
// range) and takes the factors with the trainers' code. Against the single-process run: the
// losses and the parameters' L2 distance within 1e-5 relative (the sums' order); the job
// without the reweighting is more than 1e-4 away.
TEST(PsJob, ImportanceReweightsExpertsLikeTheSingleProcessRun) {
  TempDir tmp("ps_importance");
  const int steps = 12, W = 2, B = 2;
  const std::vector<std::string> extra = {"grad.expert_reweight=importance",
                                          "grad.reweight_decay=0.5", "optim.grad_clip=0.05"};
  for (const char* servers : {"1", "2"}) {
    Job job = launch(tmp, {"--servers", servers, "--workers", "2"}, steps, B,
                     std::string("run") + servers, extra);
    ASSERT_EQ(job.code, 0) << job.output;
  }
  const std::vector<float> ref_params = reference_run(tmp, steps, W * B, extra);
  for (const char* run : {"run1", "run2"}) {
    expect_losses_follow(tmp / run, tmp / "ref", steps, 1e-5);
    const std::vector<float> params = load_model(tmp / run).params;
    ASSERT_EQ(params.size(), ref_params.size());
    EXPECT_LE(relative_l2(params, ref_params), 1e-5) << run;
    std::printf("%s: importance-reweighted, parameters' relative L2 distance %.3g\n", run,
                relative_l2(params, ref_params));
  }
  Job plain = launch(tmp, {"--servers", "2", "--workers", "2"}, steps, B, "plain",
                     {"optim.grad_clip=0.05"});
  ASSERT_EQ(plain.code, 0) << plain.output;
  const double unweighted = relative_l2(load_model(tmp / "plain").params, ref_params);
  EXPECT_GT(unweighted, 1e-4);
  std::printf("without the reweighting: parameters' relative L2 distance %.3g\n", unweighted);
}

// The router biases of a checkpoint (sigmoid_bias: one E-vector per MoE layer, in the training
// state as the trainers write them).
std::vector<float> router_biases(const fs::path& run, int64_t step, const RunConfig& cfg) {
  const int64_t E = cfg.model.n_experts, L = cfg.model.n_layers;
  std::vector<float> out(static_cast<std::size_t>(L * E));
  CheckpointContents c;
  for (int64_t l = 0; l < L; ++l)
    c.state.push_back({fmt::format("model.layers.{}.block_sparse_moe.router_bias", l), {E},
                       out.data() + l * E});
  read_checkpoint(checkpoint_dir(run, step), c);
  return out;
}

// Aux-loss-free balancing in ps mode: each worker pushes its expert loads on the router bias keys,
// the server holding them sums a clock's loads and applies the trainers' bias rule (bias_update),
// and workers route with the biases they pull. Against the single-process run over the same global
// batch the losses agree as SyncEqualsSingleProcess's do (1e-5: the sums' order), and the biases
// are bitwise equal: the rule's inputs are integer token counts (exact in f32 sums) and its steps
// are ± the rate, so the same routing gives the same bits.
TEST(PsJob, RouterBiasesFollowTheSingleProcessRun) {
  TempDir tmp("ps_bias");
  const int steps = 12, W = 2, B = 2;
  const std::vector<std::string> bias = {"model.router=sigmoid_bias", "model.bias_update_rate=0.01"};
  // One server holds the biases with every parameter; with two, the last one holds them.
  for (const char* servers : {"1", "2"}) {
    Job job = launch(tmp, {"--servers", servers, "--workers", "2"}, steps, B,
                     std::string("run") + servers, bias);
    ASSERT_EQ(job.code, 0) << job.output;
  }
  reference_run(tmp, steps, W * B, bias);
  std::vector<std::string> sets = tiny_ps_overrides(tmp / "data", tmp / "ref", steps, W * B);
  sets.insert(sets.end(), bias.begin(), bias.end());
  const RunConfig ref = load_run_config("", sets);
  const std::vector<float> want = router_biases(tmp / "ref", steps, ref);
  for (const char* run : {"run1", "run2"}) {
    expect_losses_follow(tmp / run, tmp / "ref", steps, 1e-5);
    EXPECT_EQ(router_biases(tmp / run, steps, ref), want) << run;
  }
  EXPECT_NE(std::count(want.begin(), want.end(), 0.0f), static_cast<std::ptrdiff_t>(want.size()))
      << "the biases should have moved";
}

// Random bytes, truncated frames, a wrong version, a huge declared size, a multi-frame message:
// each is rejected, the server answers the next good request, and the job completes.
TEST(PsJob, ServerSurvivesBadMessages) {
  TempDir tmp("ps_bad");
  write_corpus(tmp / "data", 60000);
  std::vector<std::string> args = {"ps",         "launch", "--timeout", "150",
                                   "--servers",  "1",      "--workers", "1",
                                   "--slowdown", "0=3",    "--",        "train"};
  for (const auto& s : as_set_args(tiny_ps_overrides(tmp / "data", tmp / "run", 200, 2)))
    args.push_back(s);
  Process job(args, tmp / "launch.log");
  ASSERT_TRUE(wait_for_file(tmp / "run" / "ps" / "job.json", 60)) << job.output();
  const std::string server = read_json(tmp / "run" / "ps" / "job.json")["servers"][0]["endpoint"];

  zmq::context_t ctx;
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  // A member of the job (it holds the job key) gone wrong: the bytes reach the server.
  const ps::JobKeys keys = ps::read_job_keys(tmp / "run" / "ps" / "keys");
  s.set(zmq::sockopt::curve_serverkey, keys.public_key);
  s.set(zmq::sockopt::curve_publickey, keys.public_key);
  s.set(zmq::sockopt::curve_secretkey, keys.secret_key);
  s.connect(server);
  ps::Header pull;
  pull.kind = static_cast<uint16_t>(ps::Kind::Pull);
  pull.sender = 77;
  pull.clock = -1;
  pull.ticket = 5;
  const std::string good = ps::encode(pull, {});
  std::string junk(500, '\0');
  for (std::size_t i = 0; i < junk.size(); ++i) junk[i] = static_cast<char>(i * 131 + 7);
  std::string wrong_version = good;
  wrong_version[4] = 9;
  std::string huge = good;
  const uint64_t big = uint64_t{1} << 40;
  std::memcpy(huge.data() + 72, &big, 8);
  for (const std::string& bad :
       {junk, good.substr(0, 40), good.substr(0, good.size() - 1) + "", wrong_version, huge}) {
    s.send(zmq::buffer(bad), zmq::send_flags::none);
  }
  s.send(zmq::buffer(good), zmq::send_flags::sndmore);
  s.send(zmq::buffer(good), zmq::send_flags::none);  // two frames: refused as a whole
  s.send(zmq::buffer(good), zmq::send_flags::none);

  zmq::pollitem_t item{s.handle(), 0, ZMQ_POLLIN, 0};
  ASSERT_GT(zmq::poll(&item, 1, std::chrono::milliseconds(20000)), 0) << "no reply";
  zmq::message_t reply;
  ASSERT_TRUE(s.recv(reply));
  ps::Decoded d = ps::decode(reply.data(), reply.size());
  EXPECT_EQ(d.header.kind_enum(), ps::Kind::PullReply);
  EXPECT_EQ(d.header.ticket, 5);
  EXPECT_EQ(d.header.bytes, static_cast<uint64_t>(4 * (d.header.key_end - d.header.key_begin)));

  ASSERT_EQ(job.wait(150), 0) << job.output();
  auto summary = read_json(tmp / "run" / "ps" / "server_0.json");
  EXPECT_GE(summary["rejected_messages"].get<int64_t>(), 6) << summary.dump();
  EXPECT_EQ(summary["updates"].get<int64_t>(), 200);
}

// Quorum and async: tests/ps/bounds_test.cpp.

TEST(PsJob, SspBoundsStalenessAndBlocksTheFastWorker) {
  TempDir tmp("ps_ssp");
  const int s_bound = 1;
  Job job = launch(tmp,
                   {"--servers", "1", "--workers", "2", "--consistency", "ssp", "--staleness",
                    std::to_string(s_bound), "--slowdown", "1=4"},
                   30, 2);
  ASSERT_EQ(job.code, 0) << job.output;
  auto s = read_json(tmp / "run" / "ps" / "server_0.json");
  EXPECT_LE(s["max_staleness"].get<int64_t>(), s_bound);
  EXPECT_GE(s["max_staleness"].get<int64_t>(), 1) << "the slowed worker never fell behind";
  EXPECT_GT(s["blocked_pulls"].value("0", int64_t{0}), 10) << s.dump();
  EXPECT_EQ(s["updates"].get<int64_t>(), 60);
}

// Each process of the job writes its own metrics file; `moetrain report` merges them.
TEST(PsJob, PerProcessMetricsFiles) {
  TempDir tmp("ps_metrics");
  const int steps = 10, S = 2, W = 2;
  Job job = launch(tmp, {"--servers", std::to_string(S), "--workers", std::to_string(W)}, steps, 2);
  ASSERT_EQ(job.code, 0) << job.output;
  const auto roles = read_role_metrics(tmp / "run");
  for (int w = 0; w < W; ++w) {
    const std::string role = "worker_" + std::to_string(w);
    ASSERT_TRUE(roles.contains(role)) << role;
    const auto& lines = roles.at(role);
    EXPECT_EQ(lines.size(), static_cast<std::size_t>(steps)) << role;
    for (const auto& j : lines) {
      EXPECT_GT(j.at("rows_per_s").get<double>(), 0) << j.dump();
      EXPECT_EQ(j.at("staleness").get<int64_t>(), 0) << "sync pushes are never stale";
    }
  }
  for (int s = 0; s < S; ++s) {
    const std::string role = "server_" + std::to_string(s);
    ASSERT_TRUE(roles.contains(role)) << role;
    const auto& lines = roles.at(role);
    const int64_t updates =
        read_json(tmp / "run" / "ps" / (role + ".json")).at("updates").get<int64_t>();
    EXPECT_EQ(updates, steps);
    ASSERT_EQ(lines.size(), static_cast<std::size_t>(updates)) << role;
    EXPECT_EQ(lines.back().at("updates").get<int64_t>(), updates);
    EXPECT_GT(lines.back().at("updates_per_s").get<double>(), 0);
  }
  ASSERT_TRUE(roles.contains("scheduler"));
  std::vector<std::string> events;
  for (const auto& j : roles.at("scheduler")) events.push_back(j.at("event").get<std::string>());
  EXPECT_EQ(events, (std::vector<std::string>{"job_start", "job_complete"}));
  const std::string html = render_report(tmp / "run", report_defaults());
  for (const char* id : {"workers", "servers", "events"})
    EXPECT_NE(html.find(std::string("<section id=\"") + id + "\""), std::string::npos) << id;
}

// int8 pushes with error feedback: a quarter of the dense bytes, and training still converges
// like the uncompressed run.
TEST(PsJob, Int8PushesAreSmallAndTrain) {
  TempDir tmp("ps_int8");
  Job dense = launch(tmp, {"--servers", "1", "--workers", "2"}, 30, 4, "dense");
  ASSERT_EQ(dense.code, 0) << dense.output;
  Job q = launch(tmp, {"--servers", "1", "--workers", "2", "--push-compression", "int8"}, 30, 4,
                 "int8");
  ASSERT_EQ(q.code, 0) << q.output;
  auto w = read_json(tmp / "int8" / "ps" / "server_0.json");
  EXPECT_LT(w["push_bytes"].get<double>(), 0.3 * w["dense_push_bytes"].get<double>());
  EXPECT_NEAR(final_val_loss(tmp / "int8"), final_val_loss(tmp / "dense"), 0.1);
}

TEST(PsJob, BadOptionsStopBeforeStarting) {
  TempDir tmp("ps_opts");
  Job a = launch(tmp, {"--consistency", "eventual"}, 5, 2);
  EXPECT_NE(a.code, 0);
  EXPECT_NE(a.output.find("--consistency 'eventual'"), std::string::npos) << a.output;
  Job b = launch(tmp, {"--workers", "2"}, 5, 2, "clip");
  EXPECT_EQ(b.code, 0) << b.output;  // the defaults are fine
  write_corpus(tmp / "data", 60000);
  Process c({"ps", "launch", "--servers", "2", "--consistency", "async", "--", "train", "--set",
             "optim.grad_clip=1", "--set", "train.run_dir=" + (tmp / "c").string()},
            tmp / "c.log");
  EXPECT_NE(c.wait(60), 0);
  EXPECT_NE(c.output().find("optim.grad_clip = 1 with --servers 2 and --consistency async"),
            std::string::npos)
      << c.output();
  // A setting a worker would ignore, given as --set, is refused as its flag form is.
  Process e({"ps", "launch", "--", "train", "--set", "optim.grad_clip=0", "--set", "dist.ep=2",
             "--set", "train.run_dir=" + (tmp / "e").string()},
            tmp / "e.log");
  EXPECT_NE(e.wait(60), 0);
  EXPECT_NE(e.output().find("dist.ep = 2: parameter-server mode"), std::string::npos) << e.output();
  EXPECT_FALSE(fs::exists(tmp / "e")) << "something was written";
  // A spare needs a backup to become or a checkpoint to restore from.
  Job d = launch(tmp, {"--spare-servers", "1", "--checkpoint-every", "0"}, 5, 2, "spare");
  EXPECT_NE(d.code, 0);
  EXPECT_NE(d.output.find("--spare-servers 1"), std::string::npos) << d.output;
  EXPECT_FALSE(fs::exists(tmp / "spare" / "ps" / "launch.json")) << "something was started";
}

// The run directory is the scheduler's for the job's life: a directory another run is writing,
// or one holding an earlier run without --resume, is refused before anything in it is written.
TEST(PsJob, RunDirectoryIsLockedAndAnEarlierRunNeedsResume) {
  TempDir tmp("ps_lock");
  Job first = launch(tmp, {}, 4, 2, "run", {"train.progress=lines"});
  ASSERT_EQ(first.code, 0) << first.output;
  // The job's progress, as `train` shows it: the first and the last step at least.
  EXPECT_NE(first.output.find("step 1/4 loss "), std::string::npos) << first.output;
  EXPECT_NE(first.output.find("step 4/4 loss "), std::string::npos) << first.output;
  const std::string metrics = read_file_bytes(tmp / "run" / "metrics.jsonl");
  Job again = launch(tmp, {}, 6, 2);
  EXPECT_NE(again.code, 0);
  EXPECT_NE(again.output.find("already holds a run's checkpoints: pass --resume"),
            std::string::npos)
      << again.output;
  EXPECT_EQ(read_file_bytes(tmp / "run" / "metrics.jsonl"), metrics);
  EXPECT_FALSE(fs::exists(tmp / "run" / "checkpoints" / "step_6"));

  fs::create_directories(tmp / "busy");
  {
    const RunLock held(tmp / "busy");  // as a running `train` holds it
    Job busy = launch(tmp, {}, 4, 2, "busy");
    EXPECT_NE(busy.code, 0);
    EXPECT_NE(busy.output.find("is in use by pid"), std::string::npos) << busy.output;
    for (const auto& e : fs::directory_iterator(tmp / "busy"))
      EXPECT_EQ(e.path().filename(), ".lock") << "written into a locked directory";
  }

  // --resume continues the finished run from the servers' final checkpoint to more steps.
  Job more = launch(tmp, {"--resume"}, 6, 2);
  ASSERT_EQ(more.code, 0) << more.output;
  const auto l = losses(tmp / "run");
  ASSERT_EQ(l.size(), 6u) << read_file_bytes(tmp / "run" / "metrics.jsonl");
  EXPECT_EQ(l.begin()->first, 1);
  EXPECT_EQ(load_model(tmp / "run").step, 6);
}

// SIGTERM to `ps launch`: the workers finish their clock, every server checkpoints the same
// clock, exit 143; `ps launch --resume` then ends exactly where an uninterrupted job ends.
TEST(PsJob, SigtermStopsWithACheckpointAndResumeEndsLikeAnUninterruptedJob) {
  TempDir tmp("ps_stop");
  const int steps = 40;
  const std::vector<std::string> opts = {"--servers", "2", "--workers", "2", "--slowdown", "0=4"};
  Job whole = launch(tmp, opts, steps, 2, "whole");
  ASSERT_EQ(whole.code, 0) << whole.output;

  std::vector<std::string> args = {"ps", "launch", "--timeout", "150"};
  args.insert(args.end(), opts.begin(), opts.end());
  args.insert(args.end(), {"--", "train"});
  for (const auto& s : as_set_args(tiny_ps_overrides(tmp / "data", tmp / "run", steps, 2)))
    args.push_back(s);
  {
    Process p(args, tmp / "stopped.log");
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (losses(tmp / "run").size() < 8 && p.running() &&
           std::chrono::steady_clock::now() < end)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ASSERT_TRUE(p.running()) << p.output();
    p.kill(SIGTERM);
    ASSERT_EQ(p.wait(120), 143) << p.output();
    EXPECT_NE(p.output().find("--resume"), std::string::npos) << p.output();
  }
  const auto stopped = losses(tmp / "run");
  const int64_t at = stopped.rbegin()->first;
  ASSERT_LT(at, steps);
  for (int s = 0; s < 2; ++s)
    EXPECT_TRUE(fs::exists(ps::server_checkpoint_path(tmp / "run", s, at)))
        << "server " << s << " has no checkpoint of clock " << at;

  args.insert(args.begin() + 2, "--resume");
  Process r(args, tmp / "resumed.log");
  ASSERT_EQ(r.wait(150), 0) << r.output();
  const auto a = losses(tmp / "run"), b = losses(tmp / "whole");
  ASSERT_EQ(a.size(), static_cast<std::size_t>(steps));
  for (auto [step, loss] : b) EXPECT_EQ(a.at(step), loss) << "step " << step;
  LoadedModel x = load_model(tmp / "run"), y = load_model(tmp / "whole");
  EXPECT_EQ(x.step, steps);
  EXPECT_EQ(x.params, y.params);
}

}  // namespace
