// What a person watching a run sees: on a terminal, one line redrawn in place (step, loss,
// tokens/s, learning rate, ETA, expert-load imbalance); otherwise plain lines every so often.
#pragma once
#include <cstdint>
#include <string>

#include "core/timer.h"

namespace moetrain {

enum class ProgressMode { Bar, Lines, Off };

// "auto" picks Bar when stderr is a terminal, else Lines.
ProgressMode parse_progress_mode(const std::string& name);

struct ProgressLine {
  int64_t step = 0;   // steps done
  int64_t total = 0;  // steps in the run
  double loss = 0;
  double tokens_per_s = 0;
  double lr = 0;
  // max / mean tokens per expert, averaged over MoE layers (1 = perfect); 0: not known (left out)
  double imbalance = 0;
};

class Progress {
 public:
  Progress(ProgressMode mode, int64_t first_step, int64_t total_steps);
  void update(const ProgressLine& line);
  // A message that must not be drawn over (evaluation results, checkpoints).
  void note(const std::string& text);
  void finish();

  static std::string format_eta(double seconds);

 private:
  std::string render(const ProgressLine& line, int width) const;
  ProgressMode mode_;
  int64_t first_step_, total_;
  Timer timer_;
  double last_print_ = -1e9;
  bool drawn_ = false;
};

}  // namespace moetrain
