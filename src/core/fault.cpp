#include "core/fault.h"

#include <signal.h>
#include <unistd.h>

#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/check.h"

namespace moetrain {

namespace {

constexpr const char* kPoints[] = {"step", "checkpoint_write"};

int64_t parse_int(const std::string& value, const std::string& field, const std::string& text) {
  int64_t v = 0;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  MOETRAIN_CHECK(ec == std::errc() && end == value.data() + value.size() && v >= 0,
                 "MOETRAIN_FAULT = '{}': {} = '{}' must be an integer ≥ 0", text, field, value);
  return v;
}

// The world rank the launcher gave this process (0 when none did).
int launcher_rank() {
  for (const char* var : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"}) {
    if (const char* v = std::getenv(var)) return std::atoi(v);
  }
  return 0;
}

int64_t current_attempt() {
  const char* v = std::getenv("MOETRAIN_ATTEMPT");
  if (!v) return 1;
  const std::string s = v;
  int64_t a = 0;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), a);
  MOETRAIN_CHECK(ec == std::errc() && end == s.data() + s.size() && a >= 1,
                 "MOETRAIN_ATTEMPT = '{}': must be an integer ≥ 1", s);
  return a;
}

struct Armed {
  std::optional<FaultSpec> spec;  // set when MOETRAIN_FAULT applies to this process
  int rank = 0;
  int64_t attempt = 1;
};

const Armed& armed() {
  static const Armed a = [] {
    Armed out;
    const char* text = std::getenv("MOETRAIN_FAULT");
    if (!text || !*text) return out;
    FaultSpec spec = parse_fault_spec(text);
    out.rank = launcher_rank();
    out.attempt = current_attempt();
    if (spec.rank == out.rank && (spec.attempt == 0 || spec.attempt == out.attempt))
      out.spec = spec;
    return out;
  }();
  return a;
}

}  // namespace

FaultSpec parse_fault_spec(const std::string& text) {
  FaultSpec spec;
  std::vector<std::string> parts;
  for (std::size_t at = 0;;) {
    std::size_t colon = text.find(':', at);
    parts.push_back(text.substr(at, colon == std::string::npos ? std::string::npos : colon - at));
    if (colon == std::string::npos) break;
    at = colon + 1;
  }
  const std::string& action = parts[0];
  if (action == "kill") {
    spec.action = FaultAction::Kill;
  } else if (action == "stop") {
    spec.action = FaultAction::Stop;
  } else if (action == "exit") {
    spec.action = FaultAction::Exit;
  } else if (action == "slow") {
    spec.action = FaultAction::Slow;
  } else if (action == "comm_delay") {
    spec.action = FaultAction::CommDelay;
  } else if (action == "route_delay") {
    spec.action = FaultAction::RouteDelay;
  } else {
    MOETRAIN_FAIL(
        "MOETRAIN_FAULT = '{}': action '{}' unknown (allowed: kill, stop, exit, slow, comm_delay, "
        "route_delay)",
        text, action);
  }
  for (std::size_t i = 1; i < parts.size(); ++i) {
    const std::size_t eq = parts[i].find('=');
    MOETRAIN_CHECK(eq != std::string::npos,
                   "MOETRAIN_FAULT = '{}': '{}' is not key=value (keys: rank, step, where, "
                   "attempt, code, ms, path)",
                   text, parts[i]);
    const std::string key = parts[i].substr(0, eq), value = parts[i].substr(eq + 1);
    if (key == "rank") {
      spec.rank = static_cast<int>(parse_int(value, key, text));
    } else if (key == "step") {
      spec.step = parse_int(value, key, text);
    } else if (key == "attempt") {
      spec.attempt = parse_int(value, key, text);
    } else if (key == "code") {
      spec.exit_code = static_cast<int>(parse_int(value, key, text));
      MOETRAIN_CHECK(spec.exit_code >= 1 && spec.exit_code <= 255,
                     "MOETRAIN_FAULT = '{}': code = {} must be in [1, 255]", text, spec.exit_code);
    } else if (key == "ms") {
      spec.slow_ms = parse_int(value, key, text);
    } else if (key == "where") {
      bool known = false;
      for (const char* p : kPoints) known = known || value == p;
      MOETRAIN_CHECK(known,
                     "MOETRAIN_FAULT = '{}': where = '{}' unknown (allowed: step, "
                     "checkpoint_write)",
                     text, value);
      spec.where = value;
    } else if (key == "path") {
      MOETRAIN_CHECK(value == "direct" || value == "relay",
                     "MOETRAIN_FAULT = '{}': path = '{}' unknown (allowed: direct, relay)", text,
                     value);
      spec.slow_relay = value == "relay";
    } else {
      MOETRAIN_FAIL(
          "MOETRAIN_FAULT = '{}': key '{}' unknown (allowed: rank, step, where, attempt, code, ms, "
          "path)",
          text, key);
    }
  }
  MOETRAIN_CHECK(spec.step >= 0 || spec.action == FaultAction::CommDelay,
                 "MOETRAIN_FAULT = '{}': step=S is required", text);
  return spec;
}

void fault_point(const char* where, int64_t step) {
  const Armed& a = armed();
  if (!a.spec || a.spec->where != where || a.spec->action == FaultAction::CommDelay ||
      a.spec->action == FaultAction::RouteDelay)
    return;
  if (a.spec->action == FaultAction::Slow) {
    if (step >= a.spec->step)
      std::this_thread::sleep_for(std::chrono::milliseconds(a.spec->slow_ms));
    return;
  }
  if (a.spec->step != step) return;
  static const char* kNames[] = {"kill", "stop", "exit"};
  std::fprintf(stderr,
               "moetrain: fault injection: %s rank %d at %s point, step %lld (attempt %lld)\n",
               kNames[static_cast<int>(a.spec->action)], a.rank, where,
               static_cast<long long>(step), static_cast<long long>(a.attempt));
  std::fflush(stderr);
  switch (a.spec->action) {
    case FaultAction::Kill:
      ::raise(SIGKILL);
      break;
    case FaultAction::Stop:
      ::raise(SIGSTOP);
      break;
    case FaultAction::Exit:
      ::_exit(a.spec->exit_code);
    case FaultAction::Slow:
    case FaultAction::CommDelay:
    case FaultAction::RouteDelay:
      break;
  }
}

void fault_comm_job() {
  const Armed& a = armed();
  if (a.spec && a.spec->action == FaultAction::CommDelay)
    std::this_thread::sleep_for(std::chrono::milliseconds(a.spec->slow_ms));
}

void fault_route_exchange(bool relayed, int64_t step) {
  const Armed& a = armed();
  if (!a.spec || a.spec->action != FaultAction::RouteDelay) return;
  // From `step` on the named path is slow; before it, the other one.
  const bool slow_relay = step >= a.spec->step ? a.spec->slow_relay : !a.spec->slow_relay;
  if (relayed == slow_relay)
    std::this_thread::sleep_for(std::chrono::milliseconds(a.spec->slow_ms));
}

}  // namespace moetrain
