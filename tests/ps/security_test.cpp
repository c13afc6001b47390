// CURVE on every parameter-server socket: keygen writes a private pair; a job launched with its
// defaults is keyed and trains; a forged Register, from a plaintext socket or from a CURVE
// socket that knows the public key but not the job secret, never reaches the scheduler.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <zmq.hpp>

#include <functional>
#include <future>
#include <memory>
#include <sstream>
#include <thread>
#include <string>
#include <vector>

#include "core/check.h"
#include "ps/message.h"
#include "ps/process.h"  // tests/ps/process.h
#include "ps/security.h"
#include "support/corpus.h"
#include "support/temp_dir.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

constexpr const char* kForgedPid = "424242";

TEST(PsSecurity, LibzmqHasCurve) {
  EXPECT_TRUE(zmq_has("curve")) << "this libzmq was built without CURVE";
  EXPECT_TRUE(ps::curve_available());
}

TEST(PsSecurity, KeygenWritesAPrivatePairAndNeverOverwrites) {
  TempDir tmp("ps_keygen");
  Process a({"ps", "keygen", (tmp / "k").string()}, tmp / "a.log");
  ASSERT_EQ(a.wait(30), 0) << a.output();
  for (const char* f : {ps::kPublicKeyFile, ps::kSecretKeyFile}) {
    struct stat st {};
    ASSERT_EQ(::stat((tmp / "k" / f).c_str(), &st), 0) << f;
    EXPECT_EQ(st.st_mode & 0777, 0600u) << f;
  }
  const ps::JobKeys k = ps::read_job_keys(tmp / "k");
  EXPECT_EQ(k.public_key.size(), 40u);
  const std::string before = k.secret_key;
  Process b({"ps", "keygen", (tmp / "k").string()}, tmp / "b.log");
  EXPECT_NE(b.wait(30), 0);
  EXPECT_NE(b.output().find("refusing to overwrite"), std::string::npos) << b.output();
  EXPECT_EQ(ps::read_job_keys(tmp / "k").secret_key, before);
  // A role without keys and without --insecure does not start.
  Process c({"ps", "worker", "--scheduler", "tcp://127.0.0.1:1"}, tmp / "c.log");
  EXPECT_NE(c.wait(30), 0);
  EXPECT_NE(c.output().find("--insecure"), std::string::npos) << c.output();
}

// A job secret that group or others may read is refused, naming the file and its mode, as ssh
// refuses such a private key; the pair keygen wrote (0600) is accepted.
TEST(PsSecurity, ASecretReadableByOthersIsRefused) {
  TempDir tmp("ps_secret_mode");
  ps::write_job_keys(tmp / "k");
  const fs::path secret = tmp / "k" / ps::kSecretKeyFile;
  EXPECT_EQ(ps::read_job_keys(tmp / "k").secret_key.size(), 40u);
  for (const auto& [mode, text] : {std::pair{0644, "0644"}, {0640, "0640"}, {0604, "0604"}}) {
    ASSERT_EQ(::chmod(secret.c_str(), mode), 0);
    try {
      (void)ps::read_job_keys(tmp / "k");
      ADD_FAILURE() << "mode " << text << " accepted";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(secret.string() + "' has mode " + text), std::string::npos) << what;
      EXPECT_NE(what.find("readable by its owner only (chmod 600"), std::string::npos) << what;
    }
  }
  ASSERT_EQ(::chmod(secret.c_str(), 0400), 0);
  EXPECT_EQ(ps::read_job_keys(tmp / "k").secret_key.size(), 40u);
}

// Sends a Register as a would-be worker from a socket set up by `setup` (plaintext when it
// does nothing) and waits briefly for any answer; returns whether one came.
bool forge_register(const std::string& endpoint, const std::function<void(zmq::socket_t&)>& setup) {
  zmq::context_t ctx;
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  setup(s);
  s.connect(endpoint);
  ps::Header h;
  h.kind = static_cast<uint16_t>(ps::Kind::Register);
  h.sender = -1;
  h.flags = static_cast<uint32_t>(ps::Encoding::Json);
  const std::string frame =
      ps::encode(h, std::string(R"({"role":"worker","pid":)") + kForgedPid + "}");
  s.send(zmq::buffer(frame), zmq::send_flags::none);
  zmq::pollitem_t item{s.handle(), 0, ZMQ_POLLIN, 0};
  return zmq::poll(&item, 1, std::chrono::milliseconds(1000)) > 0;
}

