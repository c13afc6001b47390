#include "io/trace_events.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "io/file.h"

namespace moetrain {

using Json = nlohmann::json;

void write_trace(const std::filesystem::path& path, const TraceFile& trace) {
  Json events = Json::array();
  for (const auto& [pid, name] : trace.process_names)
    events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"args", {{"name", name}}}});
  std::vector<int64_t> pids;
  for (const TraceSpan& s : trace.spans) pids.push_back(s.process);
  for (const auto& [pid, name] : trace.process_names) pids.push_back(pid);
  std::sort(pids.begin(), pids.end());
  pids.erase(std::unique(pids.begin(), pids.end()), pids.end());
  for (const int64_t pid : pids)
    for (const auto& [tid, name] : trace.lane_names) {
      events.push_back(
          {{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", name}}}});
      // Lanes in their own order, not by name.
      events.push_back({{"ph", "M"},
                        {"name", "thread_sort_index"},
                        {"pid", pid},
                        {"tid", tid},
                        {"args", {{"sort_index", tid}}}});
    }
  for (const TraceSpan& s : trace.spans)
    events.push_back({{"ph", "X"},
                      {"name", s.name},
                      {"cat", s.category},
                      {"pid", s.process},
                      {"tid", s.lane},
                      {"ts", s.start_s * 1e6},
                      {"dur", s.duration_s * 1e6}});
  const Json doc = {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
  std::filesystem::create_directories(path.parent_path().empty() ? "." : path.parent_path());
  write_file_atomic(path, doc.dump() + "\n");
}

TraceFile read_trace(const std::filesystem::path& path) {
  std::ifstream in(path);
  MOETRAIN_CHECK(in.good(), "{}: cannot read the trace file", path.string());
  std::stringstream text;
  text << in.rdbuf();
  const Json doc = Json::parse(text.str(), nullptr, false);
  MOETRAIN_CHECK(!doc.is_discarded() && doc.is_object() && doc.contains("traceEvents") &&
                     doc["traceEvents"].is_array(),
                 "{}: not a Chrome trace-event file (expected a JSON object with a "
                 "\"traceEvents\" array)",
                 path.string());
  TraceFile t;
  std::size_t i = 0;
  for (const Json& e : doc["traceEvents"]) {
    MOETRAIN_CHECK(e.is_object() && e.contains("ph") && e["ph"].is_string(),
                   "{}: traceEvents[{}] has no \"ph\" (expected an event object)", path.string(), i);
    const std::string ph = e["ph"].get<std::string>();
    try {
      if (ph == "X") {
        TraceSpan s;
        s.name = e.value("name", "");
        s.category = e.value("cat", "");
        s.process = e.value("pid", int64_t{0});
        s.lane = e.value("tid", int64_t{0});
        s.start_s = e.at("ts").get<double>() * 1e-6;
        s.duration_s = e.at("dur").get<double>() * 1e-6;
        MOETRAIN_CHECK(std::isfinite(s.start_s) && std::isfinite(s.duration_s) && s.duration_s >= 0,
                       "a complete event needs a finite ts and a finite dur >= 0");
        t.spans.push_back(std::move(s));
      } else if (ph == "M" && e.value("name", "") == "process_name") {
        t.process_names[e.value("pid", int64_t{0})] = e.at("args").at("name").get<std::string>();
      } else if (ph == "M" && e.value("name", "") == "thread_name") {
        t.lane_names[e.value("tid", int64_t{0})] = e.at("args").at("name").get<std::string>();
      }
    } catch (const Json::exception& x) {
      MOETRAIN_FAIL("{}: traceEvents[{}] (\"ph\": \"{}\"): {}", path.string(), i, ph, x.what());
    } catch (const Error& x) {
      MOETRAIN_FAIL("{}: traceEvents[{}]: {}", path.string(), i, x.what());
    }
    ++i;
  }
  return t;
}

std::vector<LaneTime> lane_times(const std::vector<TraceSpan>& spans) {
  if (spans.empty()) return {};
  double first = spans[0].start_s, last = spans[0].start_s + spans[0].duration_s;
  std::map<int64_t, std::vector<std::pair<double, double>>> by_lane;
  for (const TraceSpan& s : spans) {
    first = std::min(first, s.start_s);
    last = std::max(last, s.start_s + s.duration_s);
    by_lane[s.lane].push_back({s.start_s, s.start_s + s.duration_s});
  }
  std::vector<LaneTime> out;
  for (auto& [lane, iv] : by_lane) {
    std::sort(iv.begin(), iv.end());
    double busy = 0, open = iv[0].first, close = iv[0].second;
    for (const auto& [a, b] : iv) {
      if (a > close) {
        busy += close - open;
        open = a, close = b;
      } else {
        close = std::max(close, b);
      }
    }
    busy += close - open;
    out.push_back({lane, busy, (last - first) - busy});
  }
  return out;
}

}  // namespace moetrain
