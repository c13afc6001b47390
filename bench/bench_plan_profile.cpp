// Where one training step of a config goes, phase by phase (core/profile.h), next to what the
// planner predicts for it (plan/cost_model.h) from a profile of this machine, given the timed
// steps' routing: the tool for finding which of the planner's parts are under- or
// over-predicted. One process, the config's model, batch and precision; random tokens; forward,
// backward, clip and the optimizer step, as the trainer's step runs them (no collectives, no data
// loader, no metrics).
//
//   bench_plan_profile -c configs/tiny.toml --set train.batch_size=8 [--threads 2]
//                      [--steps 5] [--profile profile.toml]
#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/profile.h"
#include "core/rng.h"
#include "core/threads.h"
#include "core/timer.h"
#include "model/params.h"
#include "model/transformer.h"
#include "optim/clip.h"
#include "optim/optimizer.h"
#include "optim/param_groups.h"
#include "plan/cost_model.h"
#include "plan/load_model.h"
#include "train/run_config.h"

using namespace moetrain;

int main(int argc, char** argv) {
  std::string config, profile_path;
  std::vector<std::string> sets;
  int threads = 0, steps = 5;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "-c" || a == "--config") config = next();
    else if (a == "--set") sets.push_back(next());
    else if (a == "--threads") threads = std::stoi(next());
    else if (a == "--steps") steps = std::stoi(next());
    else if (a == "--profile") profile_path = next();
    else {
      std::fprintf(stderr, "unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  const RunConfig cfg = load_run_config(config, sets);
  const int nt = init_threads(threads);
  const int64_t B = cfg.train.batch_size, T = cfg.train.seq_len;
  Transformer model(cfg.model);
  model.set_precision(cfg.train.precision_dtype());
  const ParamLayout& layout = model.layout();
  std::vector<float> params(layout.size()), grads(layout.size());
  init_params(params.data(), layout, cfg.model, 1);
  const auto groups = param_groups(layout);
  auto opt = make_optimizer(cfg.optim.optimizer_config(), groups, 0, layout.size());
  std::vector<int32_t> in(B * T), tg(B * T);
  Rng rng(5, 5);
  for (size_t i = 0; i < in.size(); ++i)
    in[i] = static_cast<int32_t>(rng.below(2 * i, cfg.model.vocab_size)),
    tg[i] = static_cast<int32_t>(rng.below(2 * i + 1, cfg.model.vocab_size));
  MoeStep ms;
  auto step = [&] {
    {
      PhaseScope zero(Phase::GradZero);
      std::fill(grads.begin(), grads.end(), 0.0f);
    }
    model.forward(params.data(), in.data(), tg.data(), B, T, ms);
    model.backward(params.data(), grads.data(), 1.0f);
    {
      PhaseScope o(Phase::Optimizer);
      clip_grad_norm(grads.data(), static_cast<int64_t>(grads.size()), 1.0);
    }
    opt->step(params.data(), grads.data(), 1e-4f);
    model.weights_changed();
    ++ms.step;
  };
  step();
  step();
  std::vector<double> times;
  // The routing of the timed steps, as the planner's measured load (each step its own).
  std::vector<std::vector<std::vector<double>>> routed;
  profile::start();
  for (int s = 0; s < steps; ++s) {
    Timer t;
    step();
    times.push_back(t.seconds());
    auto& layers = routed.emplace_back();
    for (const MoeLayer* moe : model.moe_layers()) {
      const auto& counts = moe->stats().tokens_per_expert;
      layers.emplace_back(counts.begin(), counts.end());
    }
  }
  const PhaseTable table = profile::stop();
  double total = 0;
  for (double t : times) total += t;
  std::sort(times.begin(), times.end());
  std::printf("%s, batch %lld, %d threads: %.2f ms per step (mean of %d), median %.2f\n",
              config.c_str(), static_cast<long long>(B), nt, total / steps * 1e3, steps,
              times[times.size() / 2] * 1e3);
  std::printf("  %-26s %9s %10s\n", "phase", "ms/step", "calls/step");
  double in_phases = 0;
  for (int i = 0; i < static_cast<int>(Phase::kCount); ++i) {
    in_phases += table[i].seconds;
    if (table[i].calls == 0) continue;
    std::printf("  %-26s %9.2f %10.1f\n", std::string(phase_name(Phase(i))).c_str(),
                table[i].seconds / steps * 1e3, static_cast<double>(table[i].calls) / steps);
  }
  std::printf("  %-26s %9.2f\n", "(outside)", (total - in_phases) / steps * 1e3);
  if (!profile_path.empty()) {
    const plan::ClusterSpec cluster = plan::local_cluster(profile_path, 1, nt);
    const plan::LoadModel load = cfg.model.n_moe_layers() > 0
                                     ? plan::measured_load(routed, "the timed steps")
                                     : plan::uniform_load(cfg.model.n_experts);
    const plan::Prediction p = plan::predict(cfg, cluster, {1, 1, 1, 1, 1}, load);
    std::printf("planner (%s load): %.2f ms per step\n", load.kind.c_str(), p.step_time_s * 1e3);
    const nlohmann::json parts = plan::to_json(p)["parts"];
    for (const auto& [k, v] : parts.items())
      if (v.is_number() && v.get<double>() != 0)
        std::printf("  %-24s %9.2f\n", k.c_str(), v.get<double>() * 1e3);
  }
  return 0;
}
