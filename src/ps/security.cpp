#include "ps/security.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "core/check.h"
#include "core/log.h"

namespace fs = std::filesystem;

namespace moetrain::ps {

namespace {

std::mutex g_mu;
std::optional<JobKeys> g_keys;

void write_private(const fs::path& path, const std::string& text) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0600);
  MOETRAIN_CHECK(fd >= 0, "cannot create '{}': {}", path.string(), std::strerror(errno));
  const std::string line = text + "\n";
  const bool ok = ::write(fd, line.data(), line.size()) == static_cast<ssize_t>(line.size()) &&
                  ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  MOETRAIN_CHECK(ok, "cannot write '{}': {}", path.string(), std::strerror(err));
}

std::string read_key(const fs::path& path) {
  std::ifstream in(path);
  MOETRAIN_CHECK(in.good(), "cannot read the job key '{}' (make a pair with `moetrain ps keygen "
                 "DIR`, or pass --insecure for plaintext)", path.string());
  std::string key;
  std::getline(in, key);
  MOETRAIN_CHECK(key.size() == 40, "'{}': expected a 40-character Z85 key, found {} characters",
                 path.string(), key.size());
  return key;
}

std::string peer_of(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) return {};
  char host[INET6_ADDRSTRLEN] = {};
  int port = 0;
  if (a.ss_family == AF_INET) {
    auto* in = reinterpret_cast<sockaddr_in*>(&a);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
  } else if (a.ss_family == AF_INET6) {
    auto* in = reinterpret_cast<sockaddr_in6*>(&a);
    ::inet_ntop(AF_INET6, &in->sin6_addr, host, sizeof(host));
    port = ntohs(in->sin6_port);
  } else {
    return {};
  }
  return fmt::format("{}:{}", host, port);
}

// Refusals, logged without flooding: the first of an interval in full, the others of the
// interval counted and summarised once it is over, or when the log ends (the socket it watches
// closed) before that.
class RefusalLog {
 public:
  explicit RefusalLog(std::string who, double interval_s = 10)
      : who_(std::move(who)), interval_(interval_s) {}
  RefusalLog(const RefusalLog&) = delete;
  RefusalLog& operator=(const RefusalLog&) = delete;
  ~RefusalLog() { summarise(); }
  void refused(const std::string& what) {
    flush();
    if (counted_ == 0 && !open_) {
      log_warn("{}: refused {}", who_, what);
      open_ = true;
      start_ = Clock::now();
    } else {
      ++counted_;
      latest_ = what;
    }
  }
  // Ends the interval once it is over, with a line for what it counted.
  void flush() {
    if (!open_ || seconds_since(start_) < interval_) return;
    summarise();
  }

 private:
  using Clock = std::chrono::steady_clock;
  void summarise() {
    if (!open_) return;
    if (counted_ > 0)
      log_warn("{}: refused {} more peer(s) at the handshake in the last {:.0f} s (the latest: {})",
               who_, counted_, seconds_since(start_), latest_);
    open_ = false;
    counted_ = 0;
  }
  static double seconds_since(Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  }
  std::string who_, latest_;
  double interval_;
  bool open_ = false;
  int64_t counted_ = 0;
  Clock::time_point start_;
};

// Waits up to a second for `s` to have a message, flushing `log` meanwhile.
bool wait_readable(zmq::socket_t& s, RefusalLog& log) {
  zmq::pollitem_t item{s.handle(), 0, ZMQ_POLLIN, 0};
  int n = 0;
  try {
    n = zmq::poll(&item, 1, std::chrono::milliseconds(1000));
  } catch (const zmq::error_t& e) {
    if (e.num() != EINTR) throw;
  }
  log.flush();
  return n > 0;
}

// ZAP (RFC 27): admits a CURVE client only when its long-term public key is the job's. Runs
// until the context terminates.
void zap_loop(zmq::socket_t rep, std::array<uint8_t, 32> job_public) {
  RefusalLog refusals("ps");
  try {
    for (;;) {
      if (!wait_readable(rep, refusals)) continue;
      std::vector<zmq::message_t> req;
      do {
        req.emplace_back();
        (void)rep.recv(req.back());
      } while (req.back().more());
      if (req.size() < 6) continue;  // not a ZAP request; nothing to answer
      const std::string address = req[3].to_string(), mechanism = req[5].to_string();
      bool ok = mechanism == "CURVE" && req.size() >= 7 && req[6].size() == 32 &&
                std::memcmp(req[6].data(), job_public.data(), 32) == 0;
      if (!ok)
        refusals.refused(fmt::format("a {} peer from {} at the handshake: {}", mechanism, address,
                                     mechanism == "CURVE" ? "its key is not the job key"
                                                          : "not CURVE"));
      rep.send(zmq::str_buffer("1.0"), zmq::send_flags::sndmore);
      rep.send(req[1], zmq::send_flags::sndmore);
      rep.send(zmq::buffer(std::string(ok ? "200" : "400")), zmq::send_flags::sndmore);
      rep.send(zmq::buffer(std::string(ok ? "OK" : "not the job key")), zmq::send_flags::sndmore);
      rep.send(zmq::buffer(std::string(ok ? "member" : "")), zmq::send_flags::sndmore);
      rep.send(zmq::message_t(), zmq::send_flags::none);
    }
  } catch (const zmq::error_t&) {
    // ETERM: the context is shutting down; closing `rep` lets it finish.
  }
}

