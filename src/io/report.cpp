#include "io/report.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>
#include <system_error>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/check.h"
#include "io/file.h"
#include "io/metrics.h"
#include "io/report_jobs.h"
#include "io/report_run.h"
#include "io/svg_chart.h"

namespace moetrain {
namespace fs = std::filesystem;
namespace {

using Json = nlohmann::json;

constexpr std::size_t kMaxHeatmapColumns = 120;

constexpr const char* kStyle = R"(
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 920px; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 4px; }
h2 { font-size: 1.15em; margin: 0 0 6px 0; }
section { margin: 22px 0; padding-top: 8px; border-top: 1px solid #ddd; }
.notes { background: #fff6d6; border: 1px solid #e8d48a; padding: 6px 12px; }
.summary td, table.kv td, table.kv th { padding: 2px 10px 2px 0; text-align: left; }
table.header th, table.header td { padding: 1px 12px 1px 0; text-align: left; vertical-align: top; }
table.header th { font-weight: 600; color: #444; }
table.kv tr.changed td { background: #ffe9a8; font-weight: 600; }
table.kv { border-collapse: collapse; font-size: 0.9em; }
table.kv tr:nth-child(even) { background: #f4f4f4; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
svg.chart { display: block; max-width: 100%; height: auto; }
svg .plot { fill: #fcfcfc; stroke: #999; }
svg .grid { stroke: #e4e4e4; }
svg .tick { font-size: 11px; fill: #444; }
svg .axis-label { font-size: 12px; fill: #222; }
pre.sample { white-space: pre-wrap; background: #f6f6f6; padding: 10px; }
p.empty { color: #777; }
)";

// (step, value) of every line with a step whose `key` is a number.
Series series_of(const std::vector<Json>& lines, const std::string& key, std::string name = {}) {
  Series s{name.empty() ? key : std::move(name), {}, {}};
  for (const auto& j : lines) {
    auto step = j.find("step");
    auto v = j.find(key);
    if (step == j.end() || v == j.end() || !step->is_number() || !v->is_number()) continue;
    s.x.push_back(step->get<double>());
    s.y.push_back(v->get<double>());
  }
  return s;
}

bool any_points(const std::vector<Series>& all) {
  return std::any_of(all.begin(), all.end(), [](const Series& s) { return !s.x.empty(); });
}

// tokens_per_expert of a line as numbers (layers × experts); empty when absent or malformed.
std::vector<std::vector<double>> expert_load(const Json& line) {
  std::vector<std::vector<double>> out;
  auto it = line.find("tokens_per_expert");
  if (it == line.end() || !it->is_array()) return {};
  for (const auto& layer : *it) {
    if (!layer.is_array()) return {};
    auto& row = out.emplace_back();
    for (const auto& v : layer) row.push_back(v.is_number() ? v.get<double>() : NAN);
  }
  return out;
}

std::string section(const std::string& id, const std::string& title, const std::string& body,
                    const std::string& empty_note) {
  return report_section(id, title, body, empty_note);
}

std::string chart(const std::string& id, const std::string& title, const std::vector<Series>& s,
                  const LineChartSpec& spec, const std::string& empty_note) {
  return section(id, title, any_points(s) ? line_chart(s, spec) : std::string(), empty_note);
}

std::string human_bytes(std::uintmax_t n) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(n);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  return u == 0 ? fmt::format("{} B", n) : fmt::format("{:.1f} {}", v, units[u]);
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Inputs {
  std::vector<Json> lines;  // metrics lines
  std::vector<std::string> notes;
  RunFacts facts;
  std::map<std::string, std::vector<Json>> roles;  // RUN_DIR/metrics/ROLE.jsonl
};

Inputs read_inputs(const fs::path& run_dir, const SettingDefaults& defaults) {
  Inputs in;
  const fs::path metrics = run_dir / kMetricsFile;
  std::error_code ec;
  if (!fs::exists(metrics, ec)) {
    in.notes.push_back(fmt::format("{} does not exist: no training metrics yet", metrics.string()));
  } else {
    in.lines = read_metrics(run_dir);
    std::size_t text_lines = 0;
    std::ifstream f(metrics);
    for (std::string l; std::getline(f, l);)
      if (!l.empty()) ++text_lines;
    if (text_lines == 0)
      in.notes.push_back(fmt::format("{} is empty: no step finished yet", metrics.string()));
    else if (text_lines > in.lines.size())
      in.notes.push_back(fmt::format(
          "{}: {} of {} lines are not complete JSON objects and were skipped (a run still writing, "
          "or one that stopped mid-line)",
          metrics.string(), text_lines - in.lines.size(), text_lines));
  }
  in.facts = read_run_facts(run_dir, defaults);
  in.notes.insert(in.notes.end(), in.facts.notes.begin(), in.facts.notes.end());
  in.roles = read_role_metrics(run_dir);
  return in;
}

std::string summary(const Inputs& in) {
  std::string rows;
  auto row = [&](const std::string& k, const std::string& v) {
    rows += fmt::format("<tr><td>{}</td><td>{}</td></tr>\n", html_escape(k), html_escape(v));
  };
  int64_t last_step = -1;
  for (const auto& j : in.lines)
    if (auto s = j.find("step"); s != j.end() && s->is_number_integer())
      last_step = std::max(last_step, s->get<int64_t>());
  int64_t planned = -1;
  const Json& config = in.facts.config;
  if (config.is_object() && config.contains("train") && config["train"].is_object())
    if (auto s = config["train"].find("steps");
        s != config["train"].end() && s->is_number_integer())
      planned = s->get<int64_t>();
  if (last_step >= 0)
    row("steps", planned > 0 ? fmt::format("{} of {}{}", last_step, planned,
                                           last_step < planned ? " (in progress or stopped)" : "")
                             : std::to_string(last_step));
  const std::string loss = loss_unit(in.facts);
  const std::pair<const char*, std::string> keys[] = {{"loss", loss},
                                                      {"val_loss", loss},
                                                      {"test_loss", "nats"},
                                                      {"accuracy", ""},
                                                      {"test_accuracy", ""},
                                                      {"grad_norm", ""},
                                                      {"tokens_per_s", "tokens/s"},
                                                      {"images_per_s", "images/s"}};
  auto show = [&](const std::string& key, const Series& s, const std::string& unit) {
    if (s.y.empty()) return;
    const std::string v =
        s.y.back() >= 1e4 ? fmt::format("{:.0f}", s.y.back()) : fmt::format("{:.4g}", s.y.back());
    row(fmt::format("last {} (step {})", key, s.x.back()), unit.empty() ? v : v + " " + unit);
  };
  for (const auto& [key, unit] : keys) show(key, series_of(in.lines, key), unit);
  if (const Series peak = series_of(in.lines, "peak_rss_bytes_max"); !peak.y.empty())
    row(fmt::format("peak resident memory per rank (step {})", peak.x.back()),
        fmt::format("{:.1f} MiB (the largest rank's VmHWM)", peak.y.back() / (1024.0 * 1024.0)));
  if (in.facts.parameter_server) {
    const std::vector<Series> workers = worker_series(in.roles, "tokens_per_s");
    if (workers.size() > 1) show("tokens_per_s, all workers", workers.back(), "tokens/s");
  }
  return rows.empty() ? std::string() : "<table class=\"summary\">\n" + rows + "</table>\n";
}

// Resident memory (metrics' rss_bytes, peak_rss_bytes, peak_rss_bytes_max) in MiB.
std::string memory_section(const std::vector<Json>& lines) {
  std::vector<Series> all = {series_of(lines, "peak_rss_bytes_max", "peak, largest rank (VmHWM)"),
                             series_of(lines, "peak_rss_bytes", "peak, rank 0 (VmHWM)"),
                             series_of(lines, "rss_bytes", "resident, rank 0 (VmRSS)")};
  for (Series& s : all)
    for (double& y : s.y) y /= 1024.0 * 1024.0;
  return chart("memory", "Resident memory per rank", all, {.y_label = "MiB"},
               "no rss_bytes in RUN_DIR/metrics.jsonl (a run before they were recorded)");
}

std::string expert_sections(const std::vector<Json>& lines) {
  // Steps that carry a load table, in order.
  std::vector<std::pair<double, std::vector<std::vector<double>>>> loads;
  for (const auto& j : lines)
    if (auto s = j.find("step"); s != j.end() && s->is_number())
      if (auto l = expert_load(j); !l.empty()) loads.emplace_back(s->get<double>(), std::move(l));
  std::string out;
  const std::string none = "no tokens_per_expert in metrics.jsonl (a dense model, or no step yet)";

  std::string last_map;
  if (!loads.empty()) {
    const auto& [step, last] = loads.back();
    HeatmapSpec spec;
    std::size_t experts = 0;
    for (std::size_t l = 0; l < last.size(); ++l) {
      spec.row_labels.push_back(fmt::format("layer {}", l));
      experts = std::max(experts, last[l].size());
    }
    for (std::size_t e = 0; e < experts; ++e) spec.col_labels.push_back(std::to_string(e));
    spec.x_label = "expert";
    spec.y_label = "MoE layer";
    spec.value_label = "tokens";
    last_map = heatmap(last, spec);
    out += section("expert-load", fmt::format("Expert load at step {} (tokens per expert)", step),
                   last_map, none);
  } else {
    out += section("expert-load", "Expert load (tokens per expert)", "", none);
  }

  // Each expert's share of its layer's tokens over the run, steps averaged into at most
  // kMaxHeatmapColumns columns: a collapsing router shows as one row going dark.
  std::string over_time;
  if (!loads.empty()) {
    const std::size_t n = loads.size();
    const std::size_t cols = std::min(n, kMaxHeatmapColumns);
    std::vector<std::vector<double>> cells;
    HeatmapSpec spec;
    const auto& shape = loads.back().second;
    for (std::size_t l = 0; l < shape.size(); ++l)
      for (std::size_t e = 0; e < shape[l].size(); ++e) {
        spec.row_labels.push_back(fmt::format("L{} e{}", l, e));
        auto& row = cells.emplace_back(cols, 0.0);
        std::vector<int> count(cols, 0);
        for (std::size_t i = 0; i < n; ++i) {
          const auto& load = loads[i].second;
          if (l >= load.size() || e >= load[l].size()) continue;
          double total = 0;
          for (double v : load[l]) total += std::isfinite(v) ? v : 0;
          const std::size_t c = i * cols / n;
          row[c] += total > 0 ? load[l][e] / total : 0;
          ++count[c];
        }
        for (std::size_t c = 0; c < cols; ++c) row[c] = count[c] ? row[c] / count[c] : NAN;
      }
    for (std::size_t c = 0; c < cols; ++c)
      spec.col_labels.push_back(fmt::format("{}", loads[c * n / cols].first));
    spec.x_label = "step";
    spec.y_label = "layer, expert";
    spec.value_label = "share of layer";
    over_time = heatmap(cells, spec);
  }
  out += section("expert-load-steps", "Expert load over steps (share of each layer's tokens)",
                 over_time, none);

  // Busiest expert over the mean, per layer (from the tables), else the run's averaged key.
  std::vector<Series> imbalance;
  if (!loads.empty()) {
    for (const auto& [step, load] : loads)
      for (std::size_t l = 0; l < load.size(); ++l) {
        if (imbalance.size() <= l) imbalance.push_back({fmt::format("layer {}", l), {}, {}});
        double total = 0, peak = 0;
        for (double v : load[l]) total += v, peak = std::max(peak, v);
        imbalance[l].x.push_back(step);
        imbalance[l].y.push_back(total > 0 ? peak / (total / load[l].size()) : 1.0);
      }
  } else {
    imbalance.push_back(series_of(lines, "imbalance"));
  }
  out += chart("imbalance", "Load imbalance (busiest expert's tokens over the mean)", imbalance,
               {.y_label = "ratio (max / mean)"}, none);

  // Utilisation: fraction of a layer's experts that got a token; dropped: over capacity. Both
  // averaged over the MoE layers.
  Series util{"expert utilisation", {}, {}}, dropped{"dropped fraction", {}, {}};
  for (const auto& [step, load] : loads) {
    double u = 0;
    for (const auto& layer : load) {
      std::size_t used = 0;
      for (double v : layer) used += v > 0;
      u += layer.empty() ? 0 : static_cast<double>(used) / layer.size();
    }
    util.x.push_back(step);
    util.y.push_back(u / load.size());
  }
  for (const auto& j : lines) {
    auto s = j.find("step");
    auto d = j.find("dropped_fraction");
    if (s == j.end() || d == j.end() || !s->is_number() || !d->is_array() || d->empty()) continue;
    double sum = 0;
    for (const auto& v : *d) sum += v.is_number() ? v.get<double>() : 0;
    dropped.x.push_back(s->get<double>());
    dropped.y.push_back(sum / d->size());
  }
  out += chart("utilisation", "Expert utilisation and dropped fraction", {util, dropped},
               {.y_label = "fraction (0 to 1)"}, none);
  return out;
}

std::string checkpoints_section(const fs::path& run_dir) {
  const fs::path root = run_dir / "checkpoints";
  std::error_code ec;
  std::map<std::string, std::pair<std::size_t, std::uintmax_t>> found;  // name -> files, bytes
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!it->is_directory(ec) || name.rfind("step_", 0) != 0 ||
        name.find(".tmp") != std::string::npos)
      continue;
    auto& [files, bytes] = found[name];
    for (fs::recursive_directory_iterator f(it->path(), ec), fend; !ec && f != fend;
         f.increment(ec))
      if (f->is_regular_file(ec)) ++files, bytes += f->file_size(ec);
  }
  if (found.empty())
    return section("checkpoints", "Checkpoints", "",
                   fmt::format("no checkpoints in {}", root.string()));
  std::string body =
      "<table class=\"kv\">\n<tr><th>step</th><th>directory</th><th>files</th><th>size</th></tr>\n";
  for (const auto& [name, fb] : found) {
    const std::string digits = name.substr(5);
    const bool numeric =
        !digits.empty() && digits.find_first_not_of("0123456789") == std::string::npos;
    body += fmt::format(
        "<tr><td class=\"num\">{}</td><td>{}</td><td class=\"num\">{}</td><td "
        "class=\"num\">{}</td></tr>\n",
        numeric ? std::to_string(std::stoll(digits)) : "?", html_escape(name), fb.first,
        human_bytes(fb.second));
  }
  return section("checkpoints", "Checkpoints", body + "</table>\n", "");
}

}  // namespace

std::string render_report(const fs::path& run_dir, const SettingDefaults& defaults) {
  std::error_code ec;
  MOETRAIN_CHECK(fs::is_directory(run_dir, ec),
                 "report: run directory {} does not exist (expected a train run's RUN_DIR)",
                 run_dir.string());
  const Inputs in = read_inputs(run_dir, defaults);
  const auto& lines = in.lines;
  const RunFacts& facts = in.facts;
  const bool ps = facts.parameter_server;
  const std::string title =
      "moetrain run: " + fs::absolute(run_dir, ec).lexically_normal().filename().string();

  std::string html = "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
  html += fmt::format("<title>{}</title>\n<style>{}</style>\n</head>\n<body>\n", html_escape(title),
                      kStyle);
  html += fmt::format("<h1>{}</h1>\n<p>{}</p>\n", html_escape(title),
                      html_escape(fs::absolute(run_dir, ec).string()));
  html += run_header(run_dir, facts, lines);
  if (!in.notes.empty()) {
    html += "<div class=\"notes\"><ul>\n";
    for (const auto& n : in.notes) html += fmt::format("<li>{}</li>\n", html_escape(n));
    html += "</ul></div>\n";
  }
  html += summary(in);

  const std::string no_metrics = "not in metrics.jsonl yet";
  const std::string loss = loss_unit(facts);
  // Evaluations are few: drawn last (on top of the training curve), each point marked.
  Series val = series_of(lines, "val_loss", "validation loss"),
         test = series_of(lines, "test_loss", "test loss");
  val.markers = test.markers = true;
  html += chart("loss", fmt::format("Loss ({})", loss),
                {series_of(lines, "loss", "train loss"), val, test},
                {.y_label = fmt::format("loss ({})", loss)}, no_metrics);
  html += chart("grad-norm", "Gradient norm (global L2, before clipping)",
                {series_of(lines, "grad_norm", "gradient norm")}, {.y_label = "L2 norm"},
                ps ? "a parameter-server run records no gradient norm (its servers apply the "
                     "workers' pushes unclipped)"
                   : no_metrics);
  html += chart("lr", "Learning rate", {series_of(lines, "lr")},
                {.y_label = "learning rate (per step)"}, no_metrics);
  if (ps) {
    html += chart("throughput", "Throughput (tokens per second, per worker and all workers)",
                  worker_series(in.roles, "tokens_per_s"), {.y_label = "tokens/s"},
                  "no tokens_per_s in RUN_DIR/metrics/worker_*.jsonl yet");
  } else {
    const bool images = facts.kind == RunKind::Classifier;
    html += chart("throughput",
                  images ? "Throughput (images per second)" : "Throughput (tokens per second)",
                  {series_of(lines, images ? "images_per_s" : "tokens_per_s",
                             images ? "images/s" : "tokens/s")},
                  {.y_label = images ? "images/s" : "tokens/s"}, no_metrics);
  }
  html += ps ? ps_expert_sections(run_dir, facts.config) : expert_sections(lines);
  if (ps) {
    std::vector<Series> times = worker_series(in.roles, "step_time_s");
    if (times.size() > 1) times.pop_back();  // a sum of times is no step time
    html += chart("time", "Step time per worker (its compute and its wait for the servers)", times,
                  {.y_label = "time (s)"}, "no step_time_s in RUN_DIR/metrics/worker_*.jsonl yet");
  } else {
    html += chart("time", "Compute and communication time per step",
                  {series_of(lines, "compute_s", "compute"),
                   series_of(lines, "comm_exposed_s", "exposed communication"),
                   series_of(lines, "comm_total_s", "communication (all-to-all and gradients)")},
                  {.y_label = "time (s)"}, no_metrics);
  }
  html += rank_time_section(lines);
  html += pipeline_section(run_dir);
  if (!ps) html += memory_section(lines);
  html += job_sections(run_dir);
  html += config_section(facts);
  html += checkpoints_section(run_dir);
  const fs::path sample = run_dir / kSampleFile;
  if (fs::is_regular_file(sample, ec))
    html += section("sample", "Sample text",
                    fmt::format("<pre class=\"sample\">{}</pre>\n", html_escape(read_text(sample))),
                    "");
  html += "</body>\n</html>\n";
  return html;
}

fs::path write_report(const fs::path& run_dir, const SettingDefaults& defaults,
                      const fs::path& out) {
  const fs::path path = out.empty() ? run_dir / "report.html" : out;
  const std::string html = render_report(run_dir, defaults);
  write_file_atomic(path, html);
  return path;
}

}  // namespace moetrain
