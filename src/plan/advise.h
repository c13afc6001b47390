// Cluster-size advice (`moetrain plan --advise`): for one model and a range of cluster sizes,
// which of the design's strategies pay — static or dynamic balancing, the flat or the
// hierarchical exchange (and which one adaptive routing would take), dense or sparse expert
// gradients — each decided by the cost model's step time with the strategy and without it, beside
// the design's three tiers (docs/plan-advise.md).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "plan/cost_model.h"

namespace moetrain::plan {

// A strategy pays when it shortens the step by at least this share: below it the choice is
// within what the model's approximations can tell, and the simpler setting is kept.
constexpr double kPays = 0.01;

// One strategy at one size: the step time with the simpler and with the advanced setting.
struct StrategyChoice {
  std::string simple, advanced;  // static / dynamic, flat / hierarchical, dense / sparse
  std::vector<std::string> simple_settings, advanced_settings;  // as --set takes them
  double simple_s = 0, advanced_s = 0;
  bool pays() const { return advanced_s < simple_s * (1 - kPays); }
  const std::string& choice() const { return pays() ? advanced : simple; }
  double change() const { return advanced_s / simple_s - 1; }  // of the step time
};

// The design's tiers: ≤ 256 devices, 256–2048, ≥ 2048.
struct DesignTier {
  std::string name, range, advice;
  bool dynamic, hierarchical, sparse;  // what it recommends
};
const DesignTier& design_tier(int64_t devices);

struct SizeAdvice {
  int64_t devices = 0, nodes = 0, ep = 0;
  std::string problem;  // why the model cannot run at this size; the rest is then unset
  bool fits = true;     // the memory per device fits the device
  StrategyChoice balancing, exchange, gradients;
  std::string adaptive;  // the cheaper of flat and hierarchical: what adaptive routing would send
};

// Powers of two from 8 (or the cluster's size, if smaller) up to the cluster's devices, and its
// size where that is not a power of two.
std::vector<int64_t> default_advice_sizes(const ClusterSpec& cluster);
// "8,64,512": whole numbers ≥ 1, ascending order not required; throws naming --sizes.
std::vector<int64_t> parse_advice_sizes(const std::string& spec);

// Each size runs `layout` with procs = the size and EP = gcd(ep, size), on the cluster's nodes
// (as many as the size needs: more than the file has are taken to be the same). Each strategy is
// compared on the config with the other two at their simpler setting; `load` is what static
// balancing leaves (dynamic balancing is placement.spare_slots = 1 re-planned on it).
std::vector<SizeAdvice> advise(const RunConfig& cfg, const ClusterSpec& cluster,
                               const Layout& layout, const std::vector<int64_t>& sizes,
                               const LoadModel& load);
std::string format_advice(const std::vector<SizeAdvice>& rows);
nlohmann::json advice_json(const std::vector<SizeAdvice>& rows);

}  // namespace moetrain::plan
