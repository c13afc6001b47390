#include "train/stop_signal.h"

#include <fmt/format.h>
#include <omp.h>
#include <pthread.h>
#include <unistd.h>

#include <csignal>
#include <mutex>
#include <thread>

#include "core/threads.h"

namespace moetrain {

namespace {

volatile std::sig_atomic_t g_signal = 0;

extern "C" void on_stop_signal(int sig) {
  g_signal = sig;
}

struct sigaction g_previous[2];
int g_installed = 0;
// The installing thread's signal mask before the stop signals were blocked in it.
sigset_t g_previous_mask;

sigset_t stop_set() {
  sigset_t s;
  sigemptyset(&s);
  sigaddset(&s, SIGINT);
  sigaddset(&s, SIGTERM);
  return s;
}

// A handler runs on the stack of the thread the signal is delivered to, below that thread's stack
// pointer. oneDNN's generated f32 GEMM kernels (x64, up to at least oneDNN 3.11) point the stack
// pointer into a heap workspace while they run, so a handler run on a thread inside one of them
// writes its frame over the heap (oneDNN issue 4845): a run stopped by a signal then aborts with
// "corrupted size vs. prev_size" instead of writing its checkpoint. The threads that run GEMMs
// (the installing thread and the OpenMP pool, whose later threads inherit the mask) therefore
// block the stop signals, and this thread, which never runs a kernel, takes them instead.
void start_receiver() {
  static std::once_flag once;
  std::call_once(once, [] {
    std::thread([] {
      const sigset_t s = stop_set();
      pthread_sigmask(SIG_UNBLOCK, &s, nullptr);
      for (;;) pause();
    }).detach();
  });
}

// Applies `how` (SIG_BLOCK / SIG_UNBLOCK) of the stop signals on every thread of the OpenMP pool
// but the calling one.
void mask_pool(int how) {
  const sigset_t s = stop_set();
#pragma omp parallel num_threads(num_threads())
  if (omp_get_thread_num() != 0) pthread_sigmask(how, &s, nullptr);
}

}  // namespace

StopSignals::StopSignals() {
  if (g_installed++ > 0) return;
  start_receiver();
  const sigset_t s = stop_set();
  pthread_sigmask(SIG_BLOCK, &s, &g_previous_mask);
  mask_pool(SIG_BLOCK);
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
  // Unblocked again while the handler is still in place: a signal that arrives meanwhile is
  // counted, never the default action.
  if (!sigismember(&g_previous_mask, SIGINT) && !sigismember(&g_previous_mask, SIGTERM))
    mask_pool(SIG_UNBLOCK);
  pthread_sigmask(SIG_SETMASK, &g_previous_mask, nullptr);
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
