// Optimizer state in a file (optim/offload_store.h): parameters, low-precision copy and state come
// out bitwise as with the state in memory, for every optimizer kind, with frozen ranges and a bf16
// copy, whatever the chunk size; the file goes when the optimizer goes; a step over 400 MiB of
// state keeps only the ring of chunks resident; under a memory cgroup whose limit lies between
// the offloaded and the in-memory footprint, the offloaded process completes and the in-memory
// one is killed; a checkpoint of offloaded state moves it a window at a time.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/comm.h"
#include "io/checkpoint.h"
#include "optim/offload_store.h"
#include "optim/sharded_optimizer.h"
#include "support/temp_dir.h"

using namespace moetrain;
using namespace moetrain::testing;
namespace fs = std::filesystem;

namespace {

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Three groups (decay, none, decay) over n elements.
std::vector<ParamRange> groups_of(int64_t n) {
  const int64_t a = n / 3, b = n / 2;
  return {{0, a, true}, {a, b - a, false}, {b, n - b, true}};
}

struct Outcome {
  std::vector<float> params;
  std::vector<uint16_t> lp;
  std::vector<std::vector<float>> state;  // per piece × buffer, flattened per buffer
};

// `steps` steps of `config` over n elements cut into three pieces (a gap left unowned), with
// gradients from a fixed seed, frozen ranges that change every step and a bf16 copy.
Outcome run(const OptimizerConfig& config, int64_t n, int steps, const StateOffload& offload) {
  const std::vector<ParamRange> groups = groups_of(n);
  const std::vector<OptimPiece> pieces = {{0, n / 4}, {n / 4 + 7, n / 2}, {3 * n / 4 + 11, n / 4 - 11}};
  ShardedOptimizer opt(config, groups, pieces, offload);
  Outcome r;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  r.params.resize(static_cast<std::size_t>(n));
  for (float& p : r.params) p = normal(rng);
  r.lp.assign(static_cast<std::size_t>(n), 0);
  std::vector<float> grads(static_cast<std::size_t>(n));
  for (int t = 1; t <= steps; ++t) {
    for (float& g : grads) g = normal(rng) * 0.1f;
    const std::vector<FrozenRange> frozen = {{n / 10 + t * 97, n / 20}, {n / 2 + t * 13, 999}};
    opt.step(r.params.data(), grads.data(), 1e-2f * static_cast<float>(t), frozen,
             {DType::BF16, r.lp.data()});
  }
  for (std::size_t k = 0; k < pieces.size(); ++k)
    for (int s = 0; s < static_cast<int>(opt.state_names().size()); ++s) {
      const std::span<float> v = opt.piece_state(k, s);
      r.state.emplace_back(v.begin(), v.end());
    }
  return r;
}

struct Kind {
  const char* name;
  OptimizerConfig config;
};

std::vector<Kind> kinds() {
  OptimizerConfig adamw = default_optimizer_config(OptimizerKind::AdamW);
  OptimizerConfig sgd = default_optimizer_config(OptimizerKind::Sgd);
  sgd.weight_decay = 0.01;
  sgd.nesterov = true;
  OptimizerConfig rms = default_optimizer_config(OptimizerKind::RmsProp);
  rms.centered = true;
  rms.momentum = 0.9;
  rms.weight_decay = 0.01;
  OptimizerConfig ada = default_optimizer_config(OptimizerKind::AdaGrad);
  ada.initial_accumulator_value = 0.1;  // written into the file at creation
  ada.lr_decay = 0.01;
  ada.weight_decay = 0.01;
  return {{"adamw", adamw}, {"sgd_momentum", sgd}, {"rmsprop_centered", rms}, {"adagrad", ada}};
}

// VmRSS or VmHWM of this process, bytes.
int64_t proc_status_kb(const char* key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::atoll(line.c_str() + std::strlen(key)) * 1024;
  return -1;
}

}  // namespace

