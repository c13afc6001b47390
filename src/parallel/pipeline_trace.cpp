#include "parallel/pipeline_trace.h"

#include <fmt/format.h>

namespace moetrain {

TraceFile pipeline_trace(const PipeTimeline& timeline, const PipeShape& shape,
                         const std::string& title) {
  TraceFile t;
  t.process_names[0] = title;
  for (std::size_t s = 0; s < timeline.stages.size(); ++s) {
    t.lane_names[static_cast<int64_t>(s)] = fmt::format("stage {}", s);
    for (const PipeEvent& e : timeline.stages[s]) {
      static constexpr const char* kLetter[] = {"F", "B", "W"};
      static constexpr const char* kCategory[] = {"forward", "backward", "weight"};
      TraceSpan span;
      span.name = fmt::format("{}{}", kLetter[e.op.kind], e.op.micro);
      if (shape.virtual_stages > 1) span.name += fmt::format(".c{}", e.op.chunk);
      span.category = kCategory[e.op.kind];
      span.lane = static_cast<int64_t>(s);
      span.start_s = e.start;
      span.duration_s = e.end - e.start;
      t.spans.push_back(std::move(span));
    }
  }
  return t;
}

}  // namespace moetrain
