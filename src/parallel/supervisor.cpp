#include "parallel/supervisor.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "core/check.h"
#include "parallel/watchdog.h"

namespace fs = std::filesystem;

namespace moetrain {

namespace {

using Clock = std::chrono::steady_clock;

class EventLog {
 public:
  template <typename... Args>
  void operator()(fmt::format_string<Args...> f, Args&&... args) const {
    const double t = std::chrono::duration<double>(Clock::now() - start_).count();
    std::string line = fmt::format("moetrain launch [+{:.1f} s]: {}\n", t,
                                   fmt::format(f, std::forward<Args>(args)...));
    std::fputs(line.c_str(), stderr);
    std::fflush(stderr);
  }
  double seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

 private:
  Clock::time_point start_ = Clock::now();
};

// Every process below `root`, from /proc (a process that vanishes meanwhile is skipped).
std::vector<pid_t> descendants(pid_t root) {
  std::multimap<pid_t, pid_t> children;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator("/proc", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(entry.path() / "stat");
    std::string stat;
    if (!std::getline(in, stat)) continue;
    // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so read after the last
    // ')'.
    const std::size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 1));
    char state = 0;
    long ppid = 0;
    if (!(rest >> state >> ppid)) continue;
    children.emplace(static_cast<pid_t>(ppid), static_cast<pid_t>(std::stol(name)));
  }
  std::vector<pid_t> out, todo = {root};
  while (!todo.empty()) {
    const pid_t p = todo.back();
    todo.pop_back();
    auto [lo, hi] = children.equal_range(p);
    for (auto it = lo; it != hi; ++it) {
      out.push_back(it->second);
      todo.push_back(it->second);
    }
  }
  return out;
}

void reap_all() {
  int status = 0;
  while (::waitpid(-1, &status, WNOHANG) > 0) {
  }
}

// Kills what is left of a job: with the supervisor a subreaper, the ranks of a dead mpirun are
// its descendants. SIGKILL also ends stopped processes.
void kill_leftovers() {
  for (int round = 0; round < 100; ++round) {
    reap_all();
    const std::vector<pid_t> left = descendants(::getpid());
    if (left.empty()) return;
    for (pid_t p : left) ::kill(p, SIGKILL);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string join(const std::vector<std::string>& words) {
  std::string out;
  for (const auto& w : words) {
    if (!out.empty()) out += ' ';
    const bool plain = !w.empty() && w.find_first_of(" \t\"'\\$") == std::string::npos;
    out += plain ? w : "'" + w + "'";
  }
  return out;
}

// The job's standard error, passed on to ours as it comes; its first bytes are kept, which is
// where mpirun says why it would not start a job.
class ErrorTee {
 public:
  explicit ErrorTee(int fd) : fd_(fd), thread_([this] { run(); }) {}
  ~ErrorTee() { finish(); }
  // Once the job has ended: forwards what is left in the pipe, then gives the kept head.
  const std::string& finish() {
    if (thread_.joinable()) {
      stop_ = true;
      thread_.join();
      ::close(fd_);
    }
    return head_;
  }

 private:
  static constexpr std::size_t kHead = 16384;
  void run() {
    char buf[4096];
    for (;;) {
      pollfd p{fd_, POLLIN, 0};
      const int r = ::poll(&p, 1, 100);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        if (r < 0 || stop_) return;
        continue;
      }
      const ssize_t n = ::read(fd_, buf, sizeof(buf));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return;
      for (ssize_t done = 0; done < n;) {
        const ssize_t w = ::write(STDERR_FILENO, buf + done, static_cast<std::size_t>(n - done));
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) break;
        done += w;
      }
      head_.append(buf, std::min(static_cast<std::size_t>(n), kHead - head_.size()));
    }
  }
  int fd_;
  std::atomic<bool> stop_{false};
  std::string head_;
  std::thread thread_;
};

// Starts argv[0] in its own process group, its standard error into a pipe whose reading end
// goes to `error_fd`; an exec failure comes back as an Error.
pid_t start_job(const std::vector<std::string>& argv, int& error_fd) {
  int fds[2], errs[2];
  MOETRAIN_CHECK(::pipe2(fds, O_CLOEXEC) == 0, "moetrain launch: pipe: {}", std::strerror(errno));
  MOETRAIN_CHECK(::pipe2(errs, O_CLOEXEC) == 0, "moetrain launch: pipe: {}", std::strerror(errno));
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  MOETRAIN_CHECK(pid >= 0, "moetrain launch: fork: {}", std::strerror(errno));
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // the job does not outlive a killed supervisor
    if (::getppid() != parent) ::_exit(127);
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    // In a process group of its own mpirun must not read the terminal (it would be stopped).
    const int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, 0);
    ::dup2(errs[1], 2);
    ::execvp(args[0], args.data());
    const int err = errno;
    [[maybe_unused]] ssize_t w = ::write(fds[1], &err, sizeof(err));
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here: no race with the child's own call
  ::close(fds[1]);
  ::close(errs[1]);
  error_fd = errs[0];
  int err = 0;
  ssize_t n;
  do {
    n = ::read(fds[0], &err, sizeof(err));
  } while (n < 0 && errno == EINTR);
  ::close(fds[0]);
  if (n == static_cast<ssize_t>(sizeof(err))) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    ::close(error_fd);
    MOETRAIN_FAIL("cannot run '{}': {} (pass --mpirun PATH)", argv[0], std::strerror(err));
  }
  return pid;
}

