// A pipeline timeline (parallel/pipeline_schedule.h) as a trace (io/trace_events.h): one lane per
// stage, one span per pass — "F3" the forward of micro-batch 3, "B3" its backward (zero_bubble:
// its input-gradient half), "W3" its weight-gradient half, with ".cK" naming the model chunk K
// under interleaving — so a planned or a recorded step opens in Perfetto and in the run report.
#pragma once
#include <string>

#include "io/trace_events.h"
#include "parallel/pipeline_schedule.h"

namespace moetrain {

// `title` names the process ("plan: 1f1b, 4 stages, 8 micro-batches").
TraceFile pipeline_trace(const PipeTimeline& timeline, const PipeShape& shape,
                         const std::string& title);

}  // namespace moetrain
