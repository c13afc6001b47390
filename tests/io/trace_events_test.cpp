// Chrome trace-event files (io/trace_events.h): what is written reads back; busy and idle per lane
// by hand; a pipeline timeline's idle share in the file is the schedule's closed form; bad files
// are refused naming the file; the run report draws the file's lanes and their idle shares.
#include "io/trace_events.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "io/report.h"
#include "parallel/pipeline_trace.h"
#include "support/expect_error.h"
#include "support/report_defaults.h"
#include "support/temp_dir.h"

namespace moetrain {
namespace {

namespace fs = std::filesystem;
using testing::expect_error;
using testing::TempDir;

TEST(TraceEvents, WhatIsWrittenReadsBack) {
  TempDir tmp("trace_events");
  TraceFile t;
  t.process_names[0] = "a pipeline";
  t.lane_names = {{0, "stage 0"}, {1, "stage 1"}};
  t.spans = {{"F0", "forward", 0, 0, 0.0, 0.25}, {"F0", "forward", 0, 1, 0.25, 0.5},
             {"B0", "backward", 0, 1, 0.75, 1.0 / 3}};
  const fs::path file = tmp.path() / "sub" / "t.json";
  write_trace(file, t);
  // A Chrome trace-event object: Perfetto's importer needs exactly these fields.
  std::ifstream in(file);
  const nlohmann::json doc = nlohmann::json::parse(in);
  ASSERT_TRUE(doc["traceEvents"].is_array());
  int complete = 0;
  for (const auto& e : doc["traceEvents"])
    if (e["ph"] == "X") {
      ++complete;
      for (const char* key : {"name", "cat", "pid", "tid", "ts", "dur"}) EXPECT_TRUE(e.contains(key)) << e;
    }
  EXPECT_EQ(complete, 3);
  const TraceFile back = read_trace(file);
  ASSERT_EQ(back.spans.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(back.spans[i].name, t.spans[i].name);
    EXPECT_EQ(back.spans[i].category, t.spans[i].category);
    EXPECT_EQ(back.spans[i].lane, t.spans[i].lane);
    // Microseconds as JSON doubles: the conversion's rounding only.
    EXPECT_NEAR(back.spans[i].start_s, t.spans[i].start_s, 1e-15);
    EXPECT_NEAR(back.spans[i].duration_s, t.spans[i].duration_s, 1e-15);
  }
  EXPECT_EQ(back.process_names, t.process_names);
  EXPECT_EQ(back.lane_names, t.lane_names);
}

TEST(TraceEvents, LaneTimesCountOverlapsOnceAndTheRestAsIdle) {
  // The trace runs from 1 to 11. Lane 0: [1, 4) and [3, 6) overlap: busy 5, idle 5.
  // Lane 2: [2, 3) and [10, 11): busy 2, idle 8.
  const std::vector<TraceSpan> spans = {{"a", "x", 0, 0, 1, 3},
                                        {"b", "x", 0, 0, 3, 3},
                                        {"c", "x", 0, 2, 2, 1},
                                        {"d", "x", 0, 2, 10, 1}};
  const std::vector<LaneTime> lt = lane_times(spans);
  ASSERT_EQ(lt.size(), 2u);
  EXPECT_EQ(lt[0].lane, 0);
  EXPECT_DOUBLE_EQ(lt[0].busy_s, 5);
  EXPECT_DOUBLE_EQ(lt[0].idle_s, 5);
  EXPECT_EQ(lt[1].lane, 2);
  EXPECT_DOUBLE_EQ(lt[1].busy_s, 2);
  EXPECT_DOUBLE_EQ(lt[1].idle_s, 8);
  EXPECT_TRUE(lane_times({}).empty());
}

// 1F1B with equal passes and free sends: each stage idles (p − 1) pass pairs of the
// (m + p − 1) the step takes, in the trace as in the timeline it came from.
TEST(TraceEvents, APipelineTimelinesIdleShareIsTheSchedules) {
  const PipeShape shape{4, 8, 1};
  const PipeTimeline tl = simulate(PipeSchedule::OneFOneB, shape, {1, 1, 0, 0});
  const TraceFile t = pipeline_trace(tl, shape, "1f1b");
  EXPECT_EQ(t.spans.size(), 2u * 4 * 8);
  EXPECT_EQ(t.lane_names.at(3), "stage 3");
  double idle = 0, total = 0;
  for (const LaneTime& l : lane_times(t.spans)) idle += l.idle_s, total += l.busy_s + l.idle_s;
  EXPECT_NEAR(idle / total, 3.0 / 11.0, 1e-12);
  EXPECT_NEAR(idle / total, tl.bubble(), 1e-12);
  // Interleaved passes name their chunk; zero_bubble's weight passes are their own category.
  const PipeShape inter{2, 4, 2};
  const TraceFile ti =
      pipeline_trace(simulate(PipeSchedule::Interleaved, inter, {1, 1, 0, 0}), inter, "i");
  EXPECT_EQ(ti.spans.front().name, "F0.c0");
  const TraceFile tz =
      pipeline_trace(simulate(PipeSchedule::ZeroBubble, shape, {1, 1, 1, 0}), shape, "zb");
  int weights = 0;
  for (const TraceSpan& s : tz.spans) weights += s.category == "weight" && s.name[0] == 'W';
  EXPECT_EQ(weights, 4 * 8);
}

TEST(TraceEvents, BadFilesAreRefusedNamingTheFile) {
  TempDir tmp("trace_events_bad");
  const fs::path file = tmp.path() / "t.json";
  expect_error([&] { read_trace(file); }, {file.string(), "cannot read"});
  std::ofstream(file) << "[1, 2]";
  expect_error([&] { read_trace(file); }, {file.string(), "traceEvents"});
  std::ofstream(file) << R"({"traceEvents": [{"ph": "X", "name": "F0", "dur": 1}]})";
  expect_error([&] { read_trace(file); }, {file.string(), "traceEvents[0]"});
  std::ofstream(file) << R"({"traceEvents": [{"ph": "X", "name": "F0", "ts": 0, "dur": -1}]})";
  expect_error([&] { read_trace(file); }, {file.string(), "traceEvents[0]", "dur"});
}

// The run report draws RUN_DIR/pipeline_trace.json: one bar per pass, one row per stage, and a
// table of each stage's busy and idle time whose last row is the step's idle share.
TEST(TraceEvents, TheRunReportDrawsThePipelineTrace) {
  TempDir tmp("trace_report");
  const fs::path run = tmp.path() / "run";
  fs::create_directories(run);
  const std::string none = render_report(run, testing::report_defaults());
  EXPECT_EQ(none.find("<section id=\"pipeline\">"), std::string::npos);

  const PipeShape shape{4, 8, 1};
  write_trace(run / kPipelineTraceFile,
              pipeline_trace(simulate(PipeSchedule::OneFOneB, shape, {1, 1, 0, 0}), shape,
                             "1f1b on 4 stages"));
  const std::string html = render_report(run, testing::report_defaults());
  const auto at = html.find("<section id=\"pipeline\">");
  ASSERT_NE(at, std::string::npos);
  const std::string sec = html.substr(at, html.find("</section>", at) - at);
  std::size_t bars = 0;
  for (auto p = sec.find("<title>"); p != std::string::npos; p = sec.find("<title>", p + 1)) ++bars;
  EXPECT_EQ(bars, 2u * 4 * 8);
  for (int s = 0; s < 4; ++s) EXPECT_NE(sec.find(">stage " + std::to_string(s) + "<"), std::string::npos);
  EXPECT_NE(sec.find("1f1b on 4 stages"), std::string::npos);
  // 3 / 11 = 27.3%.
  EXPECT_NE(sec.find("<td>all (the bubble)</td><td></td><td></td><td>27.3%</td>"), std::string::npos)
      << sec.substr(sec.find("<table"));

  std::ofstream(run / kPipelineTraceFile) << "{not json";
  const std::string bad = render_report(run, testing::report_defaults());
  EXPECT_NE(bad.find((run / kPipelineTraceFile).string()), std::string::npos);
}

}  // namespace
}  // namespace moetrain