// One event of a socket monitor (zmq_socket_monitor's two frames), or nothing when the frames
// are not one.
struct MonitorEvent {
  uint16_t event = 0;
  int32_t value = 0;
  std::string address;
};
std::optional<MonitorEvent> read_event(zmq::socket_t& pair) {
  zmq::message_t ev, addr;
  (void)pair.recv(ev);
  if (!ev.more()) return std::nullopt;
  (void)pair.recv(addr);
  if (ev.size() < 6) return std::nullopt;
  MonitorEvent e;
  std::memcpy(&e.event, ev.data(), 2);
  std::memcpy(&e.value, ev.data<char>() + 2, 4);
  e.address = addr.to_string();
  return e;
}

std::atomic<int> g_monitors{0};

// Starts monitoring `s` for `events`; returns the socket the events arrive on.
zmq::socket_t monitor_socket(zmq::context_t& ctx, zmq::socket_t& s, int events) {
  const std::string ep = fmt::format("inproc://moetrain-monitor-{}", g_monitors++);
  MOETRAIN_CHECK(zmq_socket_monitor(s.handle(), ep.c_str(), events | ZMQ_EVENT_MONITOR_STOPPED) ==
                     0,
                 "cannot monitor a socket's handshakes: {}", zmq_strerror(zmq_errno()));
  zmq::socket_t pair(ctx, zmq::socket_type::pair);
  pair.set(zmq::sockopt::linger, 0);
  pair.connect(ep);
  return pair;
}

void monitor_loop(zmq::socket_t pair, std::string who) {
  std::map<int, std::string> peers;  // accepted fd -> address, while the connection lives
  std::string failed;                 // the last refusal, waiting for its connection's close
  RefusalLog refusals(who);
  try {
    for (;;) {
      if (!wait_readable(pair, refusals)) continue;
      const std::optional<MonitorEvent> e = read_event(pair);
      if (!e) continue;
      const uint16_t event = e->event;
      const int32_t value = e->value;
      if (event == ZMQ_EVENT_MONITOR_STOPPED) return;
      if (event == ZMQ_EVENT_ACCEPTED) {
        peers[value] = peer_of(value);
      } else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL ||
                 event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ||
                 event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
        failed = event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH
                     ? "authentication refused"
                     : fmt::format("protocol error 0x{:x} (a plaintext peer, or one using another "
                                   "server key)",
                                   value);
      } else if (event == ZMQ_EVENT_DISCONNECTED) {
        const std::string peer = peers.count(value) ? peers[value] : std::string();
        peers.erase(value);
        if (!failed.empty())
          refusals.refused(fmt::format("a peer {} on {} at the handshake: {}",
                                       peer.empty() ? "(address gone)" : peer, e->address,
                                       failed));
        failed.clear();
      }
    }
  } catch (const zmq::error_t&) {
  }
}

}  // namespace

bool curve_available() {
  return zmq_has("curve") != 0;
}

void write_job_keys(const fs::path& dir) {
  MOETRAIN_CHECK(curve_available(),
                 "this libzmq was built without CURVE (zmq_has(\"curve\") is false): "
                 "no keys can be made; run the job with --insecure");
  fs::create_directories(dir);
  const fs::path pub = dir / kPublicKeyFile, sec = dir / kSecretKeyFile;
  MOETRAIN_CHECK(!fs::exists(pub) && !fs::exists(sec),
                 "'{}' already holds a job key pair; refusing to overwrite it", dir.string());
  char p[41] = {}, s[41] = {};
  MOETRAIN_CHECK(zmq_curve_keypair(p, s) == 0, "zmq_curve_keypair failed: {}",
                 zmq_strerror(zmq_errno()));
  write_private(sec, s);
  write_private(pub, p);
}

