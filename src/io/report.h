// The run report: one self-contained HTML file (inline SVG and CSS, no script, nothing fetched)
// built from what a run directory holds: metrics.jsonl (read_metrics), config.json, the
// checkpoints and the demo's sample.txt. Not part of training; `moetrain report` writes it.
//
// It reports what is there: a run in progress, a metrics.jsonl that is empty or ends in a torn
// line, a missing config or no checkpoints each give a report with a note saying what is missing.
// Only a run directory that does not exist is an error.
#pragma once
#include <filesystem>
#include <string>

#include "io/report_run.h"

namespace moetrain {

// The file the demo saves its sample text to, shown at the end of the report.
inline constexpr const char* kSampleFile = "sample.txt";

// The report of `run_dir` as an HTML document; `defaults` are the settings' defaults the config
// table compares with.
std::string render_report(const std::filesystem::path& run_dir, const SettingDefaults& defaults);

// Writes render_report(run_dir, defaults) to `out` (atomically); an empty `out` means
// RUN_DIR/report.html. Returns the path written.
std::filesystem::path write_report(const std::filesystem::path& run_dir,
                                   const SettingDefaults& defaults,
                                   const std::filesystem::path& out = {});

}  // namespace moetrain