// Waits for `pid`, forwarding SIGINT/SIGTERM/SIGHUP (blocked in `signals`) to it; `stop_signal`
// records the first one. After grace_s, or at a second signal, the job is killed.
int wait_job(pid_t pid, const sigset_t& signals, double grace_s, int& stop_signal,
             const EventLog& log) {
  Clock::time_point kill_at = Clock::time_point::max();
  for (;;) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) return status;
    timespec wait = {0, 200'000'000};
    siginfo_t info;
    const int sig = ::sigtimedwait(&signals, &info, &wait);
    if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) {
      if (stop_signal == 0) {
        stop_signal = sig;
        log("received {}: stopping the job (killed in {} s if it does not end)", strsignal(sig),
            grace_s);
        ::kill(pid, sig);
        kill_at = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                     std::chrono::duration<double>(grace_s));
      } else {
        kill_at = Clock::now();
      }
    }
    if (Clock::now() >= kill_at) {
      ::kill(-pid, SIGKILL);
      for (pid_t p : descendants(::getpid()))
        if (p != pid) ::kill(p, SIGKILL);
      ::kill(pid, SIGKILL);
    }
  }
}

bool requested_stop(int exit_code) {
  return exit_code == 128 + SIGINT || exit_code == 128 + SIGTERM;
}

