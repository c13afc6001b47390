// Timelines as Chrome trace-event JSON (the "JSON Object Format" of the Trace Event Format), the
// file Perfetto (ui.perfetto.dev) and chrome://tracing open: {"traceEvents": [...]} with one
// complete event ("ph": "X") per span — name, category, process, lane (the "tid"), start and
// duration in microseconds — and metadata events naming the processes and lanes. The pipeline's
// timeline (parallel/pipeline_trace.h: one lane per stage) is written in it by `moetrain plan
// --pp-trace` and read back by the run report (io/report.h), which draws the lanes and each lane's
// idle share.
#pragma once
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace moetrain {

// A pipeline run's recorded step in its run directory, read by the run report.
inline constexpr const char* kPipelineTraceFile = "pipeline_trace.json";

struct TraceSpan {
  std::string name;      // shown on the span: "F3" (forward of micro-batch 3), ...
  std::string category;  // what kind of work: the colour in the report and Perfetto's "cat"
  int64_t process = 0;   // "pid": a rank, or 0
  int64_t lane = 0;      // "tid": a pipeline stage, a thread
  double start_s = 0, duration_s = 0;
};

struct TraceFile {
  std::vector<TraceSpan> spans;
  std::map<int64_t, std::string> process_names;  // by process
  std::map<int64_t, std::string> lane_names;     // by lane (the same for every process)
};

// Writes `trace` to `path` atomically (its folder is created).
void write_trace(const std::filesystem::path& path, const TraceFile& trace);

// Reads a file write_trace wrote (complete events and the name metadata; other phases are
// skipped). An unreadable file, or one that is not a trace-event object, is an Error naming the
// file and what was expected.
TraceFile read_trace(const std::filesystem::path& path);

// Per lane over the span of the whole trace (first start to last end): seconds busy (its spans,
// overlaps counted once) and idle (the rest).
struct LaneTime {
  int64_t lane = 0;
  double busy_s = 0, idle_s = 0;
};
std::vector<LaneTime> lane_times(const std::vector<TraceSpan>& spans);

}  // namespace moetrain
