#include "io/report_jobs.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>

#include "io/metrics.h"
#include "io/svg_chart.h"
#include "io/trace_events.h"

namespace moetrain {

namespace {

using Json = nlohmann::json;

bool number(const Json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number();
}

// (step, key) of the lines of one file.
Series series(const std::vector<Json>& lines, const char* key, const std::string& name) {
  Series s{name, {}, {}};
  for (const Json& j : lines)
    if (number(j, "step") && number(j, key)) {
      s.x.push_back(j["step"].get<double>());
      s.y.push_back(j[key].get<double>());
    }
  return s;
}

std::string chart_or_nothing(const std::vector<Series>& s, const std::string& y_label) {
  for (const Series& one : s)
    if (!one.x.empty()) return line_chart(s, {.y_label = y_label});
  return {};
}

// The roles named PREFIX<n>, in index order ("worker_10" after "worker_9").
std::vector<std::pair<std::string, const std::vector<Json>*>> roles_with(
    const std::map<std::string, std::vector<Json>>& all, const std::string& prefix) {
  std::vector<std::pair<int64_t, std::pair<std::string, const std::vector<Json>*>>> found;
  for (const auto& [role, lines] : all) {
    if (!role.starts_with(prefix)) continue;
    const std::string rest = role.substr(prefix.size());
    if (rest.empty() || !std::all_of(rest.begin(), rest.end(), ::isdigit) || rest.size() > 9)
      continue;
    found.push_back({std::stoll(rest), {role, &lines}});
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::pair<std::string, const std::vector<Json>*>> out;
  for (auto& f : found) out.push_back(f.second);
  return out;
}

std::string text_of(const Json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return "";
  return it->is_string() ? it->get<std::string>() : it->dump();
}

// One decision of the scheduler (a "decision" line of metrics/scheduler.jsonl) in words.
std::string decision_text(const Json& j) {
  std::string out;
  if (auto g = j.find("groups"); g != j.end() && g->is_array()) {
    for (const Json& one : *g) {
      if (!one.is_object()) continue;
      std::string workers;
      if (auto w = one.find("workers"); w != one.end() && w->is_array())
        for (const Json& i : *w) workers += (workers.empty() ? "" : ", ") + i.dump();
      if (!out.empty()) out += "; ";
      out += fmt::format("group {} (workers {}): {} rows", text_of(one, "group"), workers,
                         text_of(one, "rows"));
      if (number(one, "throughput"))
        out += fmt::format(" at {:.1f} rows/s", one["throughput"].get<double>());
    }
  }
  if (auto h = j.find("hot_experts"); h != j.end()) {
    if (!out.empty()) out += "; ";
    out += "hot experts " + h->dump();
    if (j.contains("loads")) out += ", loads " + j["loads"].dump();
  }
  return out;
}

// The scheduler's decisions (row re-splits, expert placements): clock, what, cause. Left out of a
// job whose scheduler decided nothing of the kind.
std::string decision_section(const std::vector<Json>& lines) {
  std::string rows;
  for (const Json& j : lines) {
    if (!j.is_object() || !j.contains("decision")) continue;
    const bool at_once = number(j, "clock") && j["clock"].get<double>() < 0;
    rows += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
                        at_once ? "at once" : html_escape(text_of(j, "clock")),
                        html_escape(text_of(j, "decision")), html_escape(decision_text(j)),
                        html_escape(text_of(j, "cause")));
  }
  if (rows.empty()) return "";
  return report_section("decisions", "Scheduler decisions (rows and expert placement)",
                        "<table class=\"kv\">\n<tr><th>from clock</th><th>decision</th>"
                        "<th>what</th><th>cause</th></tr>\n" +
                            rows + "</table>\n",
                        "");
}

}  // namespace

std::string report_section(const std::string& id, const std::string& title, const std::string& body,
                           const std::string& empty_note) {
  return fmt::format(
      "<section id=\"{}\">\n<h2>{}</h2>\n{}</section>\n", id, html_escape(title),
      body.empty() ? fmt::format("<p class=\"empty\">{}</p>\n", html_escape(empty_note)) : body);
}

std::string rank_time_section(const std::vector<Json>& lines) {
  std::vector<Series> ranks;
  Series ratio{"slowest / median", {}, {}};
  for (const Json& j : lines) {
    auto it = j.find("rank_step_time_s");
    if (!number(j, "step") || it == j.end() || !it->is_array() || it->empty()) continue;
    std::vector<double> t;
    for (const Json& v : *it) t.push_back(v.is_number() ? v.get<double>() : NAN);
    if (!std::all_of(t.begin(), t.end(), [](double x) { return std::isfinite(x); })) continue;
    const double step = j["step"].get<double>();
    for (std::size_t r = ranks.size(); r < t.size(); ++r)
      ranks.push_back({fmt::format("rank {}", r), {}, {}});
    for (std::size_t r = 0; r < t.size(); ++r)
      ranks[r].x.push_back(step), ranks[r].y.push_back(t[r]);
    std::vector<double> sorted = t;
    std::sort(sorted.begin(), sorted.end());
    const double median = sorted[(sorted.size() - 1) / 2];
    if (median > 0) ratio.x.push_back(step), ratio.y.push_back(sorted.back() / median);
  }
  if (ranks.empty()) return "";
  return report_section("rank-time", "Step time per rank (a straggler is the top line)",
                        chart_or_nothing(ranks, "seconds"), "no finite times") +
         report_section("rank-straggler", "Slowest rank's step time over the median",
                        chart_or_nothing({ratio}, "slowest / median"), "no positive median");
}

std::string pipeline_section(const std::filesystem::path& run_dir) {
  const std::filesystem::path file = run_dir / kPipelineTraceFile;
  if (!std::filesystem::exists(file)) return "";
  const std::string title = "Pipeline timeline (each stage's passes in one step)";
  TraceFile trace;
  try {
    trace = read_trace(file);
  } catch (const std::exception& e) {
    return report_section("pipeline", title, "", e.what());
  }
  std::vector<TimelineBar> bars;
  TimelineSpec spec;
  for (const TraceSpan& s : trace.spans)
    bars.push_back({s.lane, s.start_s, s.start_s + s.duration_s, s.name, s.category});
  for (const LaneTime& l : lane_times(trace.spans)) {
    const auto name = trace.lane_names.find(l.lane);
    while (static_cast<int64_t>(spec.lane_labels.size()) < l.lane)
      spec.lane_labels.push_back(std::to_string(spec.lane_labels.size()));
    spec.lane_labels.push_back(name != trace.lane_names.end() ? name->second
                                                              : std::to_string(l.lane));
  }
  std::string body;
  if (!trace.process_names.empty())
    body += fmt::format("<p>{}</p>\n", html_escape(trace.process_names.begin()->second));
  body += timeline_chart(bars, spec);
  // Idle: a stage's time within the step (first pass to last, over every stage) not in a pass.
  const std::vector<LaneTime> lanes = lane_times(trace.spans);
  double idle = 0, total = 0;
  std::string rows;
  for (const LaneTime& l : lanes) {
    const double span = l.busy_s + l.idle_s;
    idle += l.idle_s, total += span;
    rows += fmt::format("<tr><td>{}</td><td>{:.3f}</td><td>{:.3f}</td><td>{:.1f}%</td></tr>\n",
                        html_escape(spec.lane_labels[static_cast<std::size_t>(l.lane)]),
                        l.busy_s * 1e3, l.idle_s * 1e3, span > 0 ? 100 * l.idle_s / span : 0.0);
  }
  if (!lanes.empty())
    body += fmt::format(
        "<table class=\"kv\"><tr><th>stage</th><th>busy ms</th><th>idle ms</th><th>idle</th></tr>\n"
        "{}<tr><td>all (the bubble)</td><td></td><td></td><td>{:.1f}%</td></tr></table>\n",
        rows, total > 0 ? 100 * idle / total : 0.0);
  return report_section("pipeline", title, bars.empty() ? "" : body,
                        "the trace holds no passes");
}

std::string job_sections(const std::filesystem::path& run_dir) {
  const auto all = read_role_metrics(run_dir);
  std::string out;
  const auto workers = roles_with(all, "worker_");
  if (!workers.empty()) {
    std::vector<Series> rows, stale;
    for (const auto& [role, lines] : workers) {
      rows.push_back(series(*lines, "rows_per_s", role));
      stale.push_back(series(*lines, "staleness", role));
    }
    const std::string none = "no step lines in RUN_DIR/metrics/worker_*.jsonl";
    out += report_section("workers", "Parameter-server workers: throughput",
                          chart_or_nothing(rows, "rows/s"), none);
    out += report_section("worker-staleness",
                          "Parameter-server workers: staleness (clocks the servers were past "
                          "each push)",
                          chart_or_nothing(stale, "clocks"), none);
  }
  const auto servers = roles_with(all, "server_");
  if (!servers.empty()) {
    std::vector<Series> rate, pending;
    for (const auto& [role, lines] : servers) {
      rate.push_back(series(*lines, "updates_per_s", role));
      pending.push_back(series(*lines, "pending", role));
    }
    const std::string none = "no update lines in RUN_DIR/metrics/server_*.jsonl";
    out += report_section("servers", "Parameter servers: apply rate",
                          chart_or_nothing(rate, "updates/s"), none);
    out += report_section("server-pending", "Parameter servers: pushes waiting to apply",
                          chart_or_nothing(pending, "pushes"), none);
  }
  std::vector<std::pair<double, std::string>> rows;
  for (const char* role : {"scheduler", "launcher"}) {
    auto it = all.find(role);
    if (it == all.end()) continue;
    for (const Json& j : it->second) {
      if (!j.contains("event")) continue;
      std::string who = text_of(j, "role");
      if (!who.empty()) who += " " + text_of(j, "index");
      if (j.contains("attempt")) who = "attempt " + text_of(j, "attempt");
      const double t = number(j, "time") ? j["time"].get<double>() : NAN;
      rows.push_back({t, fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
                                     role, html_escape(text_of(j, "event")), html_escape(who),
                                     html_escape(text_of(j, "cause")))});
    }
  }
  if (auto it = all.find("scheduler"); it != all.end()) out += decision_section(it->second);
  if (all.contains("scheduler") || all.contains("launcher")) {
    std::stable_sort(rows.begin(), rows.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    std::string body;
    if (!rows.empty()) {
      body =
          "<table class=\"kv\">\n<tr><th>from</th><th>event</th><th>who</th><th>cause</th>"
          "</tr>\n";
      for (const auto& r : rows) body += r.second;
      body += "</table>\n";
    }
    out += report_section("events", "Restarts and failures", body,
                          "no events in RUN_DIR/metrics/scheduler.jsonl or launcher.jsonl");
  }
  return out;
}

std::vector<Series> worker_series(const std::map<std::string, std::vector<Json>>& roles,
                                  const char* key) {
  std::vector<Series> out;
  std::map<double, std::pair<double, std::size_t>> total;  // step -> sum, workers
  for (const auto& [role, lines] : roles_with(roles, "worker_")) {
    Series s = series(*lines, key, role);
    if (s.x.empty()) continue;
    for (std::size_t i = 0; i < s.x.size(); ++i) {
      auto& [sum, n] = total[s.x[i]];
      sum += s.y[i];
      ++n;
    }
    out.push_back(std::move(s));
  }
  if (out.size() > 1) {
    Series all{"all workers", {}, {}};
    for (const auto& [step, sn] : total)
      if (sn.second == out.size()) all.x.push_back(step), all.y.push_back(sn.first);
    out.push_back(std::move(all));
  }
  return out;
}

std::string ps_expert_sections(const std::filesystem::path& run_dir, const Json& config) {
  int64_t layers = 0, experts = 0;
  if (config.is_object() && config.contains("model") && config["model"].is_object()) {
    const Json& m = config["model"];
    if (number(m, "n_layers")) layers = m["n_layers"].get<int64_t>();
    if (number(m, "n_experts")) experts = m["n_experts"].get<int64_t>();
  }
  // An expert's keys may span two servers: each counts the pushes it saw, so take the largest.
  std::vector<double> pushed;
  std::size_t servers = 0;
  for (int i = 0;; ++i) {
    std::ifstream in(run_dir / "ps" / fmt::format("server_{}.json", i));
    if (!in) break;
    std::ostringstream ss;
    ss << in.rdbuf();
    const Json j = Json::parse(ss.str(), nullptr, false);
    if (j.is_discarded() || !j.is_object()) continue;
    auto c = j.find("expert_contributors");
    if (c == j.end() || !c->is_array()) continue;
    ++servers;
    if (pushed.size() < c->size()) pushed.resize(c->size(), 0);
    for (std::size_t e = 0; e < c->size(); ++e)
      if ((*c)[e].is_number()) pushed[e] = std::max(pushed[e], (*c)[e].get<double>());
  }
  std::string map;
  if (layers > 0 && experts > 0 && pushed.size() == static_cast<std::size_t>(layers * experts)) {
    std::vector<std::vector<double>> cells(static_cast<std::size_t>(layers));
    HeatmapSpec spec;
    for (int64_t l = 0; l < layers; ++l) {
      spec.row_labels.push_back(fmt::format("layer {}", l));
      cells[l].assign(pushed.begin() + l * experts, pushed.begin() + (l + 1) * experts);
    }
    for (int64_t e = 0; e < experts; ++e) spec.col_labels.push_back(std::to_string(e));
    spec.x_label = "expert";
    spec.y_label = "MoE layer";
    spec.value_label = "pushes";
    map = heatmap(cells, spec);
  }
  const std::string per_step =
      "a parameter-server run records no per-step expert load (the servers' lines carry no "
      "tokens_per_expert); the whole run's pushes per expert are above";
  std::string out = report_section(
      "expert-load", "Expert load over the run (pushes that carried each expert's gradient)", map,
      servers == 0 ? "no RUN_DIR/ps/server_I.json with expert_contributors yet"
                   : "the servers' expert_contributors do not match model.n_layers × "
                     "model.n_experts of the config");
  out += report_section("expert-load-steps", "Expert load over steps", "", per_step);
  out += report_section("imbalance", "Load imbalance", "", per_step);
  out += report_section("utilisation", "Expert utilisation and dropped fraction", "", per_step);
  return out;
}

}  // namespace moetrain
