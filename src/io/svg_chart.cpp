#include "io/svg_chart.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <fmt/format.h>

namespace moetrain {
namespace {

constexpr double kWidth = 860, kHeight = 300;
// kTop leaves room for the legend above the plot, where it hides no curve.
constexpr double kLeft = 70, kRight = 20, kTop = 28, kBottom = 44;
// Colour-blind-safe categorical palette (Okabe-Ito), for up to eight series; then it repeats.
constexpr const char* kColours[] = {"#0072B2", "#D55E00", "#009E73", "#CC79A7",
                                    "#E69F00", "#56B4E9", "#000000", "#F0E442"};

std::string num(double v) {
  if (v == 0) return "0";
  const double a = std::fabs(v);
  if (a >= 1e4 && a < 1e7) return fmt::format("{:.0f}", v);
  if (a >= 1e7 || a < 1e-3) return fmt::format("{:.2g}", v);
  return fmt::format("{:.4g}", v);
}

// About `want` round tick values covering [lo, hi].
std::vector<double> ticks(double lo, double hi, int want) {
  const double span = hi - lo;
  const double raw = span / want;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 2.5, 5.0, 10.0})
    if (raw <= m * mag) {
      step = m * mag;
      break;
    }
  std::vector<double> out;
  for (double t = std::ceil(lo / step) * step; t <= hi + step * 1e-9; t += step)
    out.push_back(std::fabs(t) < step * 1e-9 ? 0.0 : t);
  return out;
}

struct Range {
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  void add(double v) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  bool empty() const { return lo > hi; }
  void pad() {
    if (hi - lo <= 0) {
      const double d = lo == 0 ? 1.0 : std::fabs(lo) * 0.1;
      lo -= d;
      hi += d;
    }
  }
};

std::string axis_label(double x, double y, std::string_view text, bool vertical) {
  if (vertical)
    return fmt::format(
        "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" transform=\"rotate(-90 {:.1f} "
        "{:.1f})\" class=\"axis-label\">{}</text>\n",
        x, y, x, y, html_escape(text));
  return fmt::format(
      "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" class=\"axis-label\">{}</text>\n", x,
      y, html_escape(text));
}

}  // namespace

