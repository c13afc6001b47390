// The run report built from run directories written here: one section per chart, the expected
// points in each curve, escaped text, and runs that are missing, empty, torn or still going.
#include "io/report.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "support/expect_error.h"
#include "support/report_defaults.h"
#include "support/temp_dir.h"
#include "train/run_config.h"

namespace moetrain {
namespace {

namespace fs = std::filesystem;
using testing::report_defaults;
using testing::TempDir;

std::size_t count(const std::string& text, const std::string& needle) {
  std::size_t n = 0;
  for (auto p = text.find(needle); p != std::string::npos; p = text.find(needle, p + 1)) ++n;
  return n;
}

// The <section> with this id ("" when there is none).
std::string section(const std::string& html, const std::string& id) {
  const auto start = html.find("<section id=\"" + id + "\">");
  if (start == std::string::npos) return {};
  return html.substr(start, html.find("</section>", start) - start);
}

// Number of points of each polyline of a section, in order.
std::vector<std::size_t> polyline_points(const std::string& sec) {
  std::vector<std::size_t> out;
  for (auto p = sec.find("<polyline"); p != std::string::npos; p = sec.find("<polyline", p + 1)) {
    const auto a = sec.find("points=\"", p) + 8;
    const std::string pts = sec.substr(a, sec.find('"', a) - a);
    out.push_back(count(pts, ","));
  }
  return out;
}

// Five training steps of a two-layer, three-expert model, validation at steps 2 and 4.
std::string metrics_lines(int steps = 5) {
  std::string out;
  for (int s = 1; s <= steps; ++s) {
    nlohmann::json j = {{"step", s},
                        {"loss", 5.0 - 0.5 * s},
                        {"ce", 4.9},
                        {"aux", 0.01},
                        {"lr", 1e-3 * s},
                        {"grad_norm", 2.0 / s},
                        {"tokens_per_s", 1000.0 + s},
                        {"compute_s", 0.1},
                        {"step_time_s", 0.1},
                        {"comm_exposed_s", 0.01},
                        {"comm_total_s", 0.05},
                        {"imbalance", 1.2},
                        {"rss_bytes", (300 + s) << 20},
                        {"peak_rss_bytes", (310 + s) << 20},
                        {"peak_rss_bytes_max", (320 + s) << 20},
                        {"dropped_fraction", {0.0, 0.1 * s}},
                        {"tokens_per_expert", {{10, 20, 30}, {0, 30, 30 + s}}}};
    out += j.dump() + "\n";
    if (s % 2 == 0) out += nlohmann::json{{"step", s}, {"val_loss", 4.0 - 0.1 * s}}.dump() + "\n";
  }
  return out;
}

// As `train` writes them: config.json at the start, then the metrics.
void write_run(const TempDir& dir, const std::string& metrics, int64_t planned_steps = 5) {
  nlohmann::json config = {{"model", {{"n_experts", 3}, {"name", "<script>alert(1)</script>"}}},
                           {"train", {{"steps", planned_steps}, {"run_dir", "runs/x"}}}};
  dir.write("run_config.json", config.dump(2));
  dir.write("metrics.jsonl", metrics);
}

TEST(Report, OneSectionPerChartWithEveryPoint) {
  TempDir dir("report");
  write_run(dir, metrics_lines());
  dir.write("checkpoints/step_00000004/model.safetensors", std::string(10, 'x'));
  dir.write("checkpoints/step_00000004/config.json", std::string(20, 'y'));
  dir.write("sample.txt", "Fortune <b>& \"cookie\"");
  const std::string html = render_report(dir.path(), report_defaults());

  EXPECT_EQ(count(html, "<svg class=\"chart\""), 10u);
  for (const char* id : {"loss", "grad-norm", "lr", "throughput", "expert-load",
                         "expert-load-steps", "imbalance", "utilisation", "time", "memory"}) {
    const std::string sec = section(html, id);
    ASSERT_FALSE(sec.empty()) << id;
    EXPECT_EQ(count(sec, "<h2>"), 1u) << id;
    EXPECT_EQ(count(sec, "<svg class=\"chart\""), 1u) << id;
  }
  EXPECT_EQ(polyline_points(section(html, "loss")), (std::vector<std::size_t>{5, 2}));
  EXPECT_EQ(polyline_points(section(html, "lr")), (std::vector<std::size_t>{5}));
  EXPECT_EQ(polyline_points(section(html, "grad-norm")), (std::vector<std::size_t>{5}));
  EXPECT_EQ(polyline_points(section(html, "throughput")), (std::vector<std::size_t>{5}));
  EXPECT_EQ(polyline_points(section(html, "imbalance")), (std::vector<std::size_t>{5, 5}));
  EXPECT_EQ(polyline_points(section(html, "utilisation")), (std::vector<std::size_t>{5, 5}));
  EXPECT_EQ(polyline_points(section(html, "time")), (std::vector<std::size_t>{5, 5, 5}));
  EXPECT_EQ(polyline_points(section(html, "memory")), (std::vector<std::size_t>{5, 5, 5}));
  // The summary: the last step's largest peak.
  EXPECT_NE(html.find("<tr><td>peak resident memory per rank (step 5)</td><td>325.0 MiB (the "
                      "largest rank&#39;s VmHWM)</td></tr>"),
            std::string::npos);
  // Heatmap cells carry a <title>: layers × experts, and (layer, expert) × steps.
  EXPECT_EQ(count(section(html, "expert-load"), "<title>"), 6u);
  EXPECT_EQ(count(section(html, "expert-load-steps"), "<title>"), 30u);
  // Legends where there are several series.
  EXPECT_NE(section(html, "loss").find("validation loss"), std::string::npos);
  EXPECT_NE(section(html, "time").find("exposed communication"), std::string::npos);
  EXPECT_NE(section(html, "time").find("communication (all-to-all and gradients)"),
            std::string::npos);
  EXPECT_EQ(section(html, "lr").find("class=\"legend\""), std::string::npos);

  const std::string ckpt = section(html, "checkpoints");
  EXPECT_NE(ckpt.find("<td class=\"num\">4</td><td>step_00000004</td><td class=\"num\">2</td>"
                      "<td class=\"num\">30 B</td>"),
            std::string::npos)
      << ckpt;
  EXPECT_NE(section(html, "config").find("model.n_experts"), std::string::npos);
  // Text from the run is escaped, never markup.
  EXPECT_EQ(html.find("<script>"), std::string::npos);
  EXPECT_NE(html.find("&lt;script&gt;alert(1)&lt;/script&gt;"), std::string::npos);
  EXPECT_NE(section(html, "sample").find("Fortune &lt;b&gt;&amp; &quot;cookie&quot;"),
            std::string::npos);
  EXPECT_EQ(html.find("http://"), html.find("http://www.w3.org/2000/svg"));  // nothing fetched
  EXPECT_EQ(html.find("https://"), std::string::npos);
}

TEST(Report, WritesRunDirReportByDefault) {
  TempDir dir("report");
  write_run(dir, metrics_lines());
  EXPECT_EQ(write_report(dir.path(), report_defaults()), dir.path() / "report.html");
  EXPECT_TRUE(fs::is_regular_file(dir.path() / "report.html"));
  const fs::path out = dir.path() / "elsewhere.html";
  EXPECT_EQ(write_report(dir.path(), report_defaults(), out), out);
  EXPECT_GT(fs::file_size(out), 1000u);
}

TEST(Report, MissingDirectoryIsAnErrorNamingIt) {
  TempDir dir("report");
  const fs::path missing = dir.path() / "no_such_run";
  testing::expect_error([&] { render_report(missing, report_defaults()); },
                        {"no_such_run", "does not exist"});
  EXPECT_FALSE(fs::exists(missing / "report.html"));
}

TEST(Report, EmptyRunDirectoryNamesWhatIsMissing) {
  TempDir dir("report");
  std::string html = render_report(dir.path(), report_defaults());
  EXPECT_NE(html.find("metrics.jsonl does not exist"), std::string::npos);
  EXPECT_NE(html.find("config.json does not exist"), std::string::npos);
  EXPECT_EQ(count(html, "<svg class=\"chart\""), 0u);
  EXPECT_EQ(count(html, "<section"), 12u);  // each chart says it has no data yet

  dir.write("metrics.jsonl", "");
  html = render_report(dir.path(), report_defaults());
  EXPECT_NE(html.find("metrics.jsonl is empty"), std::string::npos);
}

TEST(Report, TornLastLineAndRunInProgress) {
  TempDir dir("report");
  write_run(dir, metrics_lines() + R"({"step": 6, "loss": 2.)", 100);
  const std::string html = render_report(dir.path(), report_defaults());
  EXPECT_NE(html.find("1 of 8 lines are not complete JSON"), std::string::npos);
  EXPECT_NE(html.find("5 of 100 (in progress or stopped)"), std::string::npos);
  EXPECT_EQ(polyline_points(section(html, "loss")), (std::vector<std::size_t>{5, 2}));
}

TEST(Report, MalformedValuesAndConfigAreLeftOut) {
  TempDir dir("report");
  dir.write(
      "metrics.jsonl",
      R"({"step": 1, "loss": null, "lr": "fast", "tokens_per_expert": "many", "dropped_fraction": 3})"
      "\n"
      R"({"step": 2, "loss": 1.5, "tokens_per_expert": [[1, "x"], 7]})"
      "\n[1, 2]\n");
  dir.write("config.json", "{\"model\": ");
  const std::string html = render_report(dir.path(), report_defaults());
  EXPECT_NE(html.find("config.json is not a JSON object"), std::string::npos);
  EXPECT_NE(html.find("1 of 3 lines are not complete JSON"), std::string::npos);
  // One finite loss point: a marker, not a line.
  EXPECT_EQ(count(section(html, "loss"), "<circle"), 1u);
  EXPECT_EQ(count(section(html, "expert-load"), "<svg"), 0u);
}

TEST(Report, LongRunsAreThinned) {
  TempDir dir("report");
  write_run(dir, metrics_lines(4000), 4000);
  const std::string html = render_report(dir.path(), report_defaults());
  EXPECT_EQ(polyline_points(section(html, "lr")), (std::vector<std::size_t>{1500}));
  // Steps are averaged into at most 120 columns per heatmap row.
  EXPECT_EQ(count(section(html, "expert-load-steps"), "<title>"), 6u * 120u);
}

// A capability re-split of two worker groups as the scheduler records it (ps/job_plan.h).
const std::string kAssignDecision =
    R"({"decision": "assign", "clock": 12, "cause": "measured throughput", "time": 2.5, )"
    R"("groups": [{"group": 0, "workers": [0, 1], "throughput": 812.26, "rows": 20}, )"
    R"({"group": 1, "workers": [2, 3], "throughput": 270.5, "rows": 12}]})";

// The per-process files of a parameter-server job launched under `moetrain launch`, each ending
// in a torn line, and per-rank step times in metrics.jsonl.
void write_job_files(const TempDir& dir) {
  std::string rank_lines;
  for (int s = 1; s <= 4; ++s)
    rank_lines += nlohmann::json{{"step", s}, {"rank_step_time_s", {0.1, 0.3, 0.1}}}.dump() + "\n";
  write_run(dir, metrics_lines() + rank_lines);
  for (int w = 0; w < 2; ++w) {
    std::string lines;
    for (int s = 1; s <= 3; ++s)
      lines +=
          nlohmann::json{{"step", s}, {"rows_per_s", 10.0 * (w + 1)}, {"staleness", w}}.dump() +
          "\n";
    dir.write("metrics/worker_" + std::to_string(w) + ".jsonl", lines + R"({"step": 4, "ro)");
  }
  std::string server;
  for (int s = 1; s <= 4; ++s)
    server +=
        nlohmann::json{{"step", s}, {"updates", s}, {"updates_per_s", 5.0}, {"pending", 0}}.dump() +
        "\n";
  dir.write("metrics/server_0.jsonl", server);
  dir.write("metrics/scheduler.jsonl",
            nlohmann::json{{"event", "job_start"}, {"time", 1.0}}.dump() + "\n" +
                nlohmann::json{{"event", "worker_lost"},
                               {"time", 2.0},
                               {"role", "worker"},
                               {"index", 1},
                               {"cause", "no heartbeat for 3.0 s <x>"}}
                    .dump() +
                "\n" + kAssignDecision + "\n{\"event\": \"job_comp");
  dir.write(
      "metrics/launcher.jsonl",
      nlohmann::json{
          {"event", "attempt_failed"}, {"time", 1.5}, {"attempt", 1}, {"cause", "exit code 137"}}
              .dump() +
          "\n");
}

TEST(Report, JobFilesGiveWorkerServerAndEventSections) {
  TempDir dir("report");
  write_job_files(dir);
  const std::string html = render_report(dir.path(), report_defaults());
  for (const char* id : {"rank-time", "rank-straggler", "workers", "worker-staleness", "servers",
                         "server-pending"}) {
    const std::string sec = section(html, id);
    ASSERT_FALSE(sec.empty()) << id;
    EXPECT_EQ(count(sec, "<svg class=\"chart\""), 1u) << id;
  }
  EXPECT_EQ(polyline_points(section(html, "rank-time")), (std::vector<std::size_t>{4, 4, 4}));
  EXPECT_EQ(polyline_points(section(html, "rank-straggler")), (std::vector<std::size_t>{4}));
  EXPECT_EQ(polyline_points(section(html, "workers")), (std::vector<std::size_t>{3, 3}));
  EXPECT_NE(section(html, "workers").find("worker_1"), std::string::npos);
  EXPECT_EQ(polyline_points(section(html, "servers")), (std::vector<std::size_t>{4}));
  const std::string events = section(html, "events");
  ASSERT_FALSE(events.empty());
  // In time order, the torn line left out, causes escaped.
  EXPECT_EQ(count(events, "<tr>"), 4u);  // header + 3 events
  const auto start = events.find("job_start"), failed = events.find("attempt_failed"),
             lost = events.find("worker_lost");
  EXPECT_LT(start, failed);
  EXPECT_LT(failed, lost);
  EXPECT_NE(events.find("exit code 137"), std::string::npos);
  EXPECT_NE(events.find("no heartbeat for 3.0 s &lt;x&gt;"), std::string::npos);
}

// The scheduler's decisions get a table of their own: the clock a re-split applies from, each
// group's rows and measured throughput, the cause; the events table does not list them.
TEST(Report, SchedulerDecisionsAreListedWithTheirCauses) {
  TempDir dir("report");
  write_job_files(dir);
  const std::string html = render_report(dir.path(), report_defaults());
  const std::string sec = section(html, "decisions");
  ASSERT_FALSE(sec.empty()) << html;
  EXPECT_EQ(count(sec, "<tr>"), 2u);  // header + 1 decision
  EXPECT_NE(sec.find("<td>12</td><td>assign</td>"), std::string::npos) << sec;
  EXPECT_NE(sec.find("group 0 (workers 0, 1): 20 rows at 812.3 rows/s; group 1 (workers 2, 3): "
                     "12 rows at 270.5 rows/s"),
            std::string::npos)
      << sec;
  EXPECT_NE(sec.find("measured throughput"), std::string::npos);
  EXPECT_EQ(section(html, "events").find("assign"), std::string::npos);
}

TEST(Report, WithoutJobFilesThoseSectionsAreLeftOut) {
  TempDir dir("report");
  write_run(dir, metrics_lines());
  dir.write("metrics/notes.txt", "not metrics");
  const std::string html = render_report(dir.path(), report_defaults());
  for (const char* id : {"rank-time", "rank-straggler", "workers", "worker-staleness", "servers",
                         "server-pending", "events"})
    EXPECT_EQ(html.find(std::string("<section id=\"") + id + "\""), std::string::npos) << id;
}

// The y-axis label of the chart of a section.
std::string y_label(const std::string& sec) {
  const auto rotated = sec.find("rotate(-90");
  if (rotated == std::string::npos) return {};
  const auto a = sec.find('>', rotated) + 1;
  return sec.substr(a, sec.find('<', a) - a);
}

TEST(Report, AxesCarryUnitsAndValidationIsMarkedOnTop) {
  TempDir dir("report");
  write_run(dir, metrics_lines());
  const std::string html = render_report(dir.path(), report_defaults());
  // As `train` prints the loss.
  EXPECT_EQ(y_label(section(html, "loss")), "loss (nats/byte)");
  EXPECT_EQ(y_label(section(html, "throughput")), "tokens/s");
  EXPECT_EQ(y_label(section(html, "time")), "time (s)");
  EXPECT_EQ(y_label(section(html, "grad-norm")), "L2 norm");
  EXPECT_EQ(y_label(section(html, "imbalance")), "ratio (max / mean)");
  EXPECT_NE(section(html, "loss").find("<h2>Loss (nats/byte)</h2>"), std::string::npos);
  // Two evaluations: a marker on each, drawn after (above) the training curve.
  const std::string loss = section(html, "loss");
  EXPECT_EQ(count(loss, "class=\"marker\""), 2u);
  EXPECT_LT(loss.find("data-series=\"train loss\""), loss.find("class=\"marker\""));
  EXPECT_NE(html.find("last val_loss (step 4)</td><td>3.6 nats/byte"), std::string::npos);
}

TEST(Report, HeaderNamesVersionLayoutDeviceAndTimes) {
  TempDir dir("report");
  write_run(dir, metrics_lines());
  dir.write(
      "checkpoints/step_00000004/trainer_state.json",
      R"({"step": 4, "layout": {"processes": 4, "dp": 2, "ep": 2, "zero": 0, "grad_accum": 1}})");
  const std::string html = render_report(dir.path(), report_defaults());
  const auto start = html.find("<table class=\"header\" id=\"run-header\">");
  ASSERT_NE(start, std::string::npos);
  const std::string header = html.substr(start, html.find("</table>", start) - start);
  EXPECT_NE(header.find(std::string("<td>") + MOETRAIN_VERSION), std::string::npos) << header;
  EXPECT_NE(header.find("byte-level language model"), std::string::npos);
  EXPECT_NE(header.find("4 process(es), dp 2, ep 2, zero 0, grad_accum 1"), std::string::npos);
  for (const char* row : {"<th>device</th><td>cpu</td>", "<th>CPU</th>", "<th>started</th>",
                          "<th>wall time</th>", "<th>time in steps</th><td>0.5 s</td>"})
    EXPECT_NE(header.find(row), std::string::npos) << row << "\n" << header;
  EXPECT_LT(start, html.find("<section"));  // at the top
  // A checkpoint names what wrote it: the program's commit and the machine that trained.
  dir.write("checkpoints/step_00000004/trainer_state.json",
            R"({"step": 4, "written_by": {"moetrain": "0.1.0", "commit": "0123456789ab",
                "cpu": "Training CPU 9000", "host": "node7"}})");
  const std::string by = render_report(dir.path(), report_defaults());
  EXPECT_NE(by.find("<th>moetrain</th><td>0.1.0 (commit 0123456789ab)</td>"), std::string::npos)
      << by.substr(0, 3000);
  EXPECT_NE(by.find("<th>CPU</th><td>Training CPU 9000 (host node7)</td>"), std::string::npos);
}

