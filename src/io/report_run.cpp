#include "io/report_run.h"

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <fmt/format.h>

#include "core/build_info.h"
#include "io/metrics.h"
#include "io/report_jobs.h"
#include "io/svg_chart.h"

namespace moetrain {
namespace fs = std::filesystem;
namespace {

using Json = nlohmann::json;

Json read_json(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return nullptr;
  std::ostringstream ss;
  ss << in.rdbuf();
  Json j = Json::parse(ss.str(), nullptr, false);
  return j.is_discarded() ? Json(nullptr) : j;
}

void flatten(const Json& j, const std::string& prefix, std::map<std::string, Json>& out) {
  if (j.is_object() && !j.empty()) {
    for (auto it = j.begin(); it != j.end(); ++it)
      flatten(it.value(), prefix.empty() ? it.key() : prefix + "." + it.key(), out);
    return;
  }
  out.emplace(prefix, j);
}

std::string text(const Json& j) {
  return j.is_string() ? j.get<std::string>() : j.dump();
}

// Checkpoint directories step_N, newest first.
std::vector<fs::path> checkpoints_newest_first(const fs::path& run_dir) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  for (fs::directory_iterator it(run_dir / "checkpoints", ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (!name.starts_with("step_") || !it->is_directory(ec)) continue;
    const std::string digits = name.substr(5);
    if (digits.empty() || digits.size() > 18 ||
        digits.find_first_not_of("0123456789") != std::string::npos)
      continue;
    found.emplace_back(std::stoll(digits), it->path());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a > b; });
  std::vector<fs::path> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

// How many flattened keys of `config` the defaults also have.
std::size_t shared_keys(const Json& config, const Json& defaults) {
  std::map<std::string, Json> a, b;
  flatten(config, "", a);
  flatten(defaults, "", b);
  std::size_t n = 0;
  for (const auto& kv : a) n += b.contains(kv.first);
  return n;
}

double mtime_seconds(const fs::path& p) {
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) return NAN;
  return static_cast<double>(st.st_mtim.tv_sec) + 1e-9 * static_cast<double>(st.st_mtim.tv_nsec);
}

std::string utc(double seconds) {
  const std::time_t t = static_cast<std::time_t>(seconds);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

std::string duration(double s) {
  if (s < 120) return fmt::format("{:.1f} s", s);
  const auto total = static_cast<int64_t>(std::llround(s));
  if (total < 3600) return fmt::format("{} min {} s", total / 60, total % 60);
  return fmt::format("{} h {} min", total / 3600, total % 3600 / 60);
}

std::string layout_text(const RunFacts& f, const fs::path& run_dir,
                        const std::vector<Json>& lines) {
  if (f.parameter_server) {
    Json ps =
        f.trainer_state.is_object() ? f.trainer_state.value("parameter_server", Json()) : Json();
    if (!ps.is_object()) {
      const Json job = read_json(run_dir / "ps" / "job.json");
      if (job.is_object() && job.contains("servers") && job.contains("workers") &&
          job["servers"].is_array() && job["workers"].is_array())
        ps = {{"servers", job["servers"].size()}, {"workers", job["workers"].size()}};
    }
    if (ps.is_object() && ps.contains("servers") && ps.contains("workers"))
      return fmt::format("parameter server: {} server(s), {} worker(s){}", text(ps["servers"]),
                         text(ps["workers"]),
                         ps.contains("consistency")
                             ? ", " + text(ps["consistency"]) + " consistency"
                             : std::string());
    return "parameter server (neither a checkpoint nor ps/job.json records how many processes)";
  }
  if (f.trainer_state.is_object())
    if (auto l = f.trainer_state.find("layout"); l != f.trainer_state.end() && l->is_object()) {
      std::string out = fmt::format("{} process(es)", text(l->value("processes", Json(1))));
      for (const char* k : {"dp", "ep", "zero", "grad_accum"})
        if (l->contains(k)) out += fmt::format(", {} {}", k, text((*l)[k]));
      return out;
    }
  for (auto it = lines.rbegin(); it != lines.rend(); ++it)
    if (auto r = it->find("rank_step_time_s"); r != it->end() && r->is_array())
      return fmt::format("{} processes (no checkpoint records the layout)", r->size());
  return "1 process (no checkpoint records the layout)";
}

}  // namespace

RunFacts read_run_facts(const fs::path& run_dir, const SettingDefaults& defaults) {
  RunFacts f;
  std::error_code ec;
  f.parameter_server = fs::is_directory(run_dir / "ps", ec) ||
                       fs::exists(run_dir / kRoleMetricsDir / "worker_0.jsonl", ec);
  const auto ckpts = checkpoints_newest_first(run_dir);
  for (const fs::path& c : ckpts) {
    const Json state = read_json(c / "trainer_state.json");
    if (!state.is_object()) continue;
    f.checkpoint = c;
    f.trainer_state = state;
    break;
  }
  const fs::path own = run_config_file(run_dir);
  if (fs::exists(own, ec)) {
    f.config = read_json(own);
    f.config_source = own.string();
    if (!f.config.is_object()) {
      f.notes.push_back(
          fmt::format("{} is not a JSON object; the config is left out", own.string()));
      f.config = nullptr;
    }
  } else {
    for (const fs::path& c : ckpts) {
      const Json j = read_json(c / "config.json");
      if (!j.is_object() || !j.contains("moetrain") || !j["moetrain"].is_object()) continue;
      f.config = j["moetrain"];
      f.config_source = (c / "config.json").string();
      f.notes.push_back(
          fmt::format("the settings are those recorded in {} ({} writes no RUN_DIR/run_config.json)",
                      f.config_source, f.parameter_server ? "a parameter-server job" : "this run"));
      break;
    }
    if (f.config.is_null())
      f.notes.push_back(
          fmt::format("no settings: {} does not exist and no checkpoint in {} records a config",
                      own.string(), (run_dir / "checkpoints").string()));
  }
  // The kind whose schema knows more of the recorded keys.
  const Json &lm = defaults.language_model, &classifier = defaults.classifier;
  f.kind = f.config.is_object() && shared_keys(f.config, classifier) > shared_keys(f.config, lm)
               ? RunKind::Classifier
               : RunKind::LanguageModel;
  f.defaults = f.kind == RunKind::Classifier ? classifier : lm;
  return f;
}

std::string loss_unit(const RunFacts& facts) {
  return facts.kind == RunKind::Classifier ? "nats" : "nats/byte";
}

std::string run_header(const fs::path& run_dir, const RunFacts& f, const std::vector<Json>& lines) {
  std::string rows;
  auto row = [&](const std::string& k, const std::string& v) {
    rows += fmt::format("<tr><th>{}</th><td>{}</td></tr>\n", html_escape(k), html_escape(v));
  };
  // What wrote the newest checkpoint (trainer_state.json "written_by"): the program and the
  // machine that trained; runs without one name the report's own.
  const Json by = f.trainer_state.is_object() ? f.trainer_state.value("written_by", Json()) : Json();
  const bool recorded = by.is_object();
  auto by_field = [&](const char* k) { return by.value(k, std::string("unknown")); };
  row("moetrain", recorded ? fmt::format("{} (commit {})", by_field("moetrain"), by_field("commit"))
                           : fmt::format("{} (commit {}; the binary writing this report: the run "
                                         "records none)",
                                         build_version(), build_commit()));
  std::string kind =
      f.kind == RunKind::Classifier ? "image classifier" : "byte-level language model";
  if (f.parameter_server) kind += ", parameter-server job";
  row("run", kind);
  row("processes", layout_text(f, run_dir, lines));
  std::string device = "cpu";
  if (f.config.is_object() && f.config.contains("train") && f.config["train"].is_object())
    if (auto d = f.config["train"].find("device"); d != f.config["train"].end() && d->is_string())
      device = d->get<std::string>();
  row("device", device == "cuda" ? "cuda (GPU; its model is not recorded)" : device);
  row("CPU", recorded ? fmt::format("{} (host {})", by_field("cpu"), by_field("host"))
                      : host_cpu_model() + " (the machine writing this report: the run records "
                                           "none)");

  // Start: the run config's writing (the run's start) or the earliest time a metrics line carries;
  // end: the latest such time, or the last metrics line's writing.
  double start = mtime_seconds(run_config_file(run_dir)), end = NAN;
  auto take = [&](const std::vector<Json>& ls) {
    for (const Json& j : ls)
      if (auto t = j.find("time"); t != j.end() && t->is_number()) {
        const double v = t->get<double>();
        start = std::isnan(start) ? v : std::min(start, v);
        end = std::isnan(end) ? v : std::max(end, v);
      }
  };
  take(lines);
  for (const auto& [role, ls] : read_role_metrics(run_dir)) take(ls);
  // Lines without times (a trainer's): the last one was written when the file was.
  if (std::isnan(end)) end = mtime_seconds(run_dir / kMetricsFile);
  if (!std::isnan(start)) row("started", utc(start));
  if (!std::isnan(start) && !std::isnan(end) && end >= start)
    row("wall time", duration(end - start) + " (to the last metrics line)");
  double in_steps = 0;
  for (const Json& j : lines)
    if (auto t = j.find("step_time_s"); t != j.end() && t->is_number())
      in_steps += t->get<double>();
  if (in_steps > 0) row("time in steps", duration(in_steps));
  if (!f.config_source.empty()) row("settings", f.config_source);
  return "<table class=\"header\" id=\"run-header\">\n" + rows + "</table>\n";
}

std::string config_section(const RunFacts& f) {
  if (f.config.is_null()) return report_section("config", "Config", "", "no settings found");
  std::map<std::string, Json> values, defaults;
  flatten(f.config, "", values);
  flatten(f.defaults, "", defaults);
  std::size_t changed = 0;
  std::string rows;
  for (const auto& [k, v] : values) {
    auto d = defaults.find(k);
    const bool differs = d != defaults.end() && d->second != v;
    changed += differs;
    rows += fmt::format("<tr{}><td>{}</td><td>{}</td><td>{}</td></tr>\n",
                        differs ? " class=\"changed\"" : "", html_escape(k), html_escape(text(v)),
                        d == defaults.end() ? "" : html_escape(text(d->second)));
  }
  const std::string body =
      fmt::format("<p>{} of {} settings differ from the defaults (highlighted).</p>\n", changed,
                  values.size()) +
      "<table class=\"kv config\">\n<tr><th>key</th><th>value</th><th>default</th></tr>\n" + rows +
      "</table>\n";
  return report_section("config", "Config", body, "");
}

}  // namespace moetrain