JobKeys read_job_keys(const fs::path& dir) {
  // As ssh does with a private key: a secret others can read is no secret, so the job is refused
  // rather than keyed with it. keygen writes it 0600.
  const fs::path secret = dir / kSecretKeyFile;
  struct stat st {};
  if (::stat(secret.c_str(), &st) == 0 && (st.st_mode & 077) != 0)
    MOETRAIN_FAIL("'{}' has mode {:04o}; it must be readable by its owner only (chmod 600 {})",
                  secret.string(), st.st_mode & 07777, secret.string());
  JobKeys k{read_key(dir / kPublicKeyFile), read_key(secret)};
  char derived[41] = {};
  MOETRAIN_CHECK(zmq_curve_public(derived, k.secret_key.c_str()) == 0,
                 "'{}': not a Z85 secret key", (dir / kSecretKeyFile).string());
  MOETRAIN_CHECK(k.public_key == derived, "'{}' and '{}' are not one key pair",
                 (dir / kPublicKeyFile).string(), (dir / kSecretKeyFile).string());
  return k;
}

void use_curve(const JobKeys& keys) {
  MOETRAIN_CHECK(curve_available(),
                 "this libzmq was built without CURVE (zmq_has(\"curve\") is false); run the job "
                 "with --insecure");
  std::lock_guard lock(g_mu);
  g_keys = keys;
}

void use_plaintext() {
  std::lock_guard lock(g_mu);
  g_keys.reset();
}

bool curve_enabled() {
  std::lock_guard lock(g_mu);
  return g_keys.has_value();
}

void secure_client(zmq::socket_t& s) {
  std::lock_guard lock(g_mu);
  if (!g_keys) return;
  s.set(zmq::sockopt::curve_serverkey, g_keys->public_key);
  s.set(zmq::sockopt::curve_publickey, g_keys->public_key);
  s.set(zmq::sockopt::curve_secretkey, g_keys->secret_key);
}

void secure_server(zmq::context_t& ctx, zmq::socket_t& s) {
  std::lock_guard lock(g_mu);
  if (!g_keys) return;
  // One ZAP handler per context: a second bind of the ZAP endpoint fails when one is there.
  zmq::socket_t rep(ctx, zmq::socket_type::rep);
  rep.set(zmq::sockopt::linger, 0);
  bool bound = true;
  try {
    rep.bind("inproc://zeromq.zap.01");
  } catch (const zmq::error_t& e) {
    MOETRAIN_CHECK(e.num() == EADDRINUSE, "cannot start the ZAP handler: {}", e.what());
    bound = false;
  }
  if (bound) {
    std::array<uint8_t, 32> pub{};
    zmq_z85_decode(pub.data(), g_keys->public_key.c_str());
    std::thread(zap_loop, std::move(rep), pub).detach();
  }
  s.set(zmq::sockopt::curve_server, true);
  s.set(zmq::sockopt::curve_secretkey, g_keys->secret_key);
  s.set(zmq::sockopt::zap_domain, "moetrain");
}

void watch_handshakes(zmq::context_t& ctx, zmq::socket_t& s, const std::string& who) {
  zmq::socket_t pair =
      monitor_socket(ctx, s,
                     ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED |
                         ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                         ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH);
  std::thread(monitor_loop, std::move(pair), who).detach();
}

struct ClientHandshakes::State {
  mutable std::mutex mu;
  std::string refused;
  int closed = 0;        // connections closed at the handshake
  bool succeeded = false;
};

ClientHandshakes::ClientHandshakes(zmq::context_t& ctx, zmq::socket_t& s)
    : state_(std::make_shared<State>()) {
  zmq::socket_t pair = monitor_socket(
      ctx, s,
      ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_DISCONNECTED |
          ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
          ZMQ_EVENT_HANDSHAKE_FAILED_AUTH);
  std::thread([pair = std::move(pair), st = state_]() mutable {
    try {
      for (;;) {
        const std::optional<MonitorEvent> e = read_event(pair);
        if (!e) continue;
        const uint16_t event = e->event;
        const int32_t value = e->value;
        if (event == ZMQ_EVENT_MONITOR_STOPPED) return;
        std::lock_guard lock(st->mu);
        if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
          st->succeeded = true;
        } else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
          st->refused = fmt::format("authentication refused (status {})", value);
        } else if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL ||
                   event == ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL) {
          st->refused = fmt::format("protocol error 0x{:x}", value);
        } else if (event == ZMQ_EVENT_DISCONNECTED && !st->succeeded && ++st->closed >= 3) {
          st->refused = "it closed the connection at the handshake 3 times";
        }
      }
    } catch (const zmq::error_t&) {
    }
  }).detach();
}

std::string ClientHandshakes::refused() const {
  std::lock_guard lock(state_->mu);
  return state_->succeeded ? std::string() : state_->refused;
}

}  // namespace moetrain::ps