std::string html_escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string line_chart(const std::vector<Series>& series, const LineChartSpec& spec) {
  // Finite points of each series, thinned to at most max_points.
  std::vector<std::vector<std::pair<double, double>>> pts(series.size());
  bool log_y = spec.log_y;
  for (std::size_t s = 0; s < series.size(); ++s) {
    const auto& se = series[s];
    const std::size_t n = std::min(se.x.size(), se.y.size());
    for (std::size_t i = 0; i < n; ++i)
      if (std::isfinite(se.x[i]) && std::isfinite(se.y[i])) pts[s].push_back({se.x[i], se.y[i]});
    if (pts[s].size() > spec.max_points && spec.max_points > 1) {
      std::vector<std::pair<double, double>> thin;
      const double stride = static_cast<double>(pts[s].size() - 1) / (spec.max_points - 1);
      for (std::size_t k = 0; k < spec.max_points; ++k)
        thin.push_back(pts[s][static_cast<std::size_t>(std::llround(k * stride))]);
      pts[s] = std::move(thin);
    }
    for (auto& p : pts[s])
      if (p.second <= 0) log_y = false;
  }
  Range xr, yr;
  for (auto& ps : pts)
    for (auto& [x, y] : ps) {
      xr.add(x);
      yr.add(log_y ? std::log10(y) : y);
    }
  if (xr.empty()) return {};
  xr.pad();
  yr.pad();
  const double pw = kWidth - kLeft - kRight, ph = kHeight - kTop - kBottom;
  auto sx = [&](double x) { return kLeft + (x - xr.lo) / (xr.hi - xr.lo) * pw; };
  auto sy = [&](double y) {
    const double v = log_y ? std::log10(y) : y;
    return kTop + ph - (v - yr.lo) / (yr.hi - yr.lo) * ph;
  };
  std::string out = fmt::format(
      "<svg class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {} {}\" "
      "width=\"{}\" height=\"{}\" role=\"img\">\n",
      kWidth, kHeight, kWidth, kHeight);
  out += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" class=\"plot\"/>\n", kLeft,
                     kTop, pw, ph);
  for (double t : ticks(xr.lo, xr.hi, 8)) {
    out +=
        fmt::format("<line x1=\"{0:.1f}\" x2=\"{0:.1f}\" y1=\"{1}\" y2=\"{2}\" class=\"grid\"/>\n",
                    sx(t), kTop, kTop + ph);
    out +=
        fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\" class=\"tick\">{}</text>\n",
                    sx(t), kTop + ph + 16, num(t));
  }
  if (log_y) {
    for (double e = std::floor(yr.lo); e <= std::ceil(yr.hi); e += 1.0)
      for (double m : {1.0, 2.0, 5.0}) {
        const double lv = e + std::log10(m);
        if (lv < yr.lo || lv > yr.hi) continue;
        const double y = std::pow(10.0, lv);
        out += fmt::format(
            "<line x1=\"{0}\" x2=\"{1}\" y1=\"{2:.1f}\" y2=\"{2:.1f}\" class=\"grid\"/>\n", kLeft,
            kLeft + pw, sy(y));
        out += fmt::format(
            "<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\" class=\"tick\">{}</text>\n", kLeft - 6,
            sy(y) + 4, num(y));
      }
  } else {
    for (double t : ticks(yr.lo, yr.hi, 6)) {
      out += fmt::format(
          "<line x1=\"{0}\" x2=\"{1}\" y1=\"{2:.1f}\" y2=\"{2:.1f}\" class=\"grid\"/>\n", kLeft,
          kLeft + pw, sy(t));
      out +=
          fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\" class=\"tick\">{}</text>\n",
                      kLeft - 6, sy(t) + 4, num(t));
    }
  }
  out += axis_label(kLeft + pw / 2, kHeight - 6, spec.x_label, false);
  out += axis_label(16, kTop + ph / 2, spec.y_label + (log_y ? " (log)" : ""), true);
  std::size_t drawn = 0;
  for (std::size_t s = 0; s < series.size(); ++s) {
    if (pts[s].empty()) continue;
    const char* colour = kColours[s % std::size(kColours)];
    if (pts[s].size() == 1) {
      out += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"{}\"{}/>\n",
                         sx(pts[s][0].first), sy(pts[s][0].second), colour,
                         series[s].markers ? " class=\"marker\"" : "");
    } else {
      out += fmt::format(
          "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" data-series=\"{}\" points=\"",
          colour, html_escape(series[s].name));
      for (std::size_t i = 0; i < pts[s].size(); ++i)
        out +=
            fmt::format("{}{:.1f},{:.1f}", i ? " " : "", sx(pts[s][i].first), sy(pts[s][i].second));
      out += "\"/>\n";
      if (series[s].markers)
        for (const auto& [x, y] : pts[s])
          out += fmt::format(
              "<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\" fill=\"{}\" stroke=\"#fff\" "
              "class=\"marker\"/>\n",
              sx(x), sy(y), colour);
    }
    ++drawn;
  }
  if (drawn > 1) {
    double lx = kLeft + 10;
    out += "<g class=\"legend\">\n";
    for (std::size_t s = 0; s < series.size(); ++s) {
      if (pts[s].empty()) continue;
      const char* colour = kColours[s % std::size(kColours)];
      out += fmt::format(
          "<rect x=\"{:.1f}\" y=\"{}\" width=\"14\" height=\"4\" fill=\"{}\"/>"
          "<text x=\"{:.1f}\" y=\"{}\" class=\"tick\">{}</text>\n",
          lx, 8, colour, lx + 18, 13, html_escape(series[s].name));
      if (series[s].markers)
        out += fmt::format("<circle cx=\"{:.1f}\" cy=\"10\" r=\"3.5\" fill=\"{}\"/>\n", lx + 7,
                           colour);
      lx += 30 + 7.0 * static_cast<double>(series[s].name.size());
    }
    out += "</g>\n";
  }
  out += "</svg>\n";
  return out;
}

