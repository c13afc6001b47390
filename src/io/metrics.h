// metrics.jsonl: one JSON object per line, appended by one process of a run (rank 0, the
// parameter server's lead shard). The one place that opens the file: every trainer, server and
// worker writes through a MetricsWriter, and tools read it back with read_metrics.
//
// Each line is written whole and flushed, so a crash leaves complete lines (at most the last one
// torn, which read_metrics skips). A failed write (a full disk) is an Error naming the file: a run
// never goes on silently without its metrics.
//
// TensorBoard is a second sink of the same writer: with it on, every line that has a "step" is
// also appended to an event file in RUN_DIR/tb (io/tensorboard.h) as one event at that step, its
// numbers as scalars and histograms under grouped tags (metrics_summary and tensorboard_tag say
// which), so the two never disagree.
#pragma once
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/tensorboard.h"

namespace moetrain {

// The file name inside a run directory.
inline constexpr const char* kMetricsFile = "metrics.jsonl";
// RUN_DIR/run_config.json: the settings the run trains with (`moetrain train` writes it). Not
// config.json, the name of a Hugging Face model directory's own file, so that a run directory is
// never taken for a model directory.
inline constexpr const char* kRunConfigFile = "run_config.json";
// The settings file of a run directory: run_config.json, or config.json where an earlier version
// of moetrain wrote it; run_config.json when neither exists.
std::filesystem::path run_config_file(const std::filesystem::path& run_dir);
// The folder of the per-process files of parameter-server and launched jobs: ROLE.jsonl each
// (worker_0, server_1, scheduler, launcher), merged by `moetrain report`.
inline constexpr const char* kRoleMetricsDir = "metrics";

class MetricsWriter {
 public:
  enum class Open {
    Fresh,   // a new run: truncate
    Append,  // go on after what is there
  };
  // A writer that writes nothing (processes other than the one that keeps the metrics).
  MetricsWriter() = default;
  // tensorboard: also write a new event file in RUN_DIR/tb. Fresh removes the event files an
  // earlier run left there (with or without tensorboard); Append keeps them, and TensorBoard
  // shows them together.
  MetricsWriter(const std::filesystem::path& run_dir, Open mode, bool tensorboard = false);
  ~MetricsWriter();
  MetricsWriter(MetricsWriter&&) noexcept;
  MetricsWriter& operator=(MetricsWriter&&) noexcept;

  // Opens RUN_DIR/metrics.jsonl for a run resumed at `step`: lines of later steps belong to the
  // run being replaced and are dropped (atomically: the kept lines are rewritten, then renamed).
  // The event files are kept and a new one is started with a restart mark at step + 1, from
  // which on TensorBoard drops the earlier files' events.
  static MetricsWriter resume(const std::filesystem::path& run_dir, int64_t step,
                              bool tensorboard = false);

  // RUN_DIR/metrics/ROLE.jsonl (the folder made when missing), without TensorBoard. Append: a
  // process restarted in the same role goes on in its predecessor's file.
  static MetricsWriter role(const std::filesystem::path& run_dir, const std::string& role,
                            Open mode = Open::Append);
  // Removes RUN_DIR/metrics/ROLE.jsonl of every role whose name starts with `prefix` (a new job
  // replaces the files an earlier one left).
  static void remove_roles(const std::filesystem::path& run_dir, const std::string& prefix);

  bool active() const { return file_ != nullptr; }
  const std::filesystem::path& path() const { return path_; }
  // The event file (empty without TensorBoard).
  const std::filesystem::path& tensorboard_path() const { return events_.path(); }
  // Appends `line` (a JSON object) and flushes, then its event. No-op on an inactive writer.
  void write(const nlohmann::json& line);

 private:
  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
  EventFileWriter events_;           // inactive without TensorBoard
  std::set<std::string> described_;  // tags whose description events_' file holds
};

// The TensorBoard tag of metrics key `key` (of MoE layer `layer` for a per-layer key) and one
// line saying what it is (empty for a key the table in io/metrics_tb.cpp does not know, which
// keeps its own name). Tags are grouped: train/ (loss, ce, aux, z, lr, grad_norm, ...), eval/
// (val_loss is eval/loss), perf/ (throughput and times), comm/ (communication), moe/ (imbalance,
// and moe/layer_i/NAME for each per-layer key), ps/ (the parameter server's clock, pushes, rows).
struct TensorboardTag {
  std::string tag;
  std::string_view description;
};
TensorboardTag tensorboard_tag(std::string_view key, int layer = -1);

// The TensorBoard values of a metrics line, and its step; false (nothing added) when the line has
// no "step". Numbers and booleans (0/1) become scalars; a list of numbers with one entry per rank
// (rank_step_time_s, rank_compute_s, profile_*) a histogram whose bucket r [r, r+1) holds rank r's
// value; any other list of numbers (one per MoE layer) a scalar per layer; a list of lists of
// numbers (layers × experts) a histogram per layer whose bucket e [e, e+1) holds expert e's
// count, and for tokens_per_expert also the scalars expert_utilisation (the fraction of experts
// that received a token) and max_mean_load (the busiest expert's tokens over the mean). Tags as
// tensorboard_tag says. Strings, objects and nulls are skipped. Each value carries its tag's
// description (TensorBoard's summary metadata) when `described` is null or does not hold the tag
// yet; the tag is then added to it, so a writer describes each tag once per file.
bool metrics_summary(const nlohmann::json& line, int64_t& step, Summary& out,
                     std::set<std::string>* described = nullptr);

// Every complete JSON object line of RUN_DIR/metrics.jsonl (empty when there is no file).
std::vector<nlohmann::json> read_metrics(const std::filesystem::path& run_dir);
// The same for one file.
std::vector<nlohmann::json> read_metrics_file(const std::filesystem::path& file);
// Every RUN_DIR/metrics/ROLE.jsonl by role, in name order (empty when there is no folder).
std::map<std::string, std::vector<nlohmann::json>> read_role_metrics(
    const std::filesystem::path& run_dir);

}  // namespace moetrain
