// Checkpoint write and load throughput (MB/s, 1 MB = 1e6 bytes) of a model's parameters and
// AdamW's two moments, against plain write() + fsync and read() of the same bytes by the same
// ranks in the same run. Each round, on every rank:
//   reference write   its share's bytes into one file, fsync
//   checkpoint write  write_checkpoint: its pieces (CRC-32C computed on the way out, fsync per
//                     file), then rank 0's manifest and commit; timed until every rank returns
//   reference read    its reference file back into memory
//   verify            find_latest_checkpoint: sizes of every file, CRC-32C of a share of them
//   load              read_checkpoint_pieces of its share (after verify)
// Files stay in the page cache between writing and reading (nothing here drops caches), so reads
// measure the cache, not the disk. Medians over the rounds; the rounds interleave the kinds so a
// shared machine's load drifts over all of them alike, and the two writes take turns going first.
//   build/bench/bench_checkpoint [--preset large|tiny] [--rounds 3] [--dir DIR]
//   mpiexec -n 2 build/bench/bench_checkpoint     (every rank writes and reads its share)
// large: C=512, 8 layers, 8 heads, E=8, F=1024 (the larger config of bench_train_step).
#include <fmt/format.h>

#include <fcntl.h>
#include <unistd.h>
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/log.h"
#include "core/timer.h"
#include "io/checkpoint.h"
#include "io/crc32c.h"
#include "model/params.h"
#include "parallel/runtime.h"

using namespace moetrain;
namespace fs = std::filesystem;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

ModelConfig preset(const std::string& name) {
  ModelConfig c;
  if (name == "tiny") {
    c.dim = 128, c.n_layers = 4, c.n_heads = 4, c.n_kv_heads = 2, c.expert_hidden = 256;
  } else {
    MOETRAIN_CHECK(name == "large", "--preset {}: expected large or tiny", name);
    c.dim = 512, c.n_layers = 8, c.n_heads = 8, c.n_kv_heads = 8, c.expert_hidden = 1024;
  }
  c.n_experts = 8, c.top_k = 2, c.max_seq_len = 256;
  return c;
}

void write_plain(const fs::path& path, const std::vector<const std::vector<float>*>& buffers) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  MOETRAIN_CHECK(fd >= 0, "cannot create {}", path.string());
  for (const auto* b : buffers) {
    const char* p = reinterpret_cast<const char*>(b->data());
    std::size_t n = b->size() * sizeof(float);
    while (n > 0) {
      ssize_t w = ::write(fd, p, std::min<std::size_t>(n, std::size_t{1} << 30));
      MOETRAIN_CHECK(w > 0, "cannot write {}", path.string());
      p += w, n -= static_cast<std::size_t>(w);
    }
  }
  MOETRAIN_CHECK(::fsync(fd) == 0, "cannot fsync {}", path.string());
  ::close(fd);
}

void read_plain(const fs::path& path, std::vector<char>& into) {
  into.resize(fs::file_size(path));
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  MOETRAIN_CHECK(fd >= 0, "cannot open {}", path.string());
  std::size_t at = 0;
  while (at < into.size()) {
    ssize_t r = ::read(fd, into.data() + at, std::min<std::size_t>(into.size() - at, 1u << 30));
    MOETRAIN_CHECK(r > 0, "cannot read {}", path.string());
    at += static_cast<std::size_t>(r);
  }
  ::close(fd);
}

volatile uint32_t crc_sink;  // keeps the timed checksums from being optimised away

double crc_gbps(bool hardware) {
  std::vector<uint8_t> buf(64 << 20, 0x5a);
  Timer t;
  int reps = 0;
  uint32_t c = 0;
  while (t.seconds() < 0.3 || reps < 2) {
    c = hardware ? crc32c_hardware(buf.data(), buf.size(), c)
                 : crc32c_table(buf.data(), buf.size(), c);
    ++reps;
  }
  crc_sink = c;
  return static_cast<double>(buf.size()) * reps / t.seconds() * 1e-9;
}

}  // namespace