TEST(Offload, EveryOptimizerBitwiseAsInMemory) {
  TempDir tmp("offload_bitwise");
  const int64_t n = 200003;
  for (const Kind& k : kinds()) {
    const Outcome mem = run(k.config, n, 4, {});
    // Chunks much smaller than a piece (cut through segments and frozen ranges), and one larger.
    for (int64_t chunk : {int64_t{1024}, int64_t{8192}, int64_t{1} << 20}) {
      const fs::path file = tmp / fmt::format("{}-{}.bin", k.name, chunk);
      const Outcome off = run(k.config, n, 4, {file.string(), chunk});
      EXPECT_FALSE(fs::exists(file)) << "the state file outlived its optimizer";
      EXPECT_TRUE(same_bits(mem.params, off.params)) << k.name << ", chunk " << chunk;
      EXPECT_EQ(mem.lp, off.lp) << k.name << ", chunk " << chunk;
      ASSERT_EQ(mem.state.size(), off.state.size());
      for (std::size_t s = 0; s < mem.state.size(); ++s)
        EXPECT_TRUE(same_bits(mem.state[s], off.state[s]))
            << k.name << ", chunk " << chunk << ", state buffer " << s;
    }
  }
}

TEST(Offload, StateWrittenThroughTheMapIsWhatTheNextStepReads) {
  // A checkpoint load writes into piece_state(); the next step must start from those values.
  TempDir tmp("offload_map");
  const int64_t n = 50000;
  const OptimizerConfig c = default_optimizer_config(OptimizerKind::AdamW);
  const std::vector<ParamRange> groups = groups_of(n);
  ShardedOptimizer mem(c, groups, {{0, n}});
  ShardedOptimizer off(c, groups, {{0, n}}, {(tmp / "s.bin").string(), 4096});
  std::vector<float> pm(n), po(n), g(n);
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < n; ++i) pm[i] = po[i] = normal(rng), g[i] = normal(rng);
  for (int s = 0; s < 2; ++s) {
    for (int64_t i = 0; i < n; ++i) {
      const float v = std::abs(normal(rng));
      mem.piece_state(0, s)[i] = v;
      off.piece_state(0, s)[i] = v;
    }
  }
  mem.set_step_count(5), off.set_step_count(5);
  mem.step(pm.data(), g.data(), 1e-3f);
  off.step(po.data(), g.data(), 1e-3f);
  EXPECT_TRUE(same_bits(pm, po));
  for (int s = 0; s < 2; ++s) EXPECT_TRUE(same_bits(mem.piece_state(0, s), off.piece_state(0, s)));
}

TEST(Offload, UnwritableFileIsAnErrorNamingIt) {
  try {
    OffloadStore store("/proc/offload-test/none.bin", {1000}, {0.0f}, 1024);
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("/proc/offload-test/none.bin"), std::string::npos)
        << e.what();
  }
}

TEST(Offload, ResidentMemoryStaysWithinTheRing) {
  // 400 MiB of AdamW state (2 × 50 Mi elements); parameters and gradients are allocated first.
  TempDir tmp("offload_rss");
  const int64_t n = int64_t{50} << 20;
  std::vector<float> params(static_cast<std::size_t>(n), 0.5f), grads(params.size(), 0.25f);
  const OptimizerConfig c = default_optimizer_config(OptimizerKind::AdamW);
  const std::vector<ParamRange> groups = groups_of(n);
  const int64_t before = proc_status_kb("VmRSS:");
  // Resets VmHWM to the current RSS (Linux ≥ 4.0), so that it is the peak of what follows.
  { std::ofstream("/proc/self/clear_refs") << "5"; }
  ASSERT_LE(proc_status_kb("VmHWM:") - before, int64_t{8} << 20) << "clear_refs did not reset VmHWM";
  int64_t ring = 0;
  {
    ShardedOptimizer opt(c, groups, {{0, n}}, {(tmp / "s.bin").string()});
    ring = opt.offload_store()->ring_bytes();
    EXPECT_EQ(opt.offload_store()->file_bytes(), 2 * n * 4);
    for (int t = 0; t < 2; ++t) opt.step(params.data(), grads.data(), 1e-3f);
    EXPECT_NE(params[n - 1], 0.5f);
  }
  const int64_t peak = proc_status_kb("VmHWM:") - before;
  std::printf("state %lld MiB, ring %lld MiB, peak VmRSS growth %.1f MiB\n",
              static_cast<long long>((2 * n * 4) >> 20), static_cast<long long>(ring >> 20),
              static_cast<double>(peak) / (1 << 20));
  EXPECT_LT(peak, ring + (int64_t{16} << 20)) << "resident memory grew by more than the ring";
}