struct Forged {
  int code = -1;
  std::string output;
  int64_t updates = -1;
  std::vector<bool> answered;
  bool ran_throughout = false;  // the job was still running after the last forgery
};

Forged run_with_forgeries(const TempDir& tmp, bool insecure) {
  write_corpus(tmp / "data", 60000);
  const int steps = 40;
  std::vector<std::string> args = {"ps", "launch",    "--timeout", "120",        "--servers",
                                   "1",  "--workers", "1",         "--slowdown", "0=30"};
  if (insecure) args.push_back("--insecure");
  args.insert(args.end(), {"--", "train"});
  for (const auto& s : as_set_args(tiny_ps_overrides(tmp / "data", tmp / "run", steps, 2)))
    args.push_back(s);
  Process job(args, tmp / "launch.log");
  Forged f;
  if (!wait_for_file(tmp / "run" / "ps" / "job.json", 60)) {
    f.output = job.output();
    return f;
  }
  std::string endpoint;
  std::ifstream(tmp / "run" / "ps" / "scheduler.endpoint") >> endpoint;
  // The forgeries run side by side, so the job (about 5 s) outlasts them with room to spare.
  std::vector<std::function<void(zmq::socket_t&)>> setups = {[](zmq::socket_t&) {}};
  if (!insecure) {
    const ps::JobKeys job_keys = ps::read_job_keys(tmp / "run" / "ps" / "keys");
    char pub[41] = {}, sec[41] = {};
    zmq_curve_keypair(pub, sec);
    const std::string own_pub = pub, own_sec = sec;
    // Knows the job's public key, presents a key pair of its own.
    setups.push_back([=](zmq::socket_t& s) {
      s.set(zmq::sockopt::curve_serverkey, job_keys.public_key);
      s.set(zmq::sockopt::curve_publickey, own_pub);
      s.set(zmq::sockopt::curve_secretkey, own_sec);
    });
    // Takes its own key for the server's.
    setups.push_back([=](zmq::socket_t& s) {
      s.set(zmq::sockopt::curve_serverkey, own_pub);
      s.set(zmq::sockopt::curve_publickey, own_pub);
      s.set(zmq::sockopt::curve_secretkey, own_sec);
    });
  }
  std::vector<std::future<bool>> answers;
  for (const auto& setup : setups)
    answers.push_back(std::async(std::launch::async, forge_register, endpoint, setup));
  for (auto& a : answers) f.answered.push_back(a.get());
  f.ran_throughout = job.running();
  f.code = job.wait(150);
  f.output = job.output();
  if (fs::exists(tmp / "run" / "ps" / "server_0.json"))
    f.updates = read_json(tmp / "run" / "ps" / "server_0.json")["updates"].get<int64_t>();
  return f;
}

TEST(PsSecurity, ForgedRegistersAreRefusedAndTheKeyedJobTrains) {
  TempDir tmp("ps_curve");
  Forged f = run_with_forgeries(tmp, false);
  ASSERT_EQ(f.code, 0) << f.output;
  ASSERT_TRUE(f.ran_throughout) << "the job ended before the forgeries were sent";
  ASSERT_EQ(f.answered.size(), 3u);
  for (std::size_t i = 0; i < f.answered.size(); ++i)
    EXPECT_FALSE(f.answered[i]) << "forgery " << i << " got an answer";
  EXPECT_EQ(f.output.find(std::string("pid ") + kForgedPid), std::string::npos) << f.output;
  EXPECT_EQ(f.updates, 40);
  EXPECT_GE(applied_steps(tmp / "run"), 40);
  // Each refusal is logged: the ZAP denial names the peer's address, the others the endpoint.
  EXPECT_NE(f.output.find("refused a CURVE peer from 127.0.0.1"), std::string::npos) << f.output;
  EXPECT_NE(f.output.find("protocol error"), std::string::npos) << f.output;
}

