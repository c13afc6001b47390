#include "io/ablation_table.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "io/file.h"
#include "io/metrics.h"
#include "io/svg_chart.h"

namespace moetrain {

namespace fs = std::filesystem;
using Json = nlohmann::json;

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double number(const Json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}

std::string read_trimmed(const fs::path& file) {
  std::ifstream in(file);
  std::stringstream s;
  s << in.rdbuf();
  std::string text = s.str();
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text;
}

// The figures in table order, with their labels.
struct Column {
  const char* key;
  const char* label;
  double AblationFigures::*field;
};
constexpr Column kColumns[] = {
    {"utilisation", "expert utilisation (active/all)", &AblationFigures::utilisation},
    {"load_balance", "load balance (mean/max)", &AblationFigures::load_balance},
    {"comm_efficiency", "comm. efficiency (all comm.)", &AblationFigures::comm_efficiency},
    {"comm_efficiency_exposed", "comm. efficiency (exposed)",
     &AblationFigures::comm_efficiency_exposed},
    {"samples_per_s", "samples/s", &AblationFigures::samples_per_s},
    {"kept_samples_per_s", "samples/s × kept share", &AblationFigures::kept_samples_per_s},
    {"val_loss", "validation loss", &AblationFigures::val_loss},
    {"training_efficiency", "training efficiency (samples/s × util. / process)",
     &AblationFigures::training_efficiency},
};

Json figures_json(const AblationFigures& f) {
  Json j = Json::object();
  for (const Column& c : kColumns) j[c.key] = f.*c.field;
  return j;
}

}  // namespace

AblationFigures ablation_run_figures(const fs::path& run_dir, int64_t warmup) {
  const fs::path metrics = run_dir / kMetricsFile;
  MOETRAIN_CHECK(fs::exists(metrics), "{} does not exist: the run did not start", metrics.string());
  int64_t seq_len = 0;
  const fs::path config = run_config_file(run_dir);
  if (fs::exists(config)) {
    const Json c = Json::parse(read_trimmed(config), nullptr, false);
    if (c.is_object() && c.contains("train")) seq_len = c["train"].value("seq_len", int64_t{0});
  }
  MOETRAIN_CHECK(seq_len > 0, "{}: no train.seq_len (needed for samples/s)", config.string());
  AblationFigures f;
  std::vector<std::vector<double>> load;  // per layer, per expert, over the timed steps
  double seconds = 0, samples = 0, kept = 0, exposed = 0, all_comm = 0, active = 0;
  int64_t timed = 0, moe_steps = 0, processes = 1;
  bool has_val = false, has_comm = true;
  for (const Json& j : read_metrics(run_dir)) {
    if (j.contains("val_loss")) f.val_loss = number(j, "val_loss"), has_val = true;
    if (!j.contains("step_time_s") || number(j, "step") <= static_cast<double>(warmup)) continue;
    const double dt = number(j, "step_time_s");
    ++timed;
    seconds += dt;
    const double step_samples = number(j, "tokens_per_s") * dt / static_cast<double>(seq_len);
    samples += step_samples;
    double dropped = 0;
    auto drop = j.find("dropped_fraction");
    if (drop != j.end() && drop->is_array() && !drop->empty()) {
      for (const Json& d : *drop) dropped += d.is_number() ? d.get<double>() : 0.0;
      dropped /= static_cast<double>(drop->size());
    }
    kept += step_samples * (1.0 - dropped);
    exposed += number(j, "comm_efficiency");
    has_comm = has_comm && j.contains("compute_s") && j.contains("comm_total_s");
    const double compute = number(j, "compute_s"), comm = number(j, "comm_total_s");
    all_comm += compute + comm > 0 ? compute / (compute + comm) : 1.0;
    auto ranks = j.find("rank_step_time_s");
    if (ranks != j.end() && ranks->is_array() && !ranks->empty())
      processes = static_cast<int64_t>(ranks->size());
    auto tpe = j.find("tokens_per_expert");
    if (tpe == j.end() || !tpe->is_array() || tpe->empty()) continue;
    load.resize(std::max(load.size(), tpe->size()));
    double step_active = 0;
    for (std::size_t m = 0; m < tpe->size(); ++m) {
      const Json& layer = (*tpe)[m];
      load[m].resize(std::max(load[m].size(), layer.size()), 0.0);
      int64_t on = 0;
      for (std::size_t e = 0; e < layer.size(); ++e) {
        const double n = layer[e].get<double>();
        load[m][e] += n;
        on += n > 0;
      }
      if (!layer.empty()) step_active += static_cast<double>(on) / static_cast<double>(layer.size());
    }
    active += step_active / static_cast<double>(tpe->size());
    ++moe_steps;
  }
  MOETRAIN_CHECK(timed > 0 && seconds > 0, "{}: no timed step after the {} warm-up steps",
                 metrics.string(), warmup);
  MOETRAIN_CHECK(!load.empty(), "{}: no tokens_per_expert (a model without MoE layers?)",
                 metrics.string());
  MOETRAIN_CHECK(has_comm, "{}: a timed step has no compute_s or comm_total_s",
                 metrics.string());
  MOETRAIN_CHECK(has_val, "{}: no val_loss line (the run did not finish)", metrics.string());
  double balance = 0;
  for (const auto& l : load) {
    const double mx = l.empty() ? 0 : *std::max_element(l.begin(), l.end());
    double sum = 0;
    for (double v : l) sum += v;
    balance += mx > 0 ? sum / static_cast<double>(l.size()) / mx : 0.0;
  }
  const double steps = static_cast<double>(timed);
  f.utilisation = active / static_cast<double>(moe_steps);
  f.load_balance = balance / static_cast<double>(load.size());
  f.comm_efficiency = all_comm / steps;
  f.comm_efficiency_exposed = exposed / steps;
  f.samples_per_s = samples / seconds;
  f.kept_samples_per_s = kept / seconds;
  f.training_efficiency = f.samples_per_s * f.utilisation / static_cast<double>(processes);
  return f;
}

