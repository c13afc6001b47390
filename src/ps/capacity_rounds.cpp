#include "ps/capacity_rounds.h"

#include <cmath>
#include <fstream>
#include <string>

#include "core/check.h"
#include "train/step_metrics.h"

namespace moetrain::ps {

nlohmann::json capacity_figures(const Accumulated& acc) {
  return {{"computed", acc.computed},
          {"slots", acc.capacity_slots},
          {"tokens_per_expert", acc.tokens_per_expert}};
}

CapacityRounds::CapacityRounds(const CapacityControlConfig& cfg, double cf0, int64_t layers,
                               int64_t experts)
    : cfg_(cfg), cf0_(cf0), layers_(layers), experts_(experts) {
  MOETRAIN_CHECK(layers > 0 && experts > 0,
                 "model.capacity = dynamic: the model has {} MoE layers of {} experts; the "
                 "controller needs at least one",
                 layers, experts);
  MOETRAIN_CHECK(rewind(0), "CapacityRounds: clock 0 needs no record");
}

CapacityRounds CapacityRounds::loads_only(int64_t layers, int64_t experts) {
  MOETRAIN_CHECK(layers > 0 && experts > 0,
                 "placement.spare_slots: the model has {} MoE layers of {} experts; replicas need "
                 "at least one",
                 layers, experts);
  CapacityRounds r;
  r.controlled_ = false;
  r.layers_ = layers, r.experts_ = experts;
  r.state_ = r.previous_ = nlohmann::json::array();
  return r;
}

nlohmann::json CapacityRounds::states() const {
  nlohmann::json a = nlohmann::json::array();
  for (const CapacityController& c : controllers_) a.push_back(c.to_json());
  return a;
}

void CapacityRounds::add(int64_t index, const nlohmann::json& f) {
  auto vector_of = [&](const nlohmann::json& v, int64_t n, const char* what) {
    MOETRAIN_CHECK(v.is_array() && static_cast<int64_t>(v.size()) == n,
                   "capacity report of worker {} for clock {}: '{}' must hold {} integers", index,
                   clock_, what, n);
    std::vector<int64_t> out;
    for (const auto& x : v) {
      MOETRAIN_CHECK(x.is_number_integer() && x.get<int64_t>() >= 0,
                     "capacity report of worker {} for clock {}: '{}' holds {}, not a count",
                     index, clock_, what, x.dump());
      out.push_back(x.get<int64_t>());
    }
    return out;
  };
  MOETRAIN_CHECK(f.is_object() && f.contains("computed") && f.contains("slots") &&
                     f.contains("tokens_per_expert"),
                 "capacity report of worker {} for clock {}: needs computed, slots and "
                 "tokens_per_expert",
                 index, clock_);
  vector_of(f.at("computed"), layers_, "computed");
  vector_of(f.at("slots"), layers_, "slots");
  const nlohmann::json& t = f.at("tokens_per_expert");
  MOETRAIN_CHECK(t.is_array() && static_cast<int64_t>(t.size()) == layers_,
                 "capacity report of worker {} for clock {}: 'tokens_per_expert' must hold {} "
                 "layers",
                 index, clock_, layers_);
  for (const auto& l : t) vector_of(l, experts_, "tokens_per_expert");
  reports_[index] = f;
}

nlohmann::json CapacityRounds::decide() {
  MOETRAIN_CHECK(!reports_.empty(), "capacity controller: clock {} has no report", clock_);
  // What train's reduce_step_figures sums over processes, summed here over the workers.
  Accumulated sum = Accumulated::for_layers(static_cast<std::size_t>(layers_), experts_);
  for (const auto& [index, f] : reports_)
    for (std::size_t m = 0; m < static_cast<std::size_t>(layers_); ++m) {
      sum.computed[m] += f.at("computed")[m].get<int64_t>();
      sum.capacity_slots[m] += f.at("slots")[m].get<int64_t>();
      for (std::size_t e = 0; e < static_cast<std::size_t>(experts_); ++e)
        sum.tokens_per_expert[m][e] += f.at("tokens_per_expert")[m][e].get<int64_t>();
    }
  std::vector<double> util, imb, cf;
  std::vector<std::string> rules;
  for (std::size_t m = 0; m < controllers_.size(); ++m) {
    util.push_back(capacity_utilisation(sum, m));
    imb.push_back(imbalance(sum.tokens_per_expert[m]));
    // The factor as apply_capacity_factors hands it to the layer (a float, cf0's sign).
    const auto f = static_cast<float>(controllers_[m].cf());
    cf.push_back(cf0_ < 0 ? -f : f);
    rules.push_back(capacity_rule_name(controllers_[m].update(util.back(), imb.back())));
  }
  nlohmann::json line;
  if (controlled_) {
    line = {{"clock", clock_},
            {"capacity_utilisation", util},
            {"capacity_imbalance", imb},
            {"capacity_rule", rules},
            {"capacity_factor", cf}};
    record_[clock_] = {util, imb};
  }
  ++clock_;
  previous_ = std::move(state_);
  state_ = states();
  previous_loads_ = std::move(loads_);
  loads_ = sum.tokens_per_expert;
  reports_.clear();
  return line;
}

bool CapacityRounds::rewind(int64_t clock) {
  loads_ = previous_loads_ = nlohmann::json::array();
  if (!controlled_) {
    clock_ = clock;
    reports_.clear();
    return true;
  }
  for (int64_t c = 0; c < clock; ++c)
    if (!record_.count(c)) return false;
  std::vector<CapacityController> replay(static_cast<std::size_t>(layers_),
                                         CapacityController(cfg_, std::abs(cf0_)));
  controllers_ = std::move(replay);
  previous_ = states();
  for (int64_t c = 0; c < clock; ++c) {
    if (c == clock - 1) previous_ = states();
    const auto& [util, imb] = record_.at(c);
    for (std::size_t m = 0; m < controllers_.size(); ++m) controllers_[m].update(util[m], imb[m]);
  }
  clock_ = clock;
  state_ = states();
  reports_.clear();
  return true;
}

int64_t CapacityRounds::load_record(const std::filesystem::path& file) {
  if (!controlled_) return 0;
  std::ifstream in(file);
  int64_t next = 0;
  std::string text;
  for (int64_t n = 1; std::getline(in, text); ++n) {
    if (text.find("\"capacity_rule\"") == std::string::npos) continue;
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
    // A line cut short by a crash while it was written holds nothing decided.
    if (j.is_discarded()) continue;
    auto doubles = [&](const char* key) {
      MOETRAIN_CHECK(j.contains(key) && j[key].is_array() &&
                         static_cast<int64_t>(j[key].size()) == layers_,
                     "{} line {}: '{}' must hold {} numbers (one per MoE layer)", file.string(), n,
                     key, layers_);
      return j[key].get<std::vector<double>>();
    };
    MOETRAIN_CHECK(j.contains("clock") && j["clock"].is_number_integer(),
                   "{} line {}: a capacity record needs an integer 'clock'", file.string(), n);
    const int64_t c = j["clock"].get<int64_t>();
    record_[c] = {doubles("capacity_utilisation"), doubles("capacity_imbalance")};
    next = c + 1;
  }
  return next;
}

}  // namespace moetrain::ps
