// Sparse expert gradients (grad.sparse_experts) inside pipeline stages: 16 experts, top-1,
// 2 micro-batches a step and grad.min_accum_fraction = 1, so an expert is updated only if tokens
// reached it in both micro-batches and most experts freeze in most steps.
//
// Each stage masks its own MoE layers, agreeing over its copies (the processes that route tokens
// through them), and the metrics sum the stages' figures over the pipe. Bitwise where the code
// path is the same: a stage's mask of a layer is computed from the same integer counts as the
// run without stages (micro-batch a's tokens of each expert, summed over the processes that
// routed them), so the same experts freeze; their gradients are zeroed and AdamW steps around
// them, as there. Each stage runs its blocks' forward and backward as the whole model does, every
// schedule accumulates a chunk's gradients in ascending micro-batch order, the copies' gradients
// sum as the ranks' without stages do (two terms, one order), and AdamW is elementwise: with the
// clip off, the parameters and the checkpointed tensors (moments included) have the bits of the
// run without stages, the frozen counts and the masked share are integer sums, and an expert
// that run never updated keeps its initial bits.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "parallel/runtime.h"
#include "support/checkpoint_tensors.h"
#include "support/corpus.h"
#include "support/held_values.h"
#include "support/run_metrics.h"
#include "support/shared_dir.h"
#include "parallel/pipeline_runs.h"  // tests/parallel/pipeline_runs.h
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kSteps = 4;
const std::string kLast = "checkpoints/step_00000004";

// pp = 1: a run without stages. vp > 1: the interleaved schedule.
RunConfig make_config(const fs::path& data, const fs::path& run, int64_t pp,
                      const std::string& schedule, std::vector<std::string> extra = {}) {
  std::vector<std::string> keys = {"model.dim=32",
                                   "model.n_layers=4",
                                   "model.n_heads=4",
                                   "model.n_kv_heads=2",
                                   "model.expert_hidden=24",
                                   "model.n_experts=16",
                                   "model.top_k=1",
                                   "model.dense_every=3",
                                   "model.max_seq_len=8",
                                   "train.batch_size=2",
                                   "train.seq_len=8",
                                   "train.steps=" + std::to_string(kSteps),
                                   "train.grad_accum=2",
                                   "train.eval_every=0",
                                   "train.eval_batches=1",
                                   "train.progress=off",
                                   "train.precision=f32",
                                   "optim.warmup_steps=2",
                                   "optim.grad_clip=0",
                                   "grad.sparse_experts=true",
                                   "grad.min_accum_fraction=1",
                                   "data.dir=" + data.string(),
                                   "train.run_dir=" + run.string(),
                                   "dist.pp=" + std::to_string(pp),
                                   "dist.pp_schedule=" + schedule,
                                   "dist.vp=" + std::string(schedule == "interleaved" ? "2" : "1")};
  if (std::none_of(extra.begin(), extra.end(),
                   [](const std::string& k) { return k.starts_with("dist.overlap="); }))
    keys.push_back("dist.overlap=false");
  keys.insert(keys.end(), extra.begin(), extra.end());
  return load_run_config("", keys);
}

// The values of the trainer's rank: all but other ranks' experts, within its stage's ranges.
std::vector<char> held_by(Trainer& t) {
  std::vector<char> held = held_values(t);
  const std::vector<char> stage = stage_values(t);
  for (std::size_t i = 0; i < held.size(); ++i) held[i] &= stage[i];
  return held;
}

// The values of expert tensors whose bits `final` kept from `initial` (experts never updated).
std::vector<char> never_updated(Trainer& t, const std::vector<float>& initial,
                                const std::vector<float>& final) {
  std::vector<char> out(initial.size(), 0);
  for (const ParamInfo& p : t.model().layout().params())
    if (p.expert >= 0 &&
        std::memcmp(&initial[p.offset], &final[p.offset], p.numel * sizeof(float)) == 0)
      std::fill_n(out.begin() + p.offset, p.numel, 1);
  return out;
}