void finish_ablation_rows(std::vector<AblationRow>& rows) {
  for (AblationRow& r : rows)
    for (const Column& c : kColumns) {
      std::vector<double> v;
      for (const AblationFigures& f : r.runs) v.push_back(f.*c.field);
      r.median.*c.field = median(std::move(v));
    }
  if (rows.empty()) return;
  const AblationFigures base = rows.front().median;
  for (AblationRow& r : rows)
    for (const Column& c : kColumns)
      r.relative.*c.field = base.*c.field != 0 ? r.median.*c.field / base.*c.field : 0.0;
}

AblationTable read_ablation(const fs::path& dir, int64_t warmup) {
  const fs::path runs = dir / "runs";
  MOETRAIN_CHECK(fs::is_directory(runs), "{} is not a directory: no ablation runs in {}",
                 runs.string(), dir.string());
  AblationTable t;
  t.warmup = warmup;
  if (fs::exists(dir / "setup.txt")) t.setup = read_trimmed(dir / "setup.txt");
  std::vector<fs::path> row_dirs;
  for (const auto& e : fs::directory_iterator(runs))
    if (e.is_directory()) row_dirs.push_back(e.path());
  std::sort(row_dirs.begin(), row_dirs.end());
  MOETRAIN_CHECK(!row_dirs.empty(), "{} holds no row folders", runs.string());
  for (const fs::path& rd : row_dirs) {
    AblationRow row{rd.filename().string(), {}, {}, {}};
    std::vector<fs::path> run_dirs;
    for (const auto& e : fs::directory_iterator(rd))
      if (e.is_directory()) run_dirs.push_back(e.path());
    std::sort(run_dirs.begin(), run_dirs.end());
    MOETRAIN_CHECK(!run_dirs.empty(), "{} holds no run folders", rd.string());
    for (const fs::path& r : run_dirs) row.runs.push_back(ablation_run_figures(r, warmup));
    t.rows.push_back(std::move(row));
  }
  finish_ablation_rows(t.rows);
  return t;
}

