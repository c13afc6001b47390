#include "io/metrics.h"

#include <stdio.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>

#include "core/check.h"
#include "io/file.h"

namespace fs = std::filesystem;

namespace moetrain {

namespace {

// Removes the event files in `dir` (only those: TensorBoard would show them with the new run's).
void remove_event_files(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  for (const fs::directory_entry& e : fs::directory_iterator(dir))
    if (e.path().filename().string().starts_with("events.out.tfevents.")) {
      fs::remove(e.path(), ec);
      MOETRAIN_CHECK(!ec, "cannot remove {}: {}", e.path().string(), ec.message());
    }
}

}  // namespace

MetricsWriter::MetricsWriter(const fs::path& run_dir, Open mode, bool tensorboard)
    : path_(run_dir / kMetricsFile) {
  file_ = std::fopen(path_.c_str(), mode == Open::Fresh ? "w" : "a");
  MOETRAIN_CHECK(file_ != nullptr, "cannot open {} for writing: {}", path_.string(),
                 std::strerror(errno));
  if (mode == Open::Fresh) remove_event_files(run_dir / kTensorboardDir);
  if (!tensorboard) return;
  events_ = EventFileWriter(run_dir / kTensorboardDir);
}

MetricsWriter MetricsWriter::role(const fs::path& run_dir, const std::string& role, Open mode) {
  const fs::path dir = run_dir / kRoleMetricsDir;
  std::error_code ec;
  fs::create_directories(dir, ec);
  MOETRAIN_CHECK(!ec, "cannot make {}: {}", dir.string(), ec.message());
  MetricsWriter w;
  w.path_ = dir / (role + ".jsonl");
  w.file_ = std::fopen(w.path_.c_str(), mode == Open::Fresh ? "w" : "a");
  MOETRAIN_CHECK(w.file_ != nullptr, "cannot open {} for writing: {}", w.path_.string(),
                 std::strerror(errno));
  return w;
}

void MetricsWriter::remove_roles(const fs::path& run_dir, const std::string& prefix) {
  const fs::path dir = run_dir / kRoleMetricsDir;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  for (const fs::directory_entry& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with(prefix) && name.ends_with(".jsonl")) {
      fs::remove(e.path(), ec);
      MOETRAIN_CHECK(!ec, "cannot remove {}: {}", e.path().string(), ec.message());
    }
  }
}

MetricsWriter::~MetricsWriter() {
  if (file_) std::fclose(file_);
}

MetricsWriter::MetricsWriter(MetricsWriter&& o) noexcept
    : path_(std::move(o.path_)),
      file_(std::exchange(o.file_, nullptr)),
      events_(std::move(o.events_)),
      described_(std::move(o.described_)) {}

MetricsWriter& MetricsWriter::operator=(MetricsWriter&& o) noexcept {
  if (this != &o) {
    if (file_) std::fclose(file_);
    path_ = std::move(o.path_);
    file_ = std::exchange(o.file_, nullptr);
    events_ = std::move(o.events_);
    described_ = std::move(o.described_);
  }
  return *this;
}

MetricsWriter MetricsWriter::resume(const fs::path& run_dir, int64_t step, bool tensorboard) {
  std::string keep;
  for (const nlohmann::json& j : read_metrics(run_dir))
    if (j.value("step", int64_t{0}) <= step) keep += j.dump() + "\n";
  write_file_atomic(run_dir / kMetricsFile, keep);
  MetricsWriter w(run_dir, Open::Append, tensorboard);
  // The earlier files' events after the checkpoint are the replaced run's, like the lines dropped.
  w.events_.write_restart(step + 1);
  return w;
}

void MetricsWriter::write(const nlohmann::json& line) {
  if (!file_) return;
  const std::string text = line.dump() + "\n";
  append_whole(::fileno(file_), path_, text);
  if (!events_.active()) return;
  int64_t step = 0;
  Summary summary;
  if (metrics_summary(line, step, summary, &described_)) events_.write(step, summary);
}

std::vector<nlohmann::json> read_metrics(const fs::path& run_dir) {
  return read_metrics_file(run_dir / kMetricsFile);
}

std::map<std::string, std::vector<nlohmann::json>> read_role_metrics(const fs::path& run_dir) {
  std::map<std::string, std::vector<nlohmann::json>> out;
  const fs::path dir = run_dir / kRoleMetricsDir;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return out;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec))
    if (e.path().extension() == ".jsonl")
      out[e.path().stem().string()] = read_metrics_file(e.path());
  return out;
}

std::vector<nlohmann::json> read_metrics_file(const fs::path& file) {
  std::vector<nlohmann::json> out;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_discarded() && j.is_object()) out.push_back(std::move(j));
  }
  return out;
}

fs::path run_config_file(const fs::path& run_dir) {
  const fs::path now = run_dir / kRunConfigFile, earlier = run_dir / "config.json";
  std::error_code ec;
  return !fs::exists(now, ec) && fs::is_regular_file(earlier, ec) ? earlier : now;
}

}  // namespace moetrain