struct Reference {
  std::vector<float> initial, final;
  std::vector<char> frozen;  // the values of experts never updated
};

void save(const fs::path& file, const std::vector<float>& v) {
  std::ofstream(file, std::ios::binary)
      .write(reinterpret_cast<const char*>(v.data()),
             static_cast<std::streamsize>(v.size() * sizeof(float)));
}

std::vector<float> load(const fs::path& file, std::size_t n) {
  std::vector<float> v(n);
  std::ifstream(file, std::ios::binary)
      .read(reinterpret_cast<char*>(v.data()), static_cast<std::streamsize>(n * sizeof(float)));
  return v;
}

// The pipeline run `run` against the run without stages in `ref_run` (`ref`: the parameters
// this rank's copy is compared to): parameters bitwise, never-updated experts at their
// initial bits; on rank 0 the frozen counts, the masked share and the checkpoint. Returns how
// many of this rank's values belong to experts the reference never updated.
int64_t expect_same(Trainer& t, const Reference& ref, const fs::path& run,
                    const fs::path& ref_run, int rank) {
  const std::vector<float> got(t.params().begin(), t.params().end());
  const std::vector<char> held = held_by(t);
  EXPECT_EQ(differ_held(got, ref.final, held), 0)
      << "stage parameters differ from the run without stages";
  std::vector<char> frozen_here(held.size(), 0);
  int64_t frozen_values = 0;
  for (std::size_t i = 0; i < held.size(); ++i)
    frozen_values += frozen_here[i] = held[i] && ref.frozen[i];
  EXPECT_EQ(differ_held(got, ref.initial, frozen_here), 0)
      << "an expert the run without stages never updated moved";
  if (rank != 0) return frozen_values;
  const std::vector<double> frozen = metric(run, "experts_frozen");
  EXPECT_EQ(frozen.size(), static_cast<std::size_t>(kSteps));
  EXPECT_EQ(frozen, metric(ref_run, "experts_frozen"));
  EXPECT_EQ(metric(run, "grad_accum_efficiency"), metric(ref_run, "grad_accum_efficiency"));
  EXPECT_TRUE(read_all_tensors(run / kLast) == read_all_tensors(ref_run / kLast))
      << "the pipeline's checkpoint differs from the run without stages'";
  return frozen_values;
}

// Some rank held an expert that stayed frozen throughout (collective over world).
void expect_some_frozen(Comm& world, int64_t values) {
  world.allreduce(&values, 1);
  EXPECT_GT(values, 0) << "no stage holds an expert that stayed frozen throughout";
}

}  // namespace

// One pipeline of two stages on 2 processes against one process, under every schedule.
TEST(PipelineSparse, StagesFollowTheOneProcessRunBitwise) {
  auto world = dist_world("pipeline_sparse");
  const int W = world->size(), r = world->rank();
  if (W != 2) GTEST_SKIP() << "needs 2 processes for one pipeline of 2 stages";
  SharedDir dir(*world, "pipeline_sparse");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  const fs::path single_run = dir / ("single" + std::to_string(r));
  Reference ref;
  {
    Trainer one(make_config(dir / "data", single_run, 1, "1f1b"), false, make_local_comm());
    ref.initial.assign(one.params().begin(), one.params().end());
    one.run();
    ref.final.assign(one.params().begin(), one.params().end());
    ref.frozen = never_updated(one, ref.initial, ref.final);
  }
  // The configuration freezes experts, some of them in every step.
  EXPECT_GT(std::count(ref.frozen.begin(), ref.frozen.end(), 1), 0);
  if (r == 0) {
    double frozen = 0;
    for (double f : metric(single_run, "experts_frozen")) frozen += f;
    EXPECT_GT(frozen, 0);
  }
  for (const std::string schedule : {"gpipe", "1f1b", "interleaved"}) {
    SCOPED_TRACE(schedule);
    const fs::path run = dir / schedule;
    Trainer t(make_config(dir / "data", run, 2, schedule), false,
              dist_world("pipeline_sparse_run"));
    t.run();
    expect_some_frozen(*world, expect_same(t, ref, run, single_run, r));
  }
  // The comparison sees the mask: the same pipeline without sparse expert gradients moves the
  // experts the one-process sparse run froze.
  const fs::path dense_run = dir / "dense";
  Trainer t(make_config(dir / "data", dense_run, 2, "1f1b", {"grad.sparse_experts=false",
                                                             "grad.min_accum_fraction=0"}),
            false, dist_world("pipeline_dense_run"));
  t.run();
  const std::vector<float> got(t.params().begin(), t.params().end());
  EXPECT_GT(differ_held(got, ref.final, held_by(t)), 0);
  if (r == 0) {
    EXPECT_TRUE(metric(dense_run, "experts_frozen").empty());
  }
}

