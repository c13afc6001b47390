// The run report's per-process views (io/report.h): step time per rank (metrics.jsonl's
// rank_step_time_s), and for parameter-server and launched jobs the files in RUN_DIR/metrics
// (io/metrics.h): worker throughput and staleness, server apply rate, the restarts and failures
// with their causes. A view whose data is absent is left out, not shown empty.
#pragma once
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace moetrain {

// <section id="ID"><h2>TITLE</h2>BODY</section>, BODY replaced by the note when empty.
std::string report_section(const std::string& id, const std::string& title, const std::string& body,
                           const std::string& empty_note);

// "rank-time" (one line per rank) and "rank-straggler" (the slowest rank's time over the
// median); "" when no line has rank_step_time_s (one process).
std::string rank_time_section(const std::vector<nlohmann::json>& lines);

// From RUN_DIR/metrics/*.jsonl: "workers" (rows/s) and "worker-staleness" per worker, "servers"
// (updates/s) and "server-pending" per server, "events" (the scheduler's and the launcher's
// lines with their causes); each "" when its files are absent.
std::string job_sections(const std::filesystem::path& run_dir);

}  // namespace moetrain