TEST(Report, ConfigHighlightsValuesThatDifferFromTheSchemaDefaults) {
  TempDir dir("report");
  nlohmann::json config = RunConfig{}.to_json();
  const nlohmann::json default_lr = config["optim"]["lr"];
  config["model"]["n_experts"] = config["model"]["n_experts"].get<int64_t>() * 2;
  dir.write("run_config.json", config.dump(2));
  dir.write("metrics.jsonl", metrics_lines());
  const std::string sec = section(render_report(dir.path(), report_defaults()), "config");
  EXPECT_NE(
      sec.find(fmt::format("<tr class=\"changed\"><td>model.n_experts</td><td>{}</td><td>{}</td>",
                           config["model"]["n_experts"].dump(),
                           RunConfig{}.to_json()["model"]["n_experts"].dump())),
      std::string::npos)
      << sec;
  EXPECT_NE(
      sec.find(fmt::format("<tr><td>optim.lr</td><td>{0}</td><td>{0}</td>", default_lr.dump())),
      std::string::npos)
      << sec;
  EXPECT_EQ(count(sec, "class=\"changed\""), 1u);
  EXPECT_NE(sec.find("1 of "), std::string::npos);
}

// A `moetrain ps launch` run directory as the job leaves it: server 0's metrics.jsonl (one line per
// update, and worker 0's final validation), the per-process files, the job's summaries and worker
// 0's checkpoint with the settings inside its config.json; no RUN_DIR/run_config.json.
void write_ps_run(const TempDir& dir) {
  std::string lines;
  for (int s = 1; s <= 6; ++s)
    lines += nlohmann::json{{"step", s},   {"clock", s - 1}, {"loss", 5.0 - 0.2 * s}, {"lr", 1e-3},
                            {"pushes", 2}, {"rows", 8},      {"time", 1000.0 + s}}
                 .dump() +
             "\n";
  lines += nlohmann::json{{"step", 6}, {"val_loss", 4.1}}.dump() + "\n";
  dir.write("metrics.jsonl", lines);
  for (int w = 0; w < 2; ++w) {
    std::string wl;
    for (int s = 1; s <= 6; ++s)
      wl += nlohmann::json{{"step", s},           {"rows", 4},
                           {"rows_per_s", 100.0}, {"tokens_per_s", 3200.0 + w},
                           {"staleness", 0},      {"step_time_s", 0.04},
                           {"time", 1000.0 + s}}
                .dump() +
            "\n";
    dir.write("metrics/worker_" + std::to_string(w) + ".jsonl", wl);
    dir.write(
        "metrics/server_" + std::to_string(w) + ".jsonl",
        nlohmann::json{{"step", 1}, {"updates", 1}, {"pending", 0}}.dump() + "\n" +
            nlohmann::json{{"step", 2}, {"updates", 2}, {"updates_per_s", 30.0}, {"pending", 0}}
                .dump() +
            "\n");
    // Server 0 holds layer 0's experts, server 1 layer 1's.
    std::vector<int> contributors(8, 0);
    for (int e = 0; e < 4; ++e) contributors[static_cast<std::size_t>(4 * w + e)] = 12 - e;
    dir.write(
        "ps/server_" + std::to_string(w) + ".json",
        nlohmann::json{{"index", w}, {"updates", 6}, {"expert_contributors", contributors}}.dump());
  }
  dir.write("metrics/scheduler.jsonl",
            nlohmann::json{{"event", "job_start"}, {"time", 999.5}}.dump() + "\n" +
                nlohmann::json{{"event", "job_complete"}, {"time", 1007.0}}.dump() + "\n");
  dir.write(
      "ps/job.json",
      R"({"servers": [{"index": 0}, {"index": 1}], "workers": [{"index": 0}, {"index": 1}]})");
  nlohmann::json settings = RunConfig{}.to_json();
  settings["model"]["n_layers"] = 2;
  settings["model"]["n_experts"] = 4;
  settings["train"]["steps"] = 6;
  dir.write("checkpoints/step_00000006/config.json",
            nlohmann::json{{"model_type", "mixtral"}, {"moetrain", settings}}.dump());
  dir.write(
      "checkpoints/step_00000006/trainer_state.json",
      R"({"step": 6, "parameter_server": {"servers": 2, "workers": 2, "consistency": "sync"}})");
}

