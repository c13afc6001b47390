#include "plan/advise.h"

#include <fmt/format.h>

#include <numeric>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/parse.h"

namespace moetrain::plan {

const DesignTier& design_tier(int64_t devices) {
  static const DesignTier tiers[] = {
      {"small", "≤ 256", "static balancing, flat all-to-all, dense gradients are enough", false,
       false, false},
      {"medium", "256–2048", "dynamic balancing and the hierarchical exchange", true, true, false},
      {"large", "≥ 2048", "everything, sparse gradients included", true, true, true},
  };
  return devices <= 256 ? tiers[0] : devices < 2048 ? tiers[1] : tiers[2];
}

std::vector<int64_t> default_advice_sizes(const ClusterSpec& cluster) {
  const int64_t n = cluster.devices();
  std::vector<int64_t> out;
  for (int64_t s = std::min<int64_t>(8, n); s <= n; s *= 2) out.push_back(s);
  if (out.empty() || out.back() != n) out.push_back(n);
  return out;
}

std::vector<int64_t> parse_advice_sizes(const std::string& spec) {
  std::vector<int64_t> out;
  for (const std::string& item : split_list(spec)) {
    const std::optional<int64_t> v = parse_whole(item);
    MOETRAIN_CHECK(v && *v >= 1 && *v <= (int64_t{1} << 30),
                   "--sizes {}: '{}' is not a whole number of devices in [1, 2^30]", spec, item);
    out.push_back(*v);
  }
  MOETRAIN_CHECK(!out.empty(), "--sizes '{}': give device counts, e.g. 8,64,512", spec);
  return out;
}

namespace {

StrategyChoice compare(const RunConfig& base, const ClusterSpec& cluster, const Layout& layout,
                       const LoadModel& load, StrategyChoice c) {
  c.simple_s = predict(with_overrides(base, c.simple_settings), cluster, layout, load).step_time_s;
  c.advanced_s =
      predict(with_overrides(base, c.advanced_settings), cluster, layout, load).step_time_s;
  return c;
}

}  // namespace

std::vector<SizeAdvice> advise(const RunConfig& cfg, const ClusterSpec& cluster,
                               const Layout& layout, const std::vector<int64_t>& sizes,
                               const LoadModel& load) {
  // The simpler setting of every strategy; each comparison changes one of them.
  const std::string accum = fmt::format("grad.min_accum_fraction={}", cfg.grad.min_accum_fraction);
  const RunConfig base =
      with_overrides(cfg, {"placement.spare_slots=0", "dist.hierarchical=false",
                           "grad.min_accum_fraction=0", "grad.sparse_experts=false"});
  std::vector<SizeAdvice> out;
  for (const int64_t n : sizes) {
    SizeAdvice a;
    a.devices = n;
    a.nodes = (n + cluster.devices_per_node - 1) / cluster.devices_per_node;
    a.ep = std::gcd(layout.ep, n);
    ClusterSpec c = cluster;
    c.nodes = a.nodes;
    Layout l = layout;
    l.procs = n;
    l.ep = a.ep;
    try {
      a.fits = predict(base, c, l, load).fits;
      a.balancing = compare(base, c, l, load,
                            {"static", "dynamic", {}, {"placement.spare_slots=1"}});
      a.exchange = compare(base, c, l, load,
                           {"flat", "hierarchical", {}, {"dist.hierarchical=true"}});
      a.gradients = compare(base, c, l, load,
                            {"dense", "sparse", {}, {"grad.sparse_experts=true", accum}});
      a.adaptive = a.exchange.advanced_s < a.exchange.simple_s ? "hierarchical" : "flat";
    } catch (const Error& e) {
      a.problem = e.what();
    }
    out.push_back(std::move(a));
  }
  return out;
}

std::string format_advice(const std::vector<SizeAdvice>& rows) {
  auto cell = [](const StrategyChoice& c, bool design) {
    return fmt::format("{} ({:+.1f}%){}", c.choice(), 100 * c.change(),
                       c.pays() == design ? "" : " *");
  };
  std::string out = fmt::format("{:>8}{:>7}{:>6}  {:<22}{:<26}{:<14}{:<20}{}\n", "devices",
                                "nodes", "EP", "balancing", "exchange", "adaptive", "gradients",
                                "the design's tier");
  for (const SizeAdvice& a : rows) {
    const DesignTier& t = design_tier(a.devices);
    const std::string tier = fmt::format("{} ({}): {}", t.name, t.range, t.advice);
    if (!a.problem.empty()) {
      out += fmt::format("{:>8}{:>7}{:>6}  cannot run: {}\n", a.devices, a.nodes, a.ep, a.problem);
      continue;
    }
    out += fmt::format("{:>8}{:>7}{:>6}  {:<22}{:<26}{:<14}{:<20}{}{}\n", a.devices, a.nodes, a.ep,
                       cell(a.balancing, t.dynamic), cell(a.exchange, t.hierarchical), a.adaptive,
                       cell(a.gradients, t.sparse), tier, a.fits ? "" : " [does not fit]");
  }
  out += fmt::format(
      "(in brackets: the step time's change with the advanced setting, dynamic / hierarchical / "
      "sparse; it is chosen where it shortens the step by at least {:.0f}%. *: not what the "
      "design's tier recommends. adaptive: the cheaper exchange, which adaptive routing would "
      "send every node pair over)\n",
      100 * kPays);
  return out;
}

nlohmann::json advice_json(const std::vector<SizeAdvice>& rows) {
  auto strategy = [](const StrategyChoice& c) {
    return nlohmann::json{{"choice", c.choice()},
                          {"pays", c.pays()},
                          {c.simple + "_step_s", c.simple_s},
                          {c.advanced + "_step_s", c.advanced_s},
                          {c.advanced + "_settings", c.advanced_settings}};
  };
  nlohmann::json out = nlohmann::json::array();
  for (const SizeAdvice& a : rows) {
    const DesignTier& t = design_tier(a.devices);
    nlohmann::json j = {{"devices", a.devices},
                        {"nodes", a.nodes},
                        {"ep", a.ep},
                        {"design_tier",
                         {{"name", t.name},
                          {"range", t.range},
                          {"advice", t.advice},
                          {"dynamic_balancing", t.dynamic},
                          {"hierarchical_exchange", t.hierarchical},
                          {"sparse_gradients", t.sparse}}}};
    if (!a.problem.empty()) {
      j["problem"] = a.problem;
    } else {
      j["fits"] = a.fits;
      j["balancing"] = strategy(a.balancing);
      j["exchange"] = strategy(a.exchange);
      j["adaptive_exchange"] = a.adaptive;
      j["gradients"] = strategy(a.gradients);
    }
    out.push_back(j);
  }
  return out;
}

}  // namespace moetrain::plan
