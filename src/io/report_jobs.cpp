#include "io/report_jobs.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <map>

#include <fmt/format.h>

#include "io/metrics.h"
#include "io/svg_chart.h"

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

}  // namespace moetrain
