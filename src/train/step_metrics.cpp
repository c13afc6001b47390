#include "train/step_metrics.h"

#include <algorithm>
#include <cmath>

namespace moetrain {

double imbalance(const std::vector<int64_t>& load) {
  if (load.empty()) return 1.0;
  int64_t mx = 0, sum = 0;
  for (int64_t v : load) mx = std::max(mx, v), sum += v;
  return sum > 0
             ? static_cast<double>(mx) * static_cast<double>(load.size()) / static_cast<double>(sum)
             : 1.0;
}

double load_entropy(const std::vector<int64_t>& load) {
  int64_t sum = 0;
  for (int64_t v : load) sum += v;
  if (load.size() < 2 || sum == 0) return 0.0;
  double h = 0;
  for (int64_t v : load) {
    if (v == 0) continue;
    const double p = static_cast<double>(v) / static_cast<double>(sum);
    h -= p * std::log(p);
  }
  return h / std::log(static_cast<double>(load.size()));
}

std::vector<int64_t> rank_loads(const std::vector<int64_t>& load, int64_t ranks) {
  const int64_t E = static_cast<int64_t>(load.size());
  std::vector<int64_t> out(static_cast<std::size_t>(std::max<int64_t>(ranks, 1)), 0);
  for (std::size_t q = 0; q < out.size(); ++q)
    for (int64_t e = chunk_begin(E, static_cast<int>(q), static_cast<int>(out.size()));
         e < chunk_begin(E, static_cast<int>(q) + 1, static_cast<int>(out.size())); ++e)
      out[q] += load[e];
  return out;
}

double capacity_utilisation(const Accumulated& acc, std::size_t m) {
  const int64_t slots = acc.capacity_slots[m];
  return slots > 0 ? static_cast<double>(acc.computed[m]) / static_cast<double>(slots) : 1.0;
}

void reduce_step_figures(Comm& comm, Accumulated& acc, int replicas) {
  const int W = replicas > 0 ? replicas : comm.size();
  LossParts& sum = acc.loss;
  double parts[4] = {sum.ce, sum.aux, sum.z, sum.total};
  comm.allreduce(parts, 4);
  sum.ce = parts[0] / W, sum.aux = parts[1] / W, sum.z = parts[2] / W, sum.total = parts[3] / W;
  // A requested stop rides on this reduction, so that every process stops after the same step.
  const StopVotes here = StopVotes::local();
  int64_t counts[4] = {sum.targets, acc.correct, here.interrupt, here.terminate};
  comm.allreduce(counts, 4);
  sum.targets = counts[0], acc.correct = counts[1];
  acc.stop = {counts[2], counts[3]};
  std::vector<int64_t> flat;
  for (const auto& l : acc.tokens_per_expert) flat.insert(flat.end(), l.begin(), l.end());
  comm.allreduce(flat.data(), static_cast<int64_t>(flat.size()));
  std::size_t at = 0;
  for (auto& l : acc.tokens_per_expert)
    for (int64_t& v : l) v = flat[at++];
  comm.allreduce(acc.dropped.data(), static_cast<int64_t>(acc.dropped.size()));
  std::vector<int64_t> used(acc.capacity_slots);
  used.insert(used.end(), acc.computed.begin(), acc.computed.end());
  comm.allreduce(used.data(), static_cast<int64_t>(used.size()));
  const std::size_t L = acc.capacity_slots.size();
  std::copy_n(used.begin(), L, acc.capacity_slots.begin());
  std::copy_n(used.begin() + static_cast<std::ptrdiff_t>(L), L, acc.computed.begin());
}

nlohmann::json step_metrics_line(const StepFigures& f) {
  const Accumulated& acc = *f.acc;
  const LossParts& sum = acc.loss;
  nlohmann::json line = {{"step", f.step},          {"loss", sum.total}, {"ce", sum.ce},
                         {"aux", sum.aux},          {"z", sum.z},        {"lr", f.lr},
                         {"grad_norm", f.grad_norm}};
  if (f.fp16) {
    line["loss_scale"] = f.update->loss_scale;
    line["skipped"] = f.update->skipped;
  }
  if (f.accuracy_rows > 0)
    line["accuracy"] = static_cast<double>(acc.correct) / static_cast<double>(f.accuracy_rows);
  line["tokens_per_expert"] = acc.tokens_per_expert;
  line["dropped_fraction"] = acc.dropped;
  double imb = 0;
  for (const auto& l : acc.tokens_per_expert) imb += imbalance(l);
  const std::size_t layers = acc.tokens_per_expert.size();
  line["imbalance"] = layers == 0 ? 1.0 : imb / static_cast<double>(layers);
  std::vector<double> entropy, rank_imb, util;
  for (std::size_t m = 0; m < layers; ++m) {
    entropy.push_back(load_entropy(acc.tokens_per_expert[m]));
    rank_imb.push_back(imbalance(rank_loads(acc.tokens_per_expert[m], f.ep)));
    util.push_back(capacity_utilisation(acc, m));
  }
  line["load_entropy"] = entropy;
  line["rank_max_mean_load"] = rank_imb;
  line["capacity_factor"] = acc.capacity_factor;
  line["capacity_utilisation"] = util;
  return line;
}

double grad_accum_efficiency(double computations, double discarded) {
  return computations > 0 ? std::clamp(1.0 - discarded / computations, 0.0, 1.0) : 1.0;
}

CommFigures comm_figures(const CommParts& p) {
  CommFigures f;
  f.total_s = std::max(0.0, p.thread_s) + std::max(0.0, p.inline_s);
  f.exposed_s = std::clamp(p.blocked_s, 0.0, f.total_s);
  f.compute_s = std::max(0.0, p.step_s - f.exposed_s);
  const double busy = f.compute_s + f.exposed_s;
  f.comm_efficiency = busy > 0 ? f.compute_s / busy : 1.0;
  f.overlap_ratio = f.total_s > 0 ? 1.0 - f.exposed_s / f.total_s : 1.0;
  f.grad_accum_efficiency = grad_accum_efficiency(p.grad_computations, p.grad_discarded);
  return f;
}

void add_comm_metrics(const CommParts& p, nlohmann::json& line) {
  const CommFigures f = comm_figures(p);
  line["comm_total_s"] = f.total_s;
  line["comm_exposed_s"] = f.exposed_s;
  line["compute_s"] = f.compute_s;
  line["bytes_a2a"] = p.bytes_a2a;
  line["bytes_grad"] = p.bytes_grad;
  line["comm_efficiency"] = f.comm_efficiency;
  line["overlap_ratio"] = f.overlap_ratio;
  line["grad_accum_efficiency"] = f.grad_accum_efficiency;
}

}  // namespace moetrain