TEST(Offload, CheckpointMovesTheStateAWindowAtATime) {
  // 128 MiB of AdamW state (2 × 16 Mi elements), 32 checkpoint windows: written to a checkpoint,
  // verified, and read back into a second offloaded optimizer, it comes back bitwise, while
  // resident memory grows by a few windows (the writer's buffer, the reader's buffer and the
  // checkpoint file's pages of one window), not by the state. Mapping the store whole (or
  // reading the checkpoint file without handing its pages back) grows it by 128 MiB.
  TempDir tmp("offload_ckpt");
  const int64_t n = int64_t{16} << 20;
  const OptimizerConfig c = default_optimizer_config(OptimizerKind::AdamW);
  const std::vector<ParamRange> groups = groups_of(n);
  ShardedOptimizer from(c, groups, {{0, n}}, {(tmp / "from.bin").string()});
  ShardedOptimizer into(c, groups, {{0, n}}, {(tmp / "into.bin").string()});
  const int64_t step = kCheckpointWindow / 4;
  {
    std::vector<float> v(static_cast<std::size_t>(step));
    for (int s = 0; s < 2; ++s)
      for (int64_t at = 0; at < n; at += step) {
        for (int64_t i = 0; i < step; ++i) v[i] = static_cast<float>((at + i) % 9973) * (s + 1);
        from.write_state(0, s, at, step, v.data());
      }
  }
  // The pieces as the trainer's checkpoint_share makes them for offloaded state.
  auto share_of = [&](ShardedOptimizer& o) {
    CheckpointShare share;
    for (int s = 0; s < 2; ++s) {
      TensorPiece t{o.state_names()[s] + ".w", {n}, 0, n};
      t.get = [&o, s](int64_t at, int64_t k, float* buf) { o.read_state(0, s, at, k, buf); };
      t.put = [&o, s](int64_t at, int64_t k, const float* buf) { o.write_state(0, s, at, k, buf); };
      share.optimizer.push_back(std::move(t));
    }
    return share;
  };
  const int64_t before = proc_status_kb("VmRSS:");
  { std::ofstream("/proc/self/clear_refs") << "5"; }
  ASSERT_LE(proc_status_kb("VmHWM:") - before, int64_t{8} << 20)
      << "clear_refs did not reset VmHWM";
  auto comm = make_local_comm();
  const CheckpointDocs docs{{{"model_type", "test"}}, {{"step", 1}}, {}};
  const fs::path dir = write_checkpoint(*comm, tmp / "run", 1, share_of(from), docs, 1);
  verify_checkpoint(dir);
  read_checkpoint_pieces(dir, share_of(into));
  const int64_t peak = proc_status_kb("VmHWM:") - before;
  std::printf("state 128 MiB, window %lld MiB, peak VmRSS growth %.1f MiB\n",
              static_cast<long long>(kCheckpointWindow >> 20),
              static_cast<double>(peak) / (1 << 20));
  EXPECT_LT(peak, 3 * kCheckpointWindow + (int64_t{8} << 20))
      << "resident memory grew by more than a few checkpoint windows";
  std::vector<float> a(static_cast<std::size_t>(step)), b(a.size());
  for (int s = 0; s < 2; ++s)
    for (int64_t at = 0; at < n; at += step) {
      from.read_state(0, s, at, step, a.data());
      into.read_state(0, s, at, step, b.data());
      ASSERT_TRUE(same_bits(a, b)) << "state buffer " << s << " at " << at;
    }
}

