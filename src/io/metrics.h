// metrics.jsonl: one JSON object per line, appended by one process of a run (rank 0, the
// parameter server's lead shard). The one place that opens the file: every trainer, server and
// worker writes through a MetricsWriter, and tools read it back with read_metrics.
//
// Each line is written whole and flushed, so a crash leaves complete lines (at most the last one
// torn, which read_metrics skips). A failed write (a full disk) is an Error naming the file: a run
// never goes on silently without its metrics.
#pragma once
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>

namespace moetrain {

// The file name inside a run directory.
inline constexpr const char* kMetricsFile = "metrics.jsonl";

class MetricsWriter {
 public:
  enum class Open {
    Fresh,   // a new run: truncate
    Append,  // go on after what is there
  };
  // A writer that writes nothing (processes other than the one that keeps the metrics).
  MetricsWriter() = default;
  MetricsWriter(const std::filesystem::path& run_dir, Open mode);
  ~MetricsWriter();
  MetricsWriter(MetricsWriter&&) noexcept;
  MetricsWriter& operator=(MetricsWriter&&) noexcept;

  // Opens RUN_DIR/metrics.jsonl for a run resumed at `step`: lines of later steps belong to the
  // run being replaced and are dropped (atomically: the kept lines are rewritten, then renamed).
  static MetricsWriter resume(const std::filesystem::path& run_dir, int64_t step);

  bool active() const { return file_ != nullptr; }
  const std::filesystem::path& path() const { return path_; }
  // Appends `line` (a JSON object) and flushes. No-op on an inactive writer.
  void write(const nlohmann::json& line);

 private:
  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
};

// Every complete JSON object line of RUN_DIR/metrics.jsonl (empty when there is no file).
std::vector<nlohmann::json> read_metrics(const std::filesystem::path& run_dir);

}  // namespace moetrain
