#include "train/step_metrics.h"

#include <algorithm>

namespace moetrain {

double imbalance(const std::vector<int64_t>& load) {
  if (load.empty()) return 1.0;
  int64_t mx = 0, sum = 0;
  for (int64_t v : load) mx = std::max(mx, v), sum += v;
  return sum > 0
             ? static_cast<double>(mx) * static_cast<double>(load.size()) / static_cast<double>(sum)
             : 1.0;
}

void reduce_step_figures(Comm& comm, Accumulated& acc) {
  const int W = comm.size();
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
  line["grad_sync_bytes"] = f.grad_sync_bytes;
  line["tokens_per_expert"] = acc.tokens_per_expert;
  line["dropped_fraction"] = acc.dropped;
  double imb = 0;
  for (const auto& l : acc.tokens_per_expert) imb += imbalance(l);
  const std::size_t layers = acc.tokens_per_expert.size();
  line["imbalance"] = layers == 0 ? 1.0 : imb / static_cast<double>(layers);
  return line;
}

}  // namespace moetrain