std::string ablation_markdown(const AblationTable& t) {
  std::string md;
  if (!t.setup.empty()) md += t.setup + "\n\n";
  const std::size_t n = t.rows.empty() ? 0 : t.rows.front().runs.size();
  md += fmt::format(
      "Medians of {} run(s) per row, timed steps after {} warm-up step(s); (×r) = relative to "
      "row {}.\n\n",
      n, t.warmup, t.rows.empty() ? "" : t.rows.front().name);
  md += "| row | runs |";
  for (const Column& c : kColumns) md += fmt::format(" {} |", c.label);
  md += "\n|---|---:|";
  for (std::size_t i = 0; i < std::size(kColumns); ++i) md += "---:|";
  md += "\n";
  for (const AblationRow& r : t.rows) {
    md += fmt::format("| {} | {} |", r.name, r.runs.size());
    for (const Column& c : kColumns) {
      const double v = r.median.*c.field;
      const bool rate = c.field == &AblationFigures::samples_per_s ||
                        c.field == &AblationFigures::kept_samples_per_s ||
                        c.field == &AblationFigures::training_efficiency;
      md += rate ? fmt::format(" {:.2f}", v) : fmt::format(" {:.3f}", v);
      md += fmt::format(" (×{:.2f}) |", r.relative.*c.field);
    }
    md += "\n";
  }
  return md;
}

Json ablation_json(const AblationTable& t) {
  Json rows = Json::array();
  for (const AblationRow& r : t.rows) {
    Json runs = Json::array();
    for (const AblationFigures& f : r.runs) runs.push_back(figures_json(f));
    rows.push_back({{"name", r.name},
                    {"runs", runs},
                    {"median", figures_json(r.median)},
                    {"relative", figures_json(r.relative)}});
  }
  return {{"setup", t.setup}, {"warmup", t.warmup}, {"rows", rows}};
}

std::string ablation_svg(const AblationTable& t) {
  std::vector<Series> series;
  for (const Column& c : kColumns) {
    Series s{c.label, {}, {}};
    for (std::size_t i = 0; i < t.rows.size(); ++i) {
      s.x.push_back(static_cast<double>(i + 1));
      s.y.push_back(t.rows[i].relative.*c.field);
    }
    series.push_back(std::move(s));
  }
  std::string x_label = "row:";
  for (std::size_t i = 0; i < t.rows.size(); ++i) x_label += fmt::format(" {}", t.rows[i].name);
  std::string svg =
      line_chart(series, {.x_label = x_label, .y_label = "relative to the baseline (row 1)"});
  MOETRAIN_CHECK(!svg.empty(), "ablation chart: no row has a finite figure");
  // The report's stylesheet, inlined: this chart is a file of its own.
  const std::size_t open_end = svg.find('>') + 1;
  svg.insert(open_end,
             "\n<style>.plot{fill:#fcfcfc;stroke:#999}.grid{stroke:#e4e4e4}"
             ".tick{font:11px sans-serif;fill:#444}.axis-label{font:12px sans-serif;fill:#222}"
             ".legend{font:11px sans-serif}text{font-family:sans-serif}</style>");
  return "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n" + svg;
}

fs::path write_ablation(const fs::path& dir, int64_t warmup) {
  const AblationTable t = read_ablation(dir, warmup);
  const fs::path md = dir / "table.md";
  write_file_atomic(md, ablation_markdown(t));
  write_file_atomic(dir / "table.json", ablation_json(t).dump(2) + "\n");
  write_file_atomic(dir / "ablation.svg", ablation_svg(t));
  return md;
}

}  // namespace moetrain