std::string heatmap(const std::vector<std::vector<double>>& cells, const HeatmapSpec& spec) {
  Range vr;
  std::size_t cols = 0;
  for (auto& row : cells) {
    cols = std::max(cols, row.size());
    for (double v : row)
      if (std::isfinite(v)) vr.add(v);
  }
  if (vr.empty() || cols == 0) return {};
  const double span = vr.hi > vr.lo ? vr.hi - vr.lo : 1.0;
  const double rows = static_cast<double>(cells.size());
  const double cell_h = std::clamp(220.0 / rows, 6.0, 28.0);
  const double pw = kWidth - kLeft - kRight - 110, ph = cell_h * rows;
  const double cw = pw / static_cast<double>(cols);
  const double height = kTop + ph + kBottom;
  std::string out = fmt::format(
      "<svg class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {} {:.0f}\" "
      "width=\"{}\" height=\"{:.0f}\" role=\"img\">\n",
      kWidth, height, kWidth, height);
  // Light yellow to dark blue: the busiest experts stand out.
  auto colour = [&](double v) {
    const double t = (v - vr.lo) / span;
    auto mix = [t](int a, int b) { return static_cast<int>(std::lround(a + (b - a) * t)); };
    return fmt::format("rgb({},{},{})", mix(255, 8), mix(247, 48), mix(188, 107));
  };
  for (std::size_t r = 0; r < cells.size(); ++r)
    for (std::size_t c = 0; c < cells[r].size(); ++c) {
      if (!std::isfinite(cells[r][c])) continue;
      out += fmt::format(
          "<rect x=\"{:.2f}\" y=\"{:.2f}\" width=\"{:.2f}\" height=\"{:.2f}\" fill=\"{}\">"
          "<title>{} {}, {} {}: {}</title></rect>\n",
          kLeft + cw * c, kTop + cell_h * r, cw + 0.3, cell_h + 0.3, colour(cells[r][c]),
          html_escape(spec.y_label),
          html_escape(r < spec.row_labels.size() ? spec.row_labels[r] : std::to_string(r)),
          html_escape(spec.x_label),
          html_escape(c < spec.col_labels.size() ? spec.col_labels[c] : std::to_string(c)),
          num(cells[r][c]));
    }
  // Row labels only where they do not overlap; column labels at about ten places.
  const std::size_t row_every = static_cast<std::size_t>(std::ceil(12.0 / cell_h));
  for (std::size_t r = 0; r < cells.size(); r += row_every)
    out += fmt::format(
        "<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\" class=\"tick\">{}</text>\n", kLeft - 6,
        kTop + cell_h * (r + 0.5) + 4,
        html_escape(r < spec.row_labels.size() ? spec.row_labels[r] : std::to_string(r)));
  const std::size_t col_every = std::max<std::size_t>(1, (cols + 9) / 10);
  for (std::size_t c = 0; c < cols; c += col_every)
    out += fmt::format(
        "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" class=\"tick\">{}</text>\n",
        kLeft + cw * (c + 0.5), kTop + ph + 16,
        html_escape(c < spec.col_labels.size() ? spec.col_labels[c] : std::to_string(c)));
  out += axis_label(kLeft + pw / 2, height - 6, spec.x_label, false);
  out += axis_label(16, kTop + ph / 2, spec.y_label, true);
  // Scale bar: the smallest value at the bottom, the largest at the top.
  const double bx = kLeft + pw + 16;
  for (int i = 0; i < 20; ++i) {
    const double v = vr.hi - span * i / 19.0;
    out += fmt::format(
        "<rect x=\"{:.1f}\" y=\"{:.2f}\" width=\"14\" height=\"{:.2f}\" fill=\"{}\"/>\n", bx,
        kTop + ph * i / 20.0, ph / 20.0 + 0.3, colour(v));
  }
  out += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" class=\"tick\">{}</text>\n", bx + 18,
                     kTop + 9, num(vr.hi));
  out += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" class=\"tick\">{}</text>\n", bx + 18,
                     kTop + ph, num(vr.lo));
  out += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" class=\"tick\">{}</text>\n", bx,
                     kTop + ph + 16, html_escape(spec.value_label));
  out += "</svg>\n";
  return out;
}

