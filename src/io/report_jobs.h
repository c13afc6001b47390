// The run report's per-process views (io/report.h): step time per rank (metrics.jsonl's
// rank_step_time_s), and for parameter-server and launched jobs the files in RUN_DIR/metrics
// (io/metrics.h): worker throughput and staleness, server apply rate, the restarts and failures
// with their causes. A view whose data is absent is left out, not shown empty.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include <map>

#include <nlohmann/json.hpp>

#include "io/svg_chart.h"

namespace moetrain {

// <section id="ID"><h2>TITLE</h2>BODY</section>, BODY replaced by the note when empty.
std::string report_section(const std::string& id, const std::string& title, const std::string& body,
                           const std::string& empty_note);

// "rank-time" (one line per rank) and "rank-straggler" (the slowest rank's time over the
// median); "" when no line has rank_step_time_s (one process).
std::string rank_time_section(const std::vector<nlohmann::json>& lines);

// "pipeline" from RUN_DIR/pipeline_trace.json (io/trace_events.h): each stage's passes drawn on
// one time axis, and each stage's busy and idle time with the step's idle share (the bubble); ""
// when the file is absent, a note naming what is wrong when it cannot be read.
std::string pipeline_section(const std::filesystem::path& run_dir);

// From RUN_DIR/metrics/*.jsonl: "workers" (rows/s) and "worker-staleness" per worker, "servers"
// (updates/s) and "server-pending" per server, "events" (the scheduler's and the launcher's
// lines with their causes); each "" when its files are absent.
std::string job_sections(const std::filesystem::path& run_dir);

// `key` of each worker's lines (roles "worker_I" of read_role_metrics, in index order), then,
// with more than one worker, "all workers": their sum at each step every one of them reported.
std::vector<Series> worker_series(const std::map<std::string, std::vector<nlohmann::json>>& roles,
                                  const char* key);

// The expert sections of a parameter-server run, whose lines carry no tokens_per_expert:
// "expert-load" from the servers' summaries (RUN_DIR/ps/server_I.json: the pushes that carried
// each expert's gradient over the run, layers × experts as the config's model.n_layers and
// model.n_experts say), the per-step views each with a note saying why they are empty.
std::string ps_expert_sections(const std::filesystem::path& run_dir, const nlohmann::json& config);

}  // namespace moetrain