// The body of the cgroup test, run in a process of its own (re-executed test binary) that has
// joined the group: steps AdamW over MOETRAIN_OFFLOAD_CHILD elements, state in a file when
// MOETRAIN_OFFLOAD_FILE is set.
TEST(OffloadCgroup, Child) {
  const char* elements = std::getenv("MOETRAIN_OFFLOAD_CHILD");
  if (!elements) GTEST_SKIP() << "runs only inside OffloadCgroup.AdamStateBeyondTheLimit";
  const char* file = std::getenv("MOETRAIN_OFFLOAD_FILE");
  const int64_t n = std::atoll(elements);
  std::vector<float> params(static_cast<std::size_t>(n), 0.5f), grads(params.size(), 0.25f);
  const std::vector<ParamRange> groups = groups_of(n);
  ShardedOptimizer opt(default_optimizer_config(OptimizerKind::AdamW), groups, {{0, n}},
                       {file ? std::string(file) : std::string()});
  for (int t = 0; t < 2; ++t) opt.step(params.data(), grads.data(), 1e-3f);
  EXPECT_NE(params[n - 1], 0.5f);
}

TEST(OffloadCgroup, AdamStateBeyondTheLimit) {
  const fs::path root = "/sys/fs/cgroup/memory";
  const fs::path group = root / fmt::format("moetrain-offload-test-{}", ::getpid());
  if (::mkdir(group.c_str(), 0755) != 0)
    GTEST_SKIP() << "cannot create a memory cgroup under " << root << ": " << std::strerror(errno);
  struct Cleanup {
    fs::path g;
    ~Cleanup() { ::rmdir(g.c_str()); }
  } cleanup{group};
  // 24 Mi elements: parameters + gradients 192 MiB, AdamW state 192 MiB. The limit lies between
  // what the offloaded process needs (192 MiB + the ring of 24 MiB + the binary) and what the
  // in-memory one needs (384 MiB and more).
  const int64_t n = int64_t{24} << 20;
  const int64_t limit = int64_t{192 + 96} << 20;
  auto write = [&](const char* name, const std::string& value) {
    std::ofstream f(group / name);
    f << value;
    f.flush();
    return f.good();
  };
  ASSERT_TRUE(write("memory.limit_in_bytes", std::to_string(limit)));
  if (fs::exists(group / "memory.memsw.limit_in_bytes"))
    write("memory.memsw.limit_in_bytes", std::to_string(limit));
  write("memory.swappiness", "0");
  TempDir tmp("offload_cgroup");
  auto child = [&](bool offload) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      const std::string procs = (group / "cgroup.procs").string();
      const int fd = ::open(procs.c_str(), O_WRONLY);
      if (fd < 0 || ::write(fd, "0", 1) != 1) ::_exit(90);
      ::close(fd);
      ::setenv("MOETRAIN_OFFLOAD_CHILD", std::to_string(n).c_str(), 1);
      if (offload) ::setenv("MOETRAIN_OFFLOAD_FILE", (tmp / "s.bin").c_str(), 1);
      ::setenv("OMP_NUM_THREADS", "1", 1);
      char filter[] = "--gtest_filter=OffloadCgroup.Child";
      char exe[] = "/proc/self/exe";
      char* argv[] = {exe, filter, nullptr};
      ::execv(exe, argv);
      ::_exit(91);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    return status;
  };
  auto read_value = [&](const char* name) {
    std::ifstream f(group / name);
    int64_t v = -1;
    f >> v;
    return v;
  };
  const int with = child(true);
  const int64_t with_peak = read_value("memory.max_usage_in_bytes");
  std::printf("limit %lld MiB; offloaded process: peak usage of the group %.1f MiB\n",
              static_cast<long long>(limit >> 20), static_cast<double>(with_peak) / (1 << 20));
  EXPECT_TRUE(WIFEXITED(with) && WEXITSTATUS(with) == 0)
      << "the offloaded process did not complete under the limit: status " << with;
  const int without = child(false);
  EXPECT_TRUE(WIFSIGNALED(without) && WTERMSIG(without) == SIGKILL)
      << "the in-memory process was not killed by the memory cgroup: status " << without;
  EXPECT_LE(with_peak, limit);
  std::ifstream oom(group / "memory.oom_control");
  std::string oom_text((std::istreambuf_iterator<char>(oom)), std::istreambuf_iterator<char>());
  EXPECT_NE(oom_text.find("oom_kill 1"), std::string::npos)
      << "the memory cgroup's OOM killer did not kill once: " << oom_text;
}