// Two pipelines of two stages on 4 processes, each stage's two copies one expert-parallel group
// (dist.ep = 2) or two data-parallel ranks, against the run without stages on 2 processes with
// the same dist.ep: copy c of a stage reads what rank c reads there and holds its experts.
TEST(PipelineSparse, CopiesOfStagesFollowTheRunWithoutStagesBitwise) {
  auto world = dist_world("pipeline_sparse_copies");
  const int W = world->size(), r = world->rank();
  if (W != 4) GTEST_SKIP() << "needs 4 processes for 2 pipelines x 2 stages";
  SharedDir dir(*world, "pipeline_sparse_copies");
  if (r == 0) write_corpus(dir / "data", 40000);
  world->barrier();
  // The processes per machine are found once, collectively over every process: before a
  // trainer runs on half of them.
  dist_local_size();
  auto half = world->split(r / 2, r % 2, {"half"});
  for (const int64_t ep : {2, 1}) {
    SCOPED_TRACE("dist.ep = " + std::to_string(ep));
    const std::vector<std::string> keys = {"dist.ep=" + std::to_string(ep)};
    const std::string tag = "ep" + std::to_string(ep);
    const fs::path ref_run = dir / ("ref_" + tag);
    auto file = [&](const std::string& what, int64_t c) {
      return dir / (tag + "_" + what + std::to_string(c) + ".bin");
    };
    // The run without stages on ranks 0 and 1; each saves its parameters for the copies that
    // hold the same experts.
    if (r < 2) {
      Trainer t(make_config(dir / "data", ref_run, 1, "1f1b", keys), false,
                half->dup("ref_run"));
      const std::vector<float> initial(t.params().begin(), t.params().end());
      t.run();
      save(file("initial", r), initial);
      save(file("final", r), {t.params().begin(), t.params().end()});
    }
    world->barrier();
    // Overlap reduces the same buckets with the same calls on the communication thread during
    // the last backward, the mask agreed before it: the same sums.
    for (const std::string variant : {"1f1b", "interleaved", "1f1b_overlap"}) {
      SCOPED_TRACE(variant);
      const bool overlap = variant == "1f1b_overlap";
      if (overlap && ep == 1) continue;
      std::vector<std::string> run_keys = keys;
      if (overlap) run_keys.push_back("dist.overlap=true");
      const fs::path run = dir / (tag + "_" + variant);
      Trainer t(make_config(dir / "data", run, 2, overlap ? "1f1b" : variant, run_keys), false,
                dist_world("pipeline_sparse_copies_run"));
      t.run();
      const int64_t c = t.pipeline()->replica();
      Reference ref;
      ref.initial = load(file("initial", c), t.params().size());
      ref.final = load(file("final", c), t.params().size());
      ref.frozen = never_updated(t, ref.initial, ref.final);
      expect_some_frozen(*world, expect_same(t, ref, run, ref_run, r));
    }
  }
}
