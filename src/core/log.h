// Rank-aware logging to stderr: only rank 0 prints unless a message is marked for every rank
// or set_log_all_ranks(true) was called. Lines from other ranks carry "[rank r]".
#pragma once
#include <fmt/format.h>

#include <string>

namespace moetrain {

enum class LogLevel { Debug = 0, Info = 1, Warn = 2, Error = 3 };

void set_log_rank(int rank);
int log_rank();
void set_log_all_ranks(bool all);
void set_log_level(LogLevel level);
LogLevel log_level();
void log_message(LogLevel level, bool every_rank, const std::string& text);

template <typename... Args>
void log_debug(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() <= LogLevel::Debug)
    log_message(LogLevel::Debug, false, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void log_info(fmt::format_string<Args...> f, Args&&... args) {
  if (log_level() <= LogLevel::Info)
    log_message(LogLevel::Info, false, fmt::format(f, std::forward<Args>(args)...));
}
template <typename... Args>
void log_warn(fmt::format_string<Args...> f, Args&&... args) {
  log_message(LogLevel::Warn, false, fmt::format(f, std::forward<Args>(args)...));
}
// Printed by every rank (errors, per-rank diagnostics).
template <typename... Args>
void log_error(fmt::format_string<Args...> f, Args&&... args) {
  log_message(LogLevel::Error, true, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace moetrain
