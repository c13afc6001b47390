#include "train/progress.h"

#include <fmt/format.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "core/check.h"
#include "core/log.h"

namespace moetrain {

ProgressMode parse_progress_mode(const std::string& name) {
  if (name == "bar") return ProgressMode::Bar;
  if (name == "lines") return ProgressMode::Lines;
  if (name == "off") return ProgressMode::Off;
  MOETRAIN_CHECK(name == "auto", "progress mode '{}': allowed are auto, bar, lines, off", name);
  return isatty(STDERR_FILENO) ? ProgressMode::Bar : ProgressMode::Lines;
}

Progress::Progress(ProgressMode mode, int64_t first_step, int64_t total_steps)
    : mode_(log_rank() == 0 ? mode : ProgressMode::Off),
      first_step_(first_step),
      total_(total_steps) {}

std::string Progress::format_eta(double seconds) {
  if (!(seconds >= 0) || seconds > 1e7) return "--:--";
  auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

std::string Progress::render(const ProgressLine& p, int width) const {
  double done = static_cast<double>(p.step - first_step_);
  double elapsed = timer_.seconds();
  double eta = done > 0 ? elapsed / done * static_cast<double>(p.total - p.step) : -1;
  const std::string load =
      p.imbalance > 0 ? fmt::format(" | load max/mean {:.2f}", p.imbalance) : std::string();
  std::string stats = fmt::format(" loss {:.4f} | {:.0f} tok/s | lr {:.2e}{} | ETA {}", p.loss,
                                  p.tokens_per_s, p.lr, load, format_eta(eta));
  std::string head = fmt::format("step {}/{} ", p.step, p.total);
  if (mode_ != ProgressMode::Bar) return head + stats.substr(1);
  int bar = std::max(10, std::min(30, width - static_cast<int>(head.size() + stats.size()) - 3));
  int filled =
      p.total > 0
          ? static_cast<int>(bar * static_cast<double>(p.step) / static_cast<double>(p.total))
          : bar;
  return head + "[" + std::string(filled, '#') + std::string(bar - filled, '.') + "]" + stats;
}

void Progress::update(const ProgressLine& line) {
  if (mode_ == ProgressMode::Off) return;
  double now = timer_.seconds();
  bool last = line.step >= line.total;
  if (mode_ == ProgressMode::Bar) {
    if (now - last_print_ < 0.1 && !last) return;
    winsize ws{};
    int width = ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0 ? ws.ws_col : 100;
    std::string text = render(line, width);
    if (static_cast<int>(text.size()) >= width) text.resize(std::max(0, width - 1));
    std::fprintf(stderr, "\r\033[K%s", text.c_str());
    std::fflush(stderr);
    drawn_ = true;
  } else {
    // Plain lines: about every 5 s, and the first and last steps.
    if (now - last_print_ < 5.0 && !last && line.step != first_step_ + 1) return;
    std::fprintf(stderr, "%s\n", render(line, 0).c_str());
  }
  last_print_ = now;
}

void Progress::note(const std::string& text) {
  if (log_rank() != 0) return;
  if (drawn_) std::fprintf(stderr, "\r\033[K");
  std::fprintf(stderr, "%s\n", text.c_str());
  drawn_ = false;
  last_print_ = -1e9;  // redraw the bar at once
}

void Progress::finish() {
  if (drawn_) std::fprintf(stderr, "\n");
  drawn_ = false;
}

}  // namespace moetrain