TEST(Report, ParameterServerRunFillsItsSectionsFromThePerProcessFiles) {
  TempDir dir("report");
  write_ps_run(dir);
  const std::string html = render_report(dir.path(), report_defaults());
  EXPECT_EQ(html.find("does not exist"), std::string::npos) << html.substr(0, 3000);
  EXPECT_NE(
      html.find("recorded in " + (dir.path() / "checkpoints/step_00000006/config.json").string()),
      std::string::npos);
  EXPECT_NE(html.find("parameter server: 2 server(s), 2 worker(s), sync consistency"),
            std::string::npos);
  EXPECT_NE(html.find("<th>wall time</th><td>7.5 s"), std::string::npos);
  EXPECT_NE(html.find("6 of 6"), std::string::npos);  // the planned steps, from the checkpoint
  EXPECT_EQ(polyline_points(section(html, "loss")), (std::vector<std::size_t>{6}));
  EXPECT_EQ(count(section(html, "loss"), "class=\"marker\""), 1u);  // the one validation
  // Per worker and all workers, from RUN_DIR/metrics/worker_I.jsonl.
  EXPECT_EQ(polyline_points(section(html, "throughput")), (std::vector<std::size_t>{6, 6, 6}));
  EXPECT_NE(section(html, "throughput").find("all workers"), std::string::npos);
  EXPECT_EQ(y_label(section(html, "throughput")), "tokens/s");
  EXPECT_EQ(polyline_points(section(html, "time")), (std::vector<std::size_t>{6, 6}));
  EXPECT_EQ(y_label(section(html, "time")), "time (s)");
  // The servers' pushes per expert: 2 layers × 4 experts.
  EXPECT_EQ(count(section(html, "expert-load"), "<title>"), 8u);
  EXPECT_NE(section(html, "expert-load-steps").find("records no per-step expert load"),
            std::string::npos);
  EXPECT_NE(section(html, "config").find("<tr class=\"changed\"><td>model.n_layers</td>"),
            std::string::npos);
  for (const char* id :
       {"workers", "worker-staleness", "servers", "server-pending", "events", "checkpoints"})
    EXPECT_FALSE(section(html, id).empty()) << id;
  EXPECT_NE(html.find("last tokens_per_s, all workers (step 6)</td><td>6401 tokens/s"),
            std::string::npos);
}

}  // namespace
}  // namespace moetrain