// Sleeps `seconds` unless SIGINT/SIGTERM/SIGHUP arrives; returns that signal or 0.
int sleep_unless_signalled(double seconds, const sigset_t& signals) {
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(seconds));
  for (;;) {
    const auto left = end - Clock::now();
    if (left <= Clock::duration::zero()) return 0;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
    timespec wait = {static_cast<time_t>(ns / 1'000'000'000),
                     static_cast<long>(ns % 1'000'000'000)};
    siginfo_t info;
    const int sig = ::sigtimedwait(&signals, &info, &wait);
    if (sig == SIGINT || sig == SIGTERM || sig == SIGHUP) return sig;
    reap_all();  // SIGCHLD of a leftover
  }
}

// Blocks the signals the supervisor waits for, and restores the mask when it returns.
class SignalGuard {
 public:
  SignalGuard() {
    sigemptyset(&set_);
    for (int s : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&set_, s);
    ::sigprocmask(SIG_BLOCK, &set_, &old_);
  }
  ~SignalGuard() { ::sigprocmask(SIG_SETMASK, &old_, nullptr); }
  const sigset_t& set() const { return set_; }

 private:
  sigset_t set_, old_;
};

}  // namespace

SupervisorResult supervise(const SupervisorConfig& cfg) {
  MOETRAIN_CHECK(cfg.procs >= 1, "moetrain launch: -n {} must be ≥ 1", cfg.procs);
  MOETRAIN_CHECK(cfg.min_procs >= 0 && cfg.min_procs <= cfg.procs,
                 "moetrain launch: --min-procs {} must be in [1, -n = {}]", cfg.min_procs,
                 cfg.procs);
  MOETRAIN_CHECK(cfg.max_restarts >= 0, "moetrain launch: --max-restarts {} must be ≥ 0",
                 cfg.max_restarts);
  MOETRAIN_CHECK(std::isfinite(cfg.backoff_s) && cfg.backoff_s >= 0,
                 "moetrain launch: --backoff {} must be seconds ≥ 0", cfg.backoff_s);
  MOETRAIN_CHECK(!cfg.program.empty() && !cfg.command.empty(),
                 "moetrain launch: no program or command to run");
  EventLog log;
  SignalGuard signals;
  // Ranks orphaned by a dying mpirun are re-parented here, where they can be killed and reaped.
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);

  SupervisorResult result;
  std::string stop_reason;
  int stop_signal = 0;
  for (int attempt = 1;; ++attempt) {
    std::string refusal;  // why mpirun would not start the job: the same on every attempt
    if (attempt > 1) {
      const double delay = cfg.backoff_s * std::pow(2.0, attempt - 2);
      log("restart {} of {} in {:.1f} s", attempt - 1, cfg.max_restarts, delay);
      stop_signal = sleep_unless_signalled(delay, signals.set());
      if (stop_signal) {
        log("received {} while waiting: not restarting", strsignal(stop_signal));
        break;
      }
    }
    AttemptResult a;
    a.attempt = attempt;
    a.procs = cfg.procs;
    if (cfg.min_procs > 0) {
      try {
        const int slots = cfg.hostfile.empty() ? machine_slots() : hostfile_slots(cfg.hostfile);
        a.procs = std::min(cfg.procs, slots);
        if (a.procs < cfg.min_procs) {
          a.reason =
              fmt::format("only {} slot(s) available ({}), fewer than --min-procs {}", slots,
                          cfg.hostfile.empty() ? "this machine" : cfg.hostfile, cfg.min_procs);
          a.procs = 0;
        }
      } catch (const Error& e) {
        a.reason = e.what();
        a.procs = 0;
      }
    }
    if (a.procs > 0) {
      std::vector<std::string> argv = {cfg.mpirun};
      if (!cfg.hostfile.empty()) argv.insert(argv.end(), {"--hostfile", cfg.hostfile});
      argv.insert(argv.end(), {"-n", std::to_string(a.procs), "-x", "MOETRAIN_ATTEMPT"});
      if (std::getenv("MOETRAIN_FAULT")) argv.insert(argv.end(), {"-x", "MOETRAIN_FAULT"});
      argv.insert(argv.end(), cfg.mpirun_args.begin(), cfg.mpirun_args.end());
      argv.push_back(cfg.program);
      argv.insert(argv.end(), cfg.command.begin(), cfg.command.end());
      bool has_resume = false;
      for (const auto& w : cfg.command) has_resume = has_resume || w == cfg.resume_flag;
      if (attempt > 1 && !has_resume) argv.push_back(cfg.resume_flag);
      ::setenv("MOETRAIN_ATTEMPT", std::to_string(attempt).c_str(), 1);
      log("attempt {} of {}: {} process(es): {}", attempt, cfg.max_restarts + 1, a.procs,
          join(argv));
      const double started = log.seconds();
      pid_t pid = 0;
      int error_fd = -1;
      try {
        pid = start_job(argv, error_fd);
      } catch (const Error& e) {
        a.reason = stop_reason = e.what();
        log("{}", stop_reason);
        result.attempts.push_back(a);
        break;
      }
      ErrorTee errors(error_fd);
      const int status = wait_job(pid, signals.set(), cfg.grace_s, stop_signal, log);
      kill_leftovers();
      a.seconds = log.seconds() - started;
      a.success = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      a.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      a.reason = describe_job_status(status);
      if (!a.success) {
        const std::string& output = errors.finish();
        refusal = mpirun_refusal(output);
        a.error = job_error(output);
      }
      if (!refusal.empty()) a.reason += ": " + refusal;
    }
    if (cfg.progress) a.progress = cfg.progress();
    log("attempt {} {} after {:.1f} s: {}{}", attempt, a.success ? "succeeded" : "failed",
        a.seconds, a.reason, a.progress.empty() ? "" : "; " + a.progress);
    if (cfg.on_attempt) cfg.on_attempt(a);
    result.attempts.push_back(a);
    if (a.success) break;
    if (stop_signal) {
      stop_reason = fmt::format("stopped by {}", strsignal(stop_signal));
      break;
    }
    // 130/143: the processes were asked to stop (a signal sent to them, not to the supervisor)
    // and wrote a checkpoint; restarting would undo the request.
    if (requested_stop(a.exit_code)) {
      stop_signal = a.exit_code - 128;
      stop_reason = fmt::format("the job stopped on request ({}, exit code {}); not restarting",
                                strsignal(stop_signal), a.exit_code);
      break;
    }
    if (!refusal.empty()) {
      stop_reason =
          fmt::format("mpirun did not start the job and would not on a retry: {}", refusal);
      break;
    }
    // The same error as the attempt before, which left no step or checkpoint more: the job meets
    // it where it starts (data, settings, a resume it refuses), and a restart would again.
    if (result.attempts.size() >= 2) {
      const AttemptResult& before = result.attempts[result.attempts.size() - 2];
      if (!a.error.empty() && a.error == before.error && a.progress == before.progress) {
        stop_reason = fmt::format(
            "attempts {} and {} failed with the same error without progress, and a restart "
            "would meet it again: {}",
            before.attempt, a.attempt, a.error);
        break;
      }
    }
    if (attempt > cfg.max_restarts) {
      stop_reason = fmt::format("restart budget spent (--max-restarts {}); last failure: {}",
                                cfg.max_restarts, a.reason);
      break;
    }
  }
  kill_leftovers();

  const bool ok = !result.attempts.empty() && result.attempts.back().success;
  if (stop_signal)
    result.exit_code = 128 + stop_signal;
  else if (!ok)
    result.exit_code = 1;
  const int n = static_cast<int>(result.attempts.size());
  std::string s =
      ok ? fmt::format(
               "moetrain launch: succeeded after {} attempt(s) ({} restart(s)) in {:.1f} s\n", n,
               n - 1, log.seconds())
         : fmt::format("moetrain launch: failed after {} attempt(s) in {:.1f} s: {}\n", n,
                       log.seconds(), stop_reason);
  for (const AttemptResult& a : result.attempts) {
    s += fmt::format("  attempt {}: ", a.attempt);
    s += a.procs > 0 ? fmt::format("{} process(es), {:.1f} s, ", a.procs, a.seconds)
                     : std::string("not launched, ");
    s += a.reason;
    if (!a.progress.empty()) s += "; " + a.progress;
    s += "\n";
  }
  result.summary = s;
  return result;
}

}  // namespace moetrain
