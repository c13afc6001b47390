// Inline SVG charts for the run report (io/report.h): line charts with axes, tick labels and a
// legend, heatmaps, and timelines (lanes of bars). Plain strings in, one `<svg class="chart">` element out, so the report
// stays one self-contained file with no script and nothing fetched.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace moetrain {

// Text made safe for HTML/SVG element content and attribute values.
std::string html_escape(std::string_view text);

struct Series {
  std::string name;
  std::vector<double> x, y;  // same length; non-finite points are left out
  bool markers = false;      // a circle at every point too (sparse series: evaluations)
};

struct LineChartSpec {
  std::string x_label = "step";
  std::string y_label;
  bool log_y = false;             // falls back to linear when a value is <= 0
  std::size_t max_points = 1500;  // per series; longer ones are thinned evenly (last point kept)
};

// One polyline per non-empty series (a circle where a series has a single point, and at every
// point of a series with markers), drawn in order so that later series lie on top, axes with tick
// labels, and a legend when there is more than one series. Empty string when no series has a
// finite point.
std::string line_chart(const std::vector<Series>& series, const LineChartSpec& spec);

struct HeatmapSpec {
  std::vector<std::string> row_labels;  // one per row of cells
  std::vector<std::string> col_labels;  // one per column; only some are drawn when there are many
  std::string x_label, y_label, value_label;
};

// cells[row][col]: colour from the smallest (light) to the largest value (dark), with a scale bar
// naming both ends. Rows may be ragged; missing cells are left blank.
std::string heatmap(const std::vector<std::vector<double>>& cells, const HeatmapSpec& spec);

struct TimelineBar {
  int64_t lane = 0;        // the row, 0 at the top
  double start = 0, end = 0;
  std::string label;       // drawn inside the bar where it fits, and in its tooltip
  std::string category;    // bars of one category share a colour; the legend names them
};

struct TimelineSpec {
  std::vector<std::string> lane_labels;  // one per lane
  std::string x_label = "ms";
  double x_scale = 1e3;  // bar times are multiplied by this for the axis (seconds → ms)
};

// One row per lane, one rectangle per bar, the gaps between them the lane's idle time; axis ticks
// under it and a legend of the categories in their order of first appearance. Empty string when
// there are no bars.
std::string timeline_chart(const std::vector<TimelineBar>& bars, const TimelineSpec& spec);

}  // namespace moetrain
