// metrics_summary: how a metrics.jsonl line becomes TensorBoard values (io/metrics.h), and the one
// table that names each key's tag and says what it is.
#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "io/metrics.h"

namespace moetrain {

namespace {

enum class Kind {
  Scalar,    // a number: one scalar
  PerLayer,  // one number per MoE layer: a scalar per layer, "moe/layer_i/NAME"
  PerRank,   // one number per rank: a histogram whose bucket r holds rank r's value
};

struct MetricTag {
  std::string_view key;
  Kind kind;
  std::string_view tag;  // the whole tag; for PerLayer the name under moe/layer_i/
  std::string_view description;
};

// Every key a trainer, the parameter server or a worker writes to metrics.jsonl. A key not listed
// keeps its own name as its tag.
constexpr std::array kTags = {
    MetricTag{"loss", Kind::Scalar, "train/loss",
              "training loss of the step: cross-entropy plus the balancing and router z terms "
              "(nats per byte for the byte-level LM)"},
    MetricTag{"ce", Kind::Scalar, "train/ce", "cross-entropy part of the training loss"},
    MetricTag{"aux", Kind::Scalar, "train/aux", "load-balancing loss (before its coefficient)"},
    MetricTag{"z", Kind::Scalar, "train/z", "router z-loss (before its coefficient)"},
    MetricTag{"lr", Kind::Scalar, "train/lr", "learning rate of the step's update"},
    MetricTag{"grad_norm", Kind::Scalar, "train/grad_norm",
              "global L2 norm of the gradient, before clipping"},
    MetricTag{"loss_scale", Kind::Scalar, "train/loss_scale", "fp16 loss scale"},
    MetricTag{"skipped", Kind::Scalar, "train/skipped",
              "1 when the fp16 step was skipped (non-finite gradient)"},
    MetricTag{"accuracy", Kind::Scalar, "train/accuracy", "classifier: training-batch accuracy"},
    MetricTag{"val_loss", Kind::Scalar, "eval/loss",
              "validation loss (nats per byte for the byte-level LM)"},
    MetricTag{"test_loss", Kind::Scalar, "eval/test_loss", "classifier: test-set loss"},
    MetricTag{"test_accuracy", Kind::Scalar, "eval/test_accuracy", "classifier: test accuracy"},
    MetricTag{"tokens_per_s", Kind::Scalar, "perf/tokens_per_s", "training tokens per second"},
    MetricTag{"images_per_s", Kind::Scalar, "perf/images_per_s", "classifier: images per second"},
    MetricTag{"step_time_s", Kind::Scalar, "perf/step_time_s",
              "wall time of the step on the writing process, seconds"},
    MetricTag{"compute_s", Kind::Scalar, "perf/compute_s",
              "step time less the communication waited for, seconds"},
    MetricTag{"grad_accum_efficiency", Kind::Scalar, "perf/grad_accum_efficiency",
              "gradient computations the update used over those computed"},
    MetricTag{"rank_step_time_s", Kind::PerRank, "perf/rank_step_time_s",
              "bucket r: rank r's wall time of the step, seconds"},
    MetricTag{"rank_compute_s", Kind::PerRank, "perf/rank_compute_s",
              "bucket r: rank r's step time less its communication waits, seconds"},
    MetricTag{"rss_bytes", Kind::Scalar, "memory/rss_bytes",
              "rank 0's resident memory (VmRSS) after the step, bytes"},
    MetricTag{"peak_rss_bytes", Kind::Scalar, "memory/peak_rss_bytes",
              "rank 0's peak resident memory so far (VmHWM), bytes"},
    MetricTag{"peak_rss_bytes_max", Kind::Scalar, "memory/peak_rss_bytes_max",
              "the largest peak resident memory (VmHWM) of any rank so far, bytes"},
    MetricTag{"rank_peak_rss_bytes", Kind::PerRank, "memory/rank_peak_rss_bytes",
              "bucket r: rank r's peak resident memory so far (VmHWM), bytes"},
    MetricTag{"comm_total_s", Kind::Scalar, "comm/total_s",
              "all of the step's communication where it ran, seconds"},
    MetricTag{"comm_exposed_s", Kind::Scalar, "comm/exposed_s",
              "communication the compute thread was blocked on, seconds"},
    MetricTag{"comm_efficiency", Kind::Scalar, "comm/efficiency",
              "compute_s / (compute_s + comm_exposed_s)"},
    MetricTag{"overlap_ratio", Kind::Scalar, "comm/overlap_ratio",
              "share of the communication hidden behind compute"},
    MetricTag{"bytes_a2a", Kind::Scalar, "comm/bytes_a2a",
              "bytes this rank sent in the step's expert all-to-alls"},
    MetricTag{"bytes_grad", Kind::Scalar, "comm/bytes_grad",
              "bytes this rank sent in the gradient reduction and gathers"},
    MetricTag{"bytes_grad_skipped", Kind::Scalar, "comm/bytes_grad_skipped",
              "gradient bytes not sent for experts frozen in the step"},
    MetricTag{"bytes_grad_sparse", Kind::Scalar, "comm/bytes_grad_sparse",
              "bytes the value-sparse expert buckets sent (grad.sparse_ratio)"},
    MetricTag{"grad_sparse_density", Kind::Scalar, "comm/grad_sparse_density",
              "share of the sparse buckets' values some rank sent"},
    MetricTag{"grad_sparse_contributors", Kind::Scalar, "comm/grad_sparse_contributors",
              "ranks that sent each such value, on average"},
    MetricTag{"a2a_cross_node_bytes", Kind::Scalar, "comm/a2a_cross_node_bytes",
              "all-to-all bytes sent to ranks on other nodes"},
    MetricTag{"a2a_route", Kind::Scalar, "comm/a2a_route",
              "adaptive route: share of cross-node pairs the step relayed (0 direct, 1 2-D)"},
    MetricTag{"a2a_route_probe", Kind::Scalar, "comm/a2a_route_probe",
              "adaptive route: 1 when the step took the other path to measure it"},
    MetricTag{"a2a_route_direct_s", Kind::Scalar, "comm/a2a_route_direct_s",
              "adaptive route: moving average of seconds per exchange, direct"},
    MetricTag{"a2a_route_relayed_s", Kind::Scalar, "comm/a2a_route_relayed_s",
              "adaptive route: moving average of seconds per exchange, relayed (2-D)"},
    MetricTag{"a2a_route_measured_s", Kind::Scalar, "comm/a2a_route_measured_s",
              "adaptive route: the step's seconds per exchange, least over the EP group"},
    MetricTag{"replica_drift", Kind::Scalar, "comm/replica_drift",
              "largest distance of a parameter from the replicas' mean before averaging"},
    MetricTag{"clock", Kind::Scalar, "ps/clock", "parameter server: clock of the update"},
    MetricTag{"pushes", Kind::Scalar, "ps/pushes", "parameter server: pushes the update applied"},
    MetricTag{"rows", Kind::Scalar, "ps/rows", "parameter server: rows the update covered"},
    MetricTag{"imbalance", Kind::Scalar, "moe/imbalance",
              "busiest expert's tokens over the mean, averaged over MoE layers"},
    MetricTag{"experts_frozen", Kind::Scalar, "moe/experts_frozen",
              "(layer, expert) pairs not updated in the step"},
    MetricTag{"dropped_fraction", Kind::PerLayer, "dropped_fraction",
              "fraction of assignments dropped over capacity"},
    MetricTag{"load_entropy", Kind::PerLayer, "load_entropy",
              "entropy of the experts' token shares over log E: 1 even, 0 one expert"},
    MetricTag{"rank_max_mean_load", Kind::PerLayer, "rank_max_mean_load",
              "busiest expert-parallel rank's tokens over the mean"},
    MetricTag{"capacity_factor", Kind::PerLayer, "capacity_factor",
              "capacity factor in effect during the step"},
    MetricTag{"capacity_utilisation", Kind::PerLayer, "capacity_utilisation",
              "assignments computed over capacity slots"},
    MetricTag{"replicas_per_expert", Kind::PerLayer, "replicas_per_expert",
              "expert slots in use over experts (1: no replicas)"},
    MetricTag{"expert_reweight_min", Kind::PerLayer, "expert_reweight_min",
              "smallest factor on an expert's gradient"},
    MetricTag{"expert_reweight_max", Kind::PerLayer, "expert_reweight_max",
              "largest factor on an expert's gradient"},
    MetricTag{"gating_reward", Kind::PerLayer, "gating_reward",
              "the gating controller's last reward"},
    MetricTag{"tokens_per_expert", Kind::PerLayer, "tokens_per_expert",
              "bucket e: tokens expert e received in the step"},
    MetricTag{"expert_utilisation", Kind::PerLayer, "expert_utilisation",
              "fraction of the layer's experts that received a token"},
    MetricTag{"max_mean_load", Kind::PerLayer, "max_mean_load",
              "busiest expert's tokens over the mean (1 with no tokens)"},
};

const MetricTag* find_tag(std::string_view key) {
  for (const MetricTag& t : kTags)
    if (t.key == key) return &t;
  return nullptr;
}

bool is_number_list(const nlohmann::json& v) {
  return v.is_array() && !v.empty() &&
         std::all_of(v.begin(), v.end(), [](const nlohmann::json& x) { return x.is_number(); });
}

bool is_number_table(const nlohmann::json& v) {
  return v.is_array() && !v.empty() && std::all_of(v.begin(), v.end(), is_number_list);
}

bool per_rank(std::string_view key) {
  const MetricTag* t = find_tag(key);
  return t ? t->kind == Kind::PerRank : key.starts_with("profile_");
}

// Counts per bucket as a histogram over the bucket index: bucket e holds the values e (its range
// [e, e+1)), so TensorBoard draws the buckets side by side in order.
Histogram index_histogram(const std::vector<double>& counts) {
  Histogram h;
  h.min = 0;
  h.max = static_cast<double>(counts.size()) - 1;
  for (std::size_t e = 0; e < counts.size(); ++e) {
    const double x = static_cast<double>(e);
    h.num += counts[e];
    h.sum += counts[e] * x;
    h.sum_squares += counts[e] * x * x;
    h.bucket_limit.push_back(x + 1);
  }
  h.bucket = counts;
  return h;
}

// Adds values with their description the first time `described` meets the tag (every time
// without it).
class Adder {
 public:
  Adder(Summary& out, std::set<std::string>* described) : out_(out), described_(described) {}
  void scalar(std::string_view key, int layer, double v) {
    const TensorboardTag t = tensorboard_tag(key, layer);
    out_.add_scalar(t.tag, static_cast<float>(v), describe(t));
  }
  void histogram(std::string_view key, int layer, const Histogram& h) {
    const TensorboardTag t = tensorboard_tag(key, layer);
    out_.add_histogram(t.tag, h, describe(t));
  }