// The control: with --insecure the same forgery is answered and registered, so the test above
// can tell a refusal from a forgery that was never sent.
TEST(PsSecurity, InsecureJobAcceptsTheForgery) {
  TempDir tmp("ps_plain");
  Forged f = run_with_forgeries(tmp, true);
  ASSERT_TRUE(f.ran_throughout) << "the job ended before the forgery was sent";
  ASSERT_EQ(f.answered.size(), 1u) << f.output;
  EXPECT_TRUE(f.answered[0]);
  EXPECT_NE(f.output.find(std::string("pid ") + kForgedPid), std::string::npos) << f.output;
}

// A keyed scheduler by itself, and its log.
struct KeyedScheduler {
  std::string endpoint;
  std::unique_ptr<Process> process;
  KeyedScheduler(const TempDir& tmp, const std::string& keys) {
    process = std::make_unique<Process>(
        std::vector<std::string>{"ps", "scheduler", "--keys", keys, "--scheduler",
                                 "tcp://127.0.0.1:*", "--endpoint-file",
                                 (tmp / "endpoint").string(), "--set", "optim.grad_clip=0",
                                 "--set", "train.run_dir=" + (tmp / "run").string()},
        tmp / "scheduler.log");
    wait_for_file(tmp / "endpoint", 30);
    std::ifstream(tmp / "endpoint") >> endpoint;
  }
};

// A node with another key pair, or plaintext against a keyed job, stops at once saying the
// handshake was refused, instead of waiting out its registration timeout.
TEST(PsSecurity, APeerWithTheWrongKeysStopsAtOnceSayingSo) {
  TempDir tmp("ps_wrong_keys");
  Process({"ps", "keygen", (tmp / "ka").string()}, tmp / "ka.log").wait(30);
  Process({"ps", "keygen", (tmp / "kb").string()}, tmp / "kb.log").wait(30);
  KeyedScheduler sched(tmp, (tmp / "ka").string());
  ASSERT_FALSE(sched.endpoint.empty()) << sched.process->output();
  for (const std::vector<std::string>& security :
       {std::vector<std::string>{"--keys", (tmp / "kb").string()},
        std::vector<std::string>{"--insecure"}}) {
    std::vector<std::string> args = {"ps", "worker", "--scheduler", sched.endpoint};
    args.insert(args.end(), security.begin(), security.end());
    Process w(args, tmp / "worker.log");
    // Registration gives up after 30 s without an answer; the refusal is seen well before.
    const int code = w.wait(15);
    EXPECT_NE(code, -1) << security[0] << ": still waiting after 15 s";
    EXPECT_NE(code, 0);
    EXPECT_NE(w.output().find("refused the handshake"), std::string::npos) << w.output();
  }
}

// Forty plaintext peers in a moment: the first refusal is logged in full, the rest in one line.
TEST(PsSecurity, RefusedHandshakesAreSummarisedNotLoggedOneByOne) {
  TempDir tmp("ps_refusal_log");
  Process({"ps", "keygen", (tmp / "keys").string()}, tmp / "keys.log").wait(30);
  KeyedScheduler sched(tmp, (tmp / "keys").string());
  ASSERT_FALSE(sched.endpoint.empty()) << sched.process->output();
  {
    zmq::context_t ctx;
    std::vector<zmq::socket_t> peers;
    for (int i = 0; i < 40; ++i) {
      peers.emplace_back(ctx, zmq::socket_type::dealer);
      peers.back().set(zmq::sockopt::linger, 0);
      peers.back().set(zmq::sockopt::reconnect_ivl, 100000);  // one attempt each
      peers.back().connect(sched.endpoint);
    }
    std::this_thread::sleep_for(std::chrono::seconds(2));
  }
  // The summary comes once the first refusal's 10 s are over.
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(40);
  while (sched.process->output().find("more peer(s)") == std::string::npos &&
         std::chrono::steady_clock::now() < end)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  sched.process->kill(SIGTERM);
  sched.process->wait(30);
  const std::string log = sched.process->output();
  int refusal_lines = 0;
  std::istringstream in(log);
  for (std::string line; std::getline(in, line);)
    refusal_lines += line.find("refused") != std::string::npos;
  EXPECT_LE(refusal_lines, 4) << log;
  EXPECT_NE(log.find("refused a peer "), std::string::npos) << log;
  EXPECT_NE(log.find("more peer(s) at the handshake in the last"), std::string::npos) << log;
}

}  // namespace
