#include "core/log.h"

#include <atomic>
#include <cstdio>
#include <mutex>

namespace moetrain {

namespace {
std::atomic<int> g_rank{0};
std::atomic<bool> g_all{false};
std::atomic<int> g_level{static_cast<int>(LogLevel::Info)};
std::mutex g_mutex;
}  // namespace

void set_log_rank(int rank) {
  g_rank = rank;
}
int log_rank() {
  return g_rank;
}
void set_log_all_ranks(bool all) {
  g_all = all;
}
void set_log_level(LogLevel level) {
  g_level = static_cast<int>(level);
}
LogLevel log_level() {
  return static_cast<LogLevel>(g_level.load());
}

void log_message(LogLevel level, bool every_rank, const std::string& text) {
  int rank = g_rank;
  if (rank != 0 && !every_rank && !g_all) return;
  static const char* kTags[] = {"debug", "info", "warn", "error"};
  std::lock_guard<std::mutex> lock(g_mutex);
  std::string prefix = rank != 0 || g_all ? fmt::format("[rank {}] ", rank) : "";
  if (level == LogLevel::Info) {
    std::fprintf(stderr, "%s%s\n", prefix.c_str(), text.c_str());
  } else {
    std::fprintf(stderr, "%s%s: %s\n", prefix.c_str(), kTags[static_cast<int>(level)],
                 text.c_str());
  }
}

}  // namespace moetrain