 private:
  std::string_view describe(const TensorboardTag& t) {
    if (described_ && !described_->insert(t.tag).second) return {};
    return t.description;
  }
  Summary& out_;
  std::set<std::string>* described_;
};

// The load figures of one layer's tokens per expert.
void add_load(const std::vector<double>& load, int layer, Adder& add) {
  double mx = 0, sum = 0, used = 0;
  for (double v : load) mx = std::max(mx, v), sum += v, used += v > 0 ? 1 : 0;
  const double n = static_cast<double>(load.size());
  add.scalar("expert_utilisation", layer, used / n);
  // As train/step_metrics' imbalance: 1 when the layer saw no tokens.
  add.scalar("max_mean_load", layer, sum > 0 ? mx * n / sum : 1);
}

}  // namespace

TensorboardTag tensorboard_tag(std::string_view key, int layer) {
  const MetricTag* t = find_tag(key);
  if (t == nullptr) {
    if (key.starts_with("profile_"))
      return {"perf/" + std::string(key), "bucket r: rank r's seconds in this phase of the step"};
    std::string tag(key);
    if (layer >= 0) tag += "/layer_" + std::to_string(layer);
    return {tag, {}};
  }
  if (t->kind == Kind::PerLayer)
    return {"moe/layer_" + std::to_string(std::max(layer, 0)) + "/" + std::string(t->tag),
            t->description};
  return {std::string(t->tag), t->description};
}

bool metrics_summary(const nlohmann::json& line, int64_t& step, Summary& out,
                     std::set<std::string>* described) {
  if (!line.is_object() || !line.contains("step") || !line["step"].is_number()) return false;
  step = line["step"].get<int64_t>();
  Adder add(out, described);
  for (const auto& [key, v] : line.items()) {
    if (key == "step") continue;
    if (v.is_boolean()) {
      add.scalar(key, -1, v.get<bool>() ? 1.0 : 0.0);
    } else if (v.is_number()) {
      add.scalar(key, -1, v.get<double>());
    } else if (is_number_list(v) && per_rank(key)) {
      // One entry per rank: bucket r is rank r's value, so a straggler is the tall bar.
      add.histogram(key, -1, index_histogram(v.get<std::vector<double>>()));
    } else if (is_number_list(v)) {
      for (std::size_t i = 0; i < v.size(); ++i)
        add.scalar(key, static_cast<int>(i), v[i].get<double>());
    } else if (is_number_table(v)) {
      for (std::size_t i = 0; i < v.size(); ++i) {
        const std::vector<double> row = v[i].get<std::vector<double>>();
        add.histogram(key, static_cast<int>(i), index_histogram(row));
        if (key == "tokens_per_expert") add_load(row, static_cast<int>(i), add);
      }
    }
  }
  return true;
}

}  // namespace moetrain
