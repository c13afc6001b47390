#include "train/memory_estimate.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include "core/check.h"

namespace moetrain {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::string gib(double bytes) {
  return fmt::format("{:.2f} GiB", bytes / kGiB);
}

// Per parameter: itself, its gradient, two moments (AdamW); plus its low-precision copy.
MemoryEstimate from_counts(double params, double activation_floats, int precision_bytes) {
  MemoryEstimate e = state_memory(trainer_state("adamw", precision_bytes, 0), params, 1);
  e.activations = 4 * activation_floats;
  return e;
}

double optimizer_slots(const std::string& optimizer) {
  return optimizer == "adamw" ? 2 : 1;
}

double expert_params(const MoeModelConfig& m, double dim) {
  return static_cast<double>(m.n_experts) * 3 * dim * static_cast<double>(m.expert_hidden) +
         dim * static_cast<double>(m.n_experts) +  // router
         3 * dim * static_cast<double>(m.shared_expert_hidden);
}

// Saved per token of an MoE block: norms, residuals and projections (~12 C), each chosen
// expert's gate, up and activation (3 K F), the shared expert's, the router's probabilities.
double moe_token_floats(const MoeModelConfig& m, double dim) {
  return 12 * dim + 3 * static_cast<double>(m.top_k * m.expert_hidden) +
         3 * static_cast<double>(m.shared_expert_hidden) + static_cast<double>(m.n_experts);
}

double read_number(const char* path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word == "max") return -1;
  try {
    return std::stod(word);
  } catch (const std::exception&) {
    return -1;
  }
}

}  // namespace

ParamState trainer_state(const std::string& optimizer, int precision_bytes, int zero) {
  ParamState s;
  s.copy = precision_bytes;
  s.slots = optimizer_slots(optimizer);
  s.zero = zero;
  return s;
}

ParamState mixed_precision_state(const std::string& optimizer, int zero) {
  ParamState s;
  s.weight = 2;
  s.master = 4;
  s.slots = optimizer_slots(optimizer);
  s.zero = zero;
  return s;
}

MemoryEstimate state_memory(const ParamState& s, double params, double ranks) {
  MOETRAIN_CHECK(s.zero >= 0 && s.zero <= 3, "ZeRO stage {}: allowed are 0, 1, 2 and 3", s.zero);
  MOETRAIN_CHECK(ranks >= 1, "ZeRO over {} ranks: must be ≥ 1", ranks);
  auto sharded = [&](int from_stage) { return s.zero >= from_stage ? params / ranks : params; };
  MemoryEstimate e;
  e.parameters = s.weight * sharded(3);
  e.low_precision = s.copy * sharded(3);
  e.gradients = s.grad * sharded(2);
  e.optimizer = (s.master + 4 * s.slots) * sharded(1);
  return e;
}

std::string MemoryEstimate::breakdown() const {
  return fmt::format(
      "parameters {}, gradients {}, optimizer state {}, low-precision copies {}, activations {}",
      gib(parameters), gib(gradients), gib(optimizer), gib(low_precision), gib(activations));
}

MemoryEstimate estimate_memory(const ModelConfig& m, int64_t batch, int64_t seq_len,
                               int precision_bytes) {
  const double C = static_cast<double>(m.dim), V = static_cast<double>(m.vocab_size);
  const double kv = static_cast<double>(m.n_kv_heads * m.head_dim());
  const double attention = 2 * C * C + 2 * C * kv + 2 * C;  // q, o, k, v; two norms
  const double T = static_cast<double>(seq_len);
  // Layers (l + 1) % dense_every == 0 are dense: L / dense_every of them.
  const double L = static_cast<double>(m.n_layers);
  const double dense = m.dense_every > 0 ? static_cast<double>(m.n_layers / m.dense_every) : 0;
  const double F = static_cast<double>(m.dense_ffn_hidden());
  // Embedding, head, final norm; per layer attention (and its scores: one row of T per head).
  const double params =
      2 * V * C + C + L * attention + dense * 3 * C * F + (L - dense) * expert_params(m, C);
  // The logits and their gradient; per layer the attention scores and the FFN's buffers.
  const double per_token = 2 * V + L * static_cast<double>(m.n_heads) * T +
                           dense * (12 * C + 3 * F) + (L - dense) * moe_token_floats(m, C);
  return from_counts(params, static_cast<double>(batch) * T * per_token, precision_bytes);
}

MemoryEstimate estimate_memory(const ClassifierConfig& m, int64_t batch) {
  const double C = static_cast<double>(m.dim), L = static_cast<double>(m.n_layers);
  const double D = static_cast<double>(m.input_dim), V = static_cast<double>(m.n_classes);
  const double params = D * C + C + L * (C + expert_params(m, C)) + C * V;
  const double per_row = D + 2 * V + L * moe_token_floats(m, C);
  return from_counts(params, static_cast<double>(batch) * per_row, 0);
}

MemoryEstimate estimate_inference_memory(const ModelConfig& m, int64_t batch, int64_t seq_len) {
  MemoryEstimate e = estimate_memory(m, batch, seq_len, 0);
  e.gradients = e.optimizer = 0;
  return e;
}

double available_memory(std::string* source) {
  double avail = -1;
  {
    std::ifstream in("/proc/meminfo");
    for (std::string line; std::getline(in, line);)
      if (line.rfind("MemAvailable:", 0) == 0) {
        std::istringstream s(line.substr(13));
        double kb = 0;
        if (s >> kb) avail = kb * 1024;
      }
  }
  if (source) *source = "MemAvailable in /proc/meminfo";
  double limit = read_number("/sys/fs/cgroup/memory.max");
  double used = read_number("/sys/fs/cgroup/memory.current");
  const char* cgroup = "the cgroup's memory.max";
  if (limit < 0) {
    limit = read_number("/sys/fs/cgroup/memory/memory.limit_in_bytes");
    used = read_number("/sys/fs/cgroup/memory/memory.usage_in_bytes");
  }
  // cgroup v1 writes "no limit" as a huge number.
  if (limit > 0 && limit < 1e18) {
    const double left = limit - std::max(used, 0.0);
    if (avail < 0 || left < avail) {
      avail = left;
      if (source) *source = cgroup;
    }
  }
  return avail;
}

void check_memory(const MemoryEstimate& e, int processes, const std::string& what,
                  const std::string& remedy) {
  std::string source;
  const double avail = available_memory(&source);
  if (avail < 0) return;  // nothing to compare with
  const double need = e.total() * static_cast<double>(std::max(processes, 1));
  MOETRAIN_CHECK(need <= avail,
                 "{} needs about {} of memory{} ({}{}), more than the {} available ({}): {}", what,
                 gib(need),
                 processes > 1 ? fmt::format(" for {} processes on this machine", processes) : "",
                 processes > 1 ? "each: " : "", e.breakdown(), gib(avail), source,
                 !remedy.empty() ? remedy
                                 : "make the model (model.n_layers, model.dim, model.n_experts, "
                                   "model.expert_hidden) or the batch (train.batch_size, "
                                   "train.seq_len) smaller");
}

}  // namespace moetrain