int main(int argc, char** argv) {
  dist_init(&argc, &argv);
  std::string preset_name = "large", dir_arg;
  int rounds = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string a = argv[i];
    if (a == "--preset")
      preset_name = argv[i + 1];
    else if (a == "--rounds")
      rounds = std::max(1, std::atoi(argv[i + 1]));
    else if (a == "--dir")
      dir_arg = argv[i + 1];
    else {
      fmt::print(stderr, "unknown argument {}\n", a);
      return 2;
    }
  }
  try {
    auto comm = dist_world("bench_checkpoint");
    const int rank = comm->rank(), W = comm->size();
    const ModelConfig cfg = preset(preset_name);
    const ParamLayout layout(cfg);
    const auto& params = layout.params();

    // Each tensor (with its two moments) to the rank with the fewest bytes so far.
    std::vector<int64_t> load(static_cast<std::size_t>(W), 0);
    std::vector<int> owner(params.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      owner[i] = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
      load[owner[i]] += params[i].numel;
    }
    std::vector<std::vector<float>> values, back;
    CheckpointShare share, wanted;
    std::vector<const std::vector<float>*> plain;
    values.reserve(3 * params.size());
    back.reserve(3 * params.size());
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (owner[i] != rank) continue;
      const ParamInfo& p = params[i];
      for (const char* kind : {"", "exp_avg.", "exp_avg_sq."}) {
        values.emplace_back(static_cast<std::size_t>(p.numel));
        for (int64_t j = 0; j < p.numel; ++j)
          values.back()[j] = static_cast<float>((j * 2654435761u + i) % 1000) * 1e-3f;
        back.emplace_back(static_cast<std::size_t>(p.numel));
        auto& group = kind[0] == '\0' ? share.model : share.optimizer;
        auto& want = kind[0] == '\0' ? wanted.model : wanted.optimizer;
        group.push_back(whole_tensor(kind + p.name, p.shape, values.back().data()));
        want.push_back(whole_tensor(kind + p.name, p.shape, back.back().data()));
        plain.push_back(&values.back());
      }
    }
    int64_t mine = 0;
    for (const auto* v : plain) mine += static_cast<int64_t>(v->size() * sizeof(float));
    int64_t total = mine;
    comm->allreduce(&total, 1);

    std::string base = dir_arg;
    if (rank == 0 && base.empty())
      base = (fs::temp_directory_path() / fmt::format("bench_checkpoint_{}", ::getpid())).string();
    {
      int64_t n = static_cast<int64_t>(base.size());
      comm->broadcast(&n, sizeof(n));
      base.resize(static_cast<std::size_t>(n));
      comm->broadcast(base.data(), n);
    }
    const fs::path run = fs::path(base) / "run";
    if (rank == 0) fs::create_directories(run);
    comm->barrier();
    const fs::path ref = fs::path(base) / fmt::format("reference_{}.bin", rank);

    auto timed = [&](auto&& f) {
      comm->barrier();
      Timer t;
      f();
      comm->barrier();
      return t.seconds();
    };
    std::vector<double> ref_w, ckpt_w, ref_r, verify, load_s;
    std::vector<char> sink;
    for (int r = 0; r < rounds; ++r) {
      // Alternating which write goes first: the second meets the first's dirty pages.
      auto plain_write = [&] { ref_w.push_back(timed([&] { write_plain(ref, plain); })); };
      if (r % 2 == 0) plain_write();
      ckpt_w.push_back(timed([&] {
        write_checkpoint(*comm, run, r + 1, share, {{{"bench", true}}, {{"step", r + 1}}}, 1);
      }));
      if (r % 2 == 1) plain_write();
      ref_r.push_back(timed([&] { read_plain(ref, sink); }));
      std::optional<fs::path> found;
      verify.push_back(timed([&] { found = find_latest_checkpoint(run, comm.get()); }));
      MOETRAIN_CHECK(found.has_value(), "the checkpoint just written does not verify");
      load_s.push_back(timed([&] { read_checkpoint_pieces(*found, wanted); }));
      for (std::size_t k = 0; k < values.size(); ++k)
        MOETRAIN_CHECK(std::memcmp(values[k].data(), back[k].data(), values[k].size() * 4) == 0,
                       "tensor {} read back differs", k);
    }
    const double mb = static_cast<double>(total) / 1e6;
    auto rate = [&](const std::vector<double>& s) { return mb / median(s); };
    if (rank == 0) {
      fmt::print(
          "checkpoint of preset '{}': {:.1f}M parameters + 2 AdamW moments = {:.0f} MB, "
          "{} process(es), {} rounds, in {}\n",
          preset_name, static_cast<double>(layout.size()) / 1e6, mb, W, rounds, base);
      fmt::print(
          "  write: checkpoint {:7.0f} MB/s   plain write+fsync {:7.0f} MB/s   ratio {:.2f}\n",
          rate(ckpt_w), rate(ref_w), rate(ckpt_w) / rate(ref_w));
      fmt::print(
          "  load:  verify {:7.0f} MB/s   read {:7.0f} MB/s   verify+read {:7.0f} MB/s   "
          "plain read {:7.0f} MB/s   ratio {:.2f}\n",
          rate(verify), rate(load_s), mb / (median(verify) + median(load_s)), rate(ref_r),
          mb / (median(verify) + median(load_s)) / rate(ref_r));
      fmt::print("  CRC-32C on one core: SSE4.2 {:.1f} GB/s, table {:.1f} GB/s\n",
                 crc32c_hardware_available() ? crc_gbps(true) : 0.0, crc_gbps(false));
    }
    comm->barrier();
    if (rank == 0 && dir_arg.empty()) fs::remove_all(base);
    fs::remove(ref);
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    dist_abort(1);
  }
  dist_finalize();
  return 0;
}
