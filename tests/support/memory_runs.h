// Test support for the memory estimate against real processes: a shell command's output and exit
// status, the settings of an LM of about 26 M parameters (a few seconds a step on 2 cores), the
// dry run's per-rank table parsed back into bytes.
#pragma once
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

namespace moetrain::testing {

struct ShellResult {
  int code = -1;
  std::string output;  // stdout and stderr together
};

inline ShellResult shell(const std::string& cmd) {
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {-1, "popen failed: " + cmd};
  std::string out;
  std::array<char, 4096> buf{};
  while (std::size_t n = fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// The figure of a start-up refusal, "this run needs about X GiB of memory per rank", in GiB; -1
// when the output has none.
inline double needed_gib(const std::string& output) {
  std::smatch m;
  if (!std::regex_search(output, m, std::regex(R"(this run needs about ([0-9.]+) GiB of memory)")))
    return -1;
  return std::stod(m[1]);
}

inline bool have_mpiexec() {
  return shell("command -v mpiexec").code == 0;
}

inline constexpr const char* kMpiexec =
    "mpiexec --allow-run-as-root --oversubscribe -x OMP_NUM_THREADS=1";

// 4 layers of dim 256, 8 experts of hidden 1024 (top-2) over bytes: 26.1 M parameters, whose
// state (104 MB of weights, as much of gradients, twice that of AdamW moments) outweighs the
// activations of its 4 × 64-token micro-batch. `data` holds a prepared corpus; no evaluation or
// checkpoint before the end.
inline std::string memory_model_args(const std::string& data, const std::string& run,
                                     int steps) {
  std::string a = std::string(" train --config ") + MOETRAIN_SOURCE_DIR + "/configs/tiny.toml";
  for (const std::string& s :
       {std::string("model.dim=256"), std::string("model.n_layers=4"),
        std::string("model.n_heads=4"), std::string("model.n_kv_heads=2"),
        std::string("model.expert_hidden=1024"), std::string("model.n_experts=8"),
        std::string("model.top_k=2"), std::string("model.max_seq_len=64"),
        std::string("train.batch_size=4"), std::string("train.seq_len=64"),
        std::string("train.eval_every=0"), std::string("train.eval_batches=1"),
        std::string("train.checkpoint_every=0"), std::string("train.progress=off"),
        std::string("train.precision=f32"), std::string("optim.warmup_steps=1"),
        "train.steps=" + std::to_string(steps), "data.dir=" + data, "train.run_dir=" + run})
    a += " --set " + s;
  return a;
}

// The rows of `moetrain train --dry-run`'s memory table: name → bytes ("parameters",
// "gradients", "optimizer state", "low-precision copy", "activations", "buffers",
// "process baseline", "total").
inline std::map<std::string, double> memory_table(const std::string& output) {
  std::map<std::string, double> rows;
  const std::regex row(R"(^  ([a-z -]+?)\s+[0-9.]+ (?:MiB|GiB)\s+([0-9]+) bytes$)");
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    std::smatch m;
    if (std::regex_match(line, m, row)) rows[m[1]] = std::stod(m[2]);
  }
  return rows;
}

}  // namespace moetrain::testing
