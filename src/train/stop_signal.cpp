#include "train/stop_signal.h"

#include <fmt/format.h>

#include <csignal>

namespace moetrain {

namespace {

volatile std::sig_atomic_t g_signal = 0;

extern "C" void on_stop_signal(int sig) {
  g_signal = sig;
}

struct sigaction g_previous[2];
int g_installed = 0;

}  // namespace

StopSignals::StopSignals() {
  if (g_installed++ > 0) return;
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  // The second signal finds the default action back in place: it ends the process at once.
  sa.sa_flags = SA_RESETHAND;
  sigaction(SIGINT, &sa, &g_previous[0]);
  sigaction(SIGTERM, &sa, &g_previous[1]);
}

StopSignals::~StopSignals() {
  if (--g_installed > 0) return;
  sigaction(SIGINT, &g_previous[0], nullptr);
  sigaction(SIGTERM, &g_previous[1], nullptr);
}

int stop_signal() {
  return g_signal;
}

void clear_stop_signal() {
  g_signal = 0;
}

StopVotes StopVotes::local() {
  const int s = stop_signal();
  return {s == SIGINT ? 1 : 0, s == SIGTERM ? 1 : 0};
}

StopVotes StopVotes::agreed(Comm& comm) {
  const StopVotes here = local();
  int64_t counts[2] = {here.interrupt, here.terminate};
  comm.allreduce(counts, 2);
  return {counts[0], counts[1]};
}

int StopVotes::signal() const {
  return terminate > 0 ? SIGTERM : interrupt > 0 ? SIGINT : 0;
}

int StopVotes::exit_code() const {
  return any() ? 128 + signal() : 0;
}

std::string stop_message(const StopVotes& votes, int64_t step, const std::string& checkpoint) {
  return fmt::format("stopped by {} after step {}: checkpoint {}; continue with --resume",
                     votes.signal() == SIGTERM ? "SIGTERM" : "SIGINT", step, checkpoint);
}

}  // namespace moetrain