std::string timeline_chart(const std::vector<TimelineBar>& bars, const TimelineSpec& spec) {
  if (bars.empty()) return {};
  Range xr;
  int64_t lanes = 0;
  std::vector<std::string> categories;
  for (const TimelineBar& b : bars) {
    xr.add(b.start * spec.x_scale);
    xr.add(b.end * spec.x_scale);
    lanes = std::max(lanes, b.lane + 1);
    if (std::find(categories.begin(), categories.end(), b.category) == categories.end())
      categories.push_back(b.category);
  }
  xr.pad();
  const double lane_h = std::clamp(200.0 / static_cast<double>(lanes), 10.0, 30.0);
  const double pw = kWidth - kLeft - kRight, ph = lane_h * static_cast<double>(lanes);
  const double height = kTop + ph + kBottom;
  auto x_of = [&](double t) { return kLeft + (t * spec.x_scale - xr.lo) / (xr.hi - xr.lo) * pw; };
  auto colour = [&](const std::string& category) {
    const auto i = std::find(categories.begin(), categories.end(), category) - categories.begin();
    return kColours[static_cast<std::size_t>(i) % std::size(kColours)];
  };
  std::string out = fmt::format(
      "<svg class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" viewBox=\"0 0 {} {:.0f}\" "
      "width=\"{}\" height=\"{:.0f}\" role=\"img\">\n",
      kWidth, height, kWidth, height);
  out += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{:.1f}\" class=\"plot\"/>\n",
                     kLeft, kTop, pw, ph);
  for (const double t : ticks(xr.lo, xr.hi, 8)) {
    const double x = kLeft + (t - xr.lo) / (xr.hi - xr.lo) * pw;
    out += fmt::format(
        "<line x1=\"{:.1f}\" y1=\"{}\" x2=\"{:.1f}\" y2=\"{:.1f}\" class=\"grid\"/>\n"
        "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" class=\"tick\">{}</text>\n",
        x, kTop, x, kTop + ph, x, kTop + ph + 16, num(t));
  }
  for (const TimelineBar& b : bars) {
    const double x0 = x_of(b.start), x1 = x_of(b.end), y = kTop + lane_h * b.lane + 1;
    const double w = std::max(0.5, x1 - x0), h = lane_h - 2;
    out += fmt::format(
        "<rect x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{:.1f}\" fill=\"{}\">"
        "<title>{} ({}): {} – {} {}</title></rect>\n",
        x0, y, w, h, colour(b.category), html_escape(b.label), html_escape(b.category),
        num(b.start * spec.x_scale), num(b.end * spec.x_scale), html_escape(spec.x_label));
    // About 7 px a character at the tick font's size.
    if (w > 7.0 * static_cast<double>(b.label.size()) + 4 && h >= 10)
      out += fmt::format(
          "<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\" class=\"tick\" "
          "fill=\"#fff\">{}</text>\n",
          x0 + w / 2, y + h / 2 + 4, html_escape(b.label));
  }
  for (int64_t l = 0; l < lanes; ++l)
    out += fmt::format(
        "<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\" class=\"tick\">{}</text>\n", kLeft - 6,
        kTop + lane_h * (static_cast<double>(l) + 0.5) + 4,
        html_escape(static_cast<std::size_t>(l) < spec.lane_labels.size()
                        ? spec.lane_labels[static_cast<std::size_t>(l)]
                        : std::to_string(l)));
  out += axis_label(kLeft + pw / 2, height - 6, spec.x_label, false);
  // The legend above the plot, as the line charts have it.
  double lx = kLeft;
  for (const std::string& c : categories) {
    out += fmt::format(
        "<rect x=\"{:.1f}\" y=\"8\" width=\"12\" height=\"12\" fill=\"{}\"/>"
        "<text x=\"{:.1f}\" y=\"18\" class=\"legend\">{}</text>\n",
        lx, colour(c), lx + 16, html_escape(c));
    lx += 16 + 9.0 * static_cast<double>(c.size()) + 18;
  }
  out += "</svg>\n";
  return out;
}

}  // namespace moetrain
