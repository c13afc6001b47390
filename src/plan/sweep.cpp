#include "plan/sweep.h"

#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "core/check.h"
#include "core/parse.h"

namespace moetrain::plan {

namespace {

// A whole number ≥ 1 from one of --sweep's values.
int64_t sweep_count(const std::string& spec, const std::string& item) {
  const std::optional<int64_t> v = parse_whole(item);
  MOETRAIN_CHECK(v && *v >= 1, "--sweep {}: '{}' is not a whole number ≥ 1", spec, item);
  return *v;
}

}  // namespace

Sweep parse_sweep(const std::vector<std::string>& specs, const Layout& layout, bool hierarchical) {
  Sweep s{{layout.procs}, {layout.tp}, {layout.pp}, {layout.ep}, {layout.etp}, {hierarchical}};
  std::vector<std::string> seen;
  for (const std::string& spec : specs) {
    const auto eq = spec.find('=');
    const std::string key = spec.substr(0, eq);
    const bool count_key =
        key == "procs" || key == "tp" || key == "pp" || key == "ep" || key == "etp";
    MOETRAIN_CHECK(eq != std::string::npos && (count_key || key == "a2a"),
                   "--sweep {}: expected procs=P1,P2,..., tp=…, pp=…, ep=E1,E2,..., etp=… or "
                   "a2a=flat,hierarchical (e.g. --sweep ep=1,2,4 --sweep a2a=flat,hierarchical)",
                   spec);
    MOETRAIN_CHECK(std::find(seen.begin(), seen.end(), key) == seen.end(),
                   "--sweep {}: {} is swept twice", spec, key);
    seen.push_back(key);
    std::vector<int64_t> counts;
    std::vector<bool> kinds;
    std::stringstream in(spec.substr(eq + 1));
    for (std::string item; std::getline(in, item, ',');) {
      if (key == "a2a") {
        MOETRAIN_CHECK(item == "flat" || item == "hierarchical",
                       "--sweep {}: '{}' is not flat or hierarchical", spec, item);
        kinds.push_back(item == "hierarchical");
      } else {
        counts.push_back(sweep_count(spec, item));
      }
    }
    MOETRAIN_CHECK(!counts.empty() || !kinds.empty(), "--sweep {}: no values", spec);
    if (key == "procs") s.procs = counts, s.procs_swept = true;
    if (key == "tp") s.tp = counts, s.tp_swept = true;
    if (key == "pp") s.pp = counts, s.pp_swept = true;
    if (key == "ep") s.ep = counts;
    if (key == "etp") s.etp = counts, s.etp_swept = true;
    if (key == "a2a") s.hierarchical = kinds, s.a2a_swept = true;
  }
  return s;
}

std::string sweep_label(const Sweep& sweep, const SweepPoint& point) {
  std::string l;
  if (sweep.procs_swept) l += fmt::format("procs={} ", point.layout.procs);
  if (sweep.tp_swept) l += fmt::format("tp={} ", point.layout.tp);
  if (sweep.pp_swept) l += fmt::format("pp={} ", point.layout.pp);
  l += fmt::format("ep={}", point.layout.ep);
  if (sweep.etp_swept) l += fmt::format(" etp={}", point.layout.etp);
  if (sweep.a2a_swept) l += point.hierarchical ? " a2a=hierarchical" : " a2a=flat";
  return l;
}

SweepResult run_sweep(const RunConfig& cfg, const std::function<ClusterSpec(int64_t)>& cluster_for,
                      const Sweep& sweep, const Layout& base, const LoadModel& load) {
  SweepResult r;
  for (const int64_t P : sweep.procs) {
    const ClusterSpec cluster = cluster_for(P);
    r.device = cluster.device.name;
    for (const int64_t tp : sweep.tp)
      for (const int64_t pp : sweep.pp)
        for (const int64_t ep : sweep.ep)
          for (const int64_t etp : sweep.etp)
            for (const bool hier : sweep.hierarchical) {
              SweepPoint pt{base, hier};
              pt.layout.procs = P, pt.layout.ep = ep, pt.layout.etp = etp, pt.layout.tp = tp;
              pt.layout.pp = pp;
              const std::string problem = layout_problem(cfg, cluster, pt.layout);
              if (!problem.empty()) {
                r.skipped.push_back(pt), r.why.push_back(problem);
                continue;
              }
              RunConfig c = cfg;
              c.dist.hierarchical = hier;
              r.points.push_back(pt);
              r.predictions.push_back(predict(c, cluster, pt.layout, load));
            }
  }
  std::string reasons;
  for (size_t i = 0; i < r.skipped.size(); ++i)
    reasons += fmt::format("\n  {}: {}", sweep_label(sweep, r.skipped[i]), r.why[i]);
  MOETRAIN_CHECK(!r.points.empty(), "no layout of the sweep can run:{}", reasons);
  // The layout that fits with the most tokens a second, per process count. Not the shortest
  // step: a step's tokens grow with the data-parallel ranks (fewer pipeline stages or tensor
  // shards, more processes), so step times compare only within one such split.
  for (const int64_t P : sweep.procs) {
    std::optional<size_t> b;
    for (size_t i = 0; i < r.points.size(); ++i)
      if (r.points[i].layout.procs == P && r.predictions[i].fits &&
          (!b || r.predictions[i].tokens_per_s > r.predictions[*b].tokens_per_s))
        b = i;
    if (b) r.best.push_back(*b);
  }
  return r;
}

namespace {

// One line a layout, for sweeps too wide for a column each.
std::string format_lines(const Sweep& sweep, const SweepResult& r) {
  size_t width = 6;
  for (const auto& pt : r.points) width = std::max(width, sweep_label(sweep, pt).size());
  std::string out =
      fmt::format("{:<{}} {:>10} {:>10} {:>10} {:>6} {:>5} {:>5} {:>12} {:>10} {:>4} {:>7}\n",
                  "layout", width, "step ms", "tokens/s", "per device", "MFU", "util", "comm",
                  "all-to-all", "GiB/device", "fits", "trainer");
  for (size_t i = 0; i < r.points.size(); ++i) {
    const Prediction& p = r.predictions[i];
    out += fmt::format(
        "{:<{}} {:>10.2f} {:>10.0f} {:>10.0f} {:>6.3f} {:>5.2f} {:>5.2f} {:>12} {:>10.1f} {:>4} "
        "{:>7}\n",
        sweep_label(sweep, r.points[i]), width, p.step_time_s * 1e3, p.tokens_per_s,
        p.tokens_per_s / static_cast<double>(p.layout.procs), p.mfu, p.utilisation,
        p.comm_efficiency, p.a2a_kind, p.memory.total() / 1073741824.0, p.fits ? "yes" : "NO",
        p.trainer_runs() ? "yes" : "no");
  }
  return out + "(every part of every layout: --json)\n";
}

}  // namespace

std::string format_sweep(const Sweep& sweep, const SweepResult& r) {
  // Up to 6 layouts side by side, part by part; more, a line each.
  std::string out = r.points.size() <= 6 ? format_table(r.predictions) : format_lines(sweep, r);
  for (size_t i = 0; i < r.skipped.size(); ++i)
    out += fmt::format("skipped {}: {}\n", sweep_label(sweep, r.skipped[i]), r.why[i]);
  for (const int64_t P : sweep.procs) {
    const auto b = std::find_if(r.best.begin(), r.best.end(),
                                [&](size_t i) { return r.points[i].layout.procs == P; });
    const bool ran = std::any_of(r.points.begin(), r.points.end(),
                                 [&](const SweepPoint& pt) { return pt.layout.procs == P; });
    const std::string at =
        sweep.procs_swept ? fmt::format(" at {} process{}", P, P == 1 ? "" : "es") : "";
    if (b != r.best.end())
      out += fmt::format("best{}: {} ({:.0f} tokens/s, {:.2f} ms a step){}\n", at,
                         sweep_label(sweep, r.points[*b]), r.predictions[*b].tokens_per_s,
                         r.predictions[*b].step_time_s * 1e3,
                         r.predictions[*b].trainer_runs()
                             ? ""
                             : "; " + r.predictions[*b].planner_only);
    else if (ran)
      out += fmt::format("best{}: none fits the device's memory\n", at);
  }
  return out;
}

namespace {

// A layout's dimensions, as the best and the skipped layouts name them.
nlohmann::json point_json(const SweepPoint& pt) {
  return {{"procs", pt.layout.procs},
          {"tp", pt.layout.tp},
          {"pp", pt.layout.pp},
          {"ep", pt.layout.ep},
          {"etp", pt.layout.etp},
          {"hierarchical", pt.hierarchical}};
}

}  // namespace

nlohmann::json sweep_json(const Sweep& sweep, const SweepResult& r) {
  nlohmann::json layouts = nlohmann::json::array(), best = nlohmann::json::array(),
                 skipped = nlohmann::json::array();
  for (const auto& p : r.predictions) layouts.push_back(to_json(p));
  for (const size_t i : r.best) {
    nlohmann::json b = point_json(r.points[i]);
    b["step_time_s"] = r.predictions[i].step_time_s;
    b["tokens_per_s"] = r.predictions[i].tokens_per_s;
    b["trainer_runs"] = r.predictions[i].trainer_runs();
    best.push_back(b);
  }
  for (size_t i = 0; i < r.skipped.size(); ++i) {
    nlohmann::json sk = point_json(r.skipped[i]);
    sk["why"] = r.why[i];
    skipped.push_back(sk);
  }
  nlohmann::json out{{"layouts", layouts}, {"best", best}, {"skipped", skipped}};
  if (!sweep.procs_swept && !r.best.empty()) out["best_ep"] = r.points[r.best[0]].layout.ep;
  return out;
}

}  // namespace moetrain::plan
