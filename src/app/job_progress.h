// `ps launch`'s view of a running job: its progress as `train` shows it (train/progress.h).
#pragma once
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

#include "train/progress.h"
#include "train/run_config.h"

namespace moetrain::app {

// The job's progress as `train` shows it (train/progress.h), from the lines the lead server
// appends to RUN_DIR/metrics.jsonl: step, loss, learning rate, tokens/s from the rows and times of
// consecutive updates.
class JobProgress {
 public:
  explicit JobProgress(const RunConfig& cfg)
      : path_(std::filesystem::path(cfg.train.run_dir) / "metrics.jsonl"),
        // The children log to the same terminal: a bar redrawn in place would be torn by them.
        mode_(cfg.train.progress == "auto" ? ProgressMode::Lines
                                           : parse_progress_mode(cfg.train.progress)),
        total_(cfg.train.steps),
        tokens_per_row_(static_cast<double>(cfg.train.seq_len * cfg.train.grad_accum)) {}

  // Reads what was appended since the last call, at most every half second.
  void poll() {
    if (mode_ == ProgressMode::Off) return;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_poll_ < std::chrono::milliseconds(500)) return;
    last_poll_ = now;
    std::ifstream in(path_, std::ios::binary);
    if (!in) return;
    in.seekg(0, std::ios::end);
    const auto size = static_cast<std::uintmax_t>(in.tellg());
    if (size < offset_) offset_ = 0;  // rewritten (a resumed job drops the lines past its clock)
    in.seekg(static_cast<std::streamoff>(offset_));
    std::string line;
    while (std::getline(in, line)) {
      if (in.eof()) break;  // a line still being written
      offset_ += line.size() + 1;
      const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.contains("loss") || !j.contains("step")) continue;
      const int64_t step = j.value("step", int64_t{0});
      if (step <= last_step_) continue;
      const double time = j.value("time", 0.0);
      ProgressLine p;
      p.step = step;
      p.total = total_;
      p.loss = j.value("loss", 0.0);
      p.lr = j.value("lr", 0.0);
      if (last_time_ > 0 && time > last_time_)
        p.tokens_per_s = j.value("rows", 0.0) * tokens_per_row_ / (time - last_time_);
      if (!progress_) progress_.emplace(mode_, step - 1, total_);
      progress_->update(p);
      last_step_ = step;
      last_time_ = time;
    }
  }
  void finish() {
    last_poll_ = {};
    poll();
    if (progress_) progress_->finish();
  }

 private:
  std::filesystem::path path_;
  ProgressMode mode_;
  int64_t total_;
  double tokens_per_row_;
  std::uintmax_t offset_ = 0;
  int64_t last_step_ = -1;
  double last_time_ = 0;
  std::optional<Progress> progress_;
  std::chrono::steady_clock::time_point last_poll_{};
};

}  // namespace moetrain::app
