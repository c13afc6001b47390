// ZeroMQ CURVE for the parameter server. One job key pair is shared by every member of a job:
// binding sockets are CURVE servers with its secret key, connecting sockets present its public
// key as their own and use it as the server's, and a ZAP handler admits only clients whose
// long-term key is the job's. CURVE makes a client prove it holds the secret of the key it
// presents, so only holders of the job secret get past the handshake; a refused peer is logged.
#pragma once
#include <zmq.hpp>

#include <filesystem>
#include <memory>
#include <string>

namespace moetrain::ps {

struct JobKeys {
  std::string public_key;  // Z85, 40 characters
  std::string secret_key;
};

// Whether this libzmq can do CURVE (built with libsodium or its own tweetnacl).
bool curve_available();

// `dir`/job.public and `dir`/job.secret, Z85 text, mode 0600. Refuses to overwrite a key pair.
inline constexpr const char* kPublicKeyFile = "job.public";
inline constexpr const char* kSecretKeyFile = "job.secret";
void write_job_keys(const std::filesystem::path& dir);
// Reads and checks the pair (40 Z85 characters each, the public key derived from the secret).
JobKeys read_job_keys(const std::filesystem::path& dir);

// The process-wide choice, made once at start by the role's command line: every socket that
// transport.h makes afterwards is CURVE with `keys`, or plaintext after use_plaintext().
// Until either is called, sockets are plaintext (in-process tests and benchmarks).
void use_curve(const JobKeys& keys);
void use_plaintext();
bool curve_enabled();

// Applies the choice to a socket before connect() / bind().
void secure_client(zmq::socket_t& s);
void secure_server(zmq::context_t& ctx, zmq::socket_t& s);
// After bind(): logs the handshakes this socket refuses (ZAP denial, plaintext peer, wrong server
// key) with the peer's address where the kernel still knows it: the first of every 10 s in full,
// the others of those 10 s counted in one line, so a flood of bad connections cannot flood the
// log.
void watch_handshakes(zmq::context_t& ctx, zmq::socket_t& s, const std::string& who);

// A connecting socket's view of its handshakes: whether the peer refused it (an explicit refusal,
// or the connection closed at the handshake three times without one succeeding, which is what a
// server with another key pair does).
class ClientHandshakes {
 public:
  // Before connect().
  ClientHandshakes(zmq::context_t& ctx, zmq::socket_t& s);
  // Empty while nothing was refused; else what happened.
  std::string refused() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace moetrain::ps
