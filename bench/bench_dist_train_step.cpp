// Training steps under mpiexec with expert parallelism, communication overlap off and on, in the
// same run: each configuration trains `rounds` times, the configurations taking turns so that a
// shared machine's load drifts over all of them alike. Per configuration, medians over the steps
// (after two warm-up steps of each run) of the trainer's own per-step metrics:
//   step_ms      wall time of a step (slowest rank decides, since every step ends collectively)
//   compute_ms   step time minus exposed communication
//   a2a_ms       time inside the expert all-to-alls (rank 0; overlapped or not)
//   sync_ms      time inside the gradient reductions (rank 0; overlapped or not)
//   exposed_ms   communication the step waited for
//   efficiency   compute / (compute + exposed)
//   grad_kb      gradient bytes this rank sent (rank 0)
// Configurations: "blocking" (reductions after backward, one all-to-all per layer and direction),
// "overlap" (buckets reduced during backward), "overlap+chunks" (also --a2a-chunks 2). With
// --sparse 1 instead "dense" and "sparse" (grad.sparse_experts), both overlapped: what skipping
// the experts no token reached saves, e.g. many experts and few tokens:
//   mpiexec -n 2 build/bench/bench_dist_train_step --ep 1 --experts 64 --top-k 2 --seq 16
//   --batch 1 --dim 64 --bucket-mb 1 --sparse 1
//   mpiexec -n 2 build/bench/bench_dist_train_step [--steps 8] [--rounds 3] [--ep 2] [--dim 128]
//   [--batch 8] [--layers 2] [--bucket-mb 25] [--experts 8] [--top-k 2] [--seq 128] [--sparse 0]
// With --stages 1 instead "zero1", "zero2" and "zero3" (dist.zero, overlapped): what sharding the
// gradients and the parameters costs in step time, each against ZeRO-1 in the `vs_first` column:
//   mpiexec -n 2 build/bench/bench_dist_train_step --stages 1 --dim 256 --layers 4 --bucket-mb 4
// --bucket-mb sets the gradient bucket size (the first bucket too): a small model fits in one
// default 25 MiB bucket, which completes only at the end of backward and so overlaps nothing.
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/log.h"
#include "data/shard.h"
#include "data/tokenizer.h"
#include "parallel/runtime.h"
#include "train/run_config.h"
#include "train/trainer.h"

using namespace moetrain;
namespace fs = std::filesystem;

namespace {

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void write_corpus(const fs::path& dir) {
  std::string text;
  std::ifstream in("/usr/share/games/fortunes/fortunes", std::ios::binary);
  if (in) text.assign(std::istreambuf_iterator<char>(in), {});
  while (text.size() < 200000) text += "The quick brown fox jumps over the lazy dog.\n" + text;
  auto tokens = byte_encode(text);
  const size_t val = tokens.size() / 10;
  fs::create_directories(dir);
  write_token_shard(dir / "train.bin", tokens.data(), tokens.size() - val, kByteVocab);
  write_token_shard(dir / "val.bin", tokens.data() + tokens.size() - val, val, kByteVocab);
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided);
  int steps = 8, rounds = 3, ep = 0, dim = 128, batch = 8, layers = 2;
  int experts = 8, top_k = 2, seq = 128, sparse = 0, stages = 0;
  double bucket_mb = 0;  // 0: the trainer's defaults
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--steps") == 0) steps = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--rounds") == 0) rounds = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--ep") == 0) ep = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--dim") == 0) dim = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--batch") == 0) batch = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--layers") == 0) layers = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--bucket-mb") == 0) bucket_mb = std::atof(argv[i + 1]);
    if (std::strcmp(argv[i], "--experts") == 0) experts = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--top-k") == 0) top_k = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--seq") == 0) seq = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--sparse") == 0) sparse = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--stages") == 0) stages = std::atoi(argv[i + 1]);
  }
  int rank = 0, world = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  set_log_rank(rank);
  set_log_level(LogLevel::Warn);
  if (ep <= 0) ep = world;
  // One directory for all ranks: rank 0 names it.
  char dir_name[256] = {};
  if (rank == 0) {
    std::snprintf(dir_name, sizeof(dir_name), "%s/moetrain_bench_train_%d",
                  fs::temp_directory_path().c_str(), static_cast<int>(getpid()));
    write_corpus(fs::path(dir_name) / "data");
  }
  MPI_Bcast(dir_name, sizeof(dir_name), MPI_CHAR, 0, MPI_COMM_WORLD);
  const fs::path dir = dir_name;

  struct Variant {
    const char* name;
    bool overlap;
    int chunks;
    bool sparse = false;
    int zero = 0;
  };
  const std::vector<Variant> variants =
      stages   ? std::vector<Variant>{{"zero1", true, 1, false, 1},
                                      {"zero2", true, 1, false, 2},
                                      {"zero3", true, 1, false, 3}}
      : sparse ? std::vector<Variant>{{"dense", true, 1}, {"sparse", true, 1, true}}
               : std::vector<Variant>{
                     {"blocking", false, 1}, {"overlap", true, 1}, {"overlap+chunks", true, 2}};
  if (rank == 0)
    std::printf(
        "ranks %d, EP %d, dim %d, %d layers, %d experts top-%d, %d sequences of %d per rank, "
        "buckets %s MiB, median of %d steps\n"
        "%-16s %9s %10s %9s %11s %10s %8s %9s %8s\n",
        world, ep, dim, layers, experts, top_k, batch, seq,
        bucket_mb > 0 ? std::to_string(bucket_mb).c_str() : "1 + 25", (steps - 2) * rounds,
        "config", "step_ms", "compute_ms", "comm_ms", "exposed_ms", "efficiency", "overlap",
        "grad_kb", "vs_first");
  const int kVariants = static_cast<int>(variants.size());
  // Per variant: step, compute, communication, exposed, efficiency, overlap, bytes samples
  // (rank 0).
  std::vector<std::vector<std::vector<double>>> samples(variants.size());
  for (auto& v : samples) v.resize(7);
  for (int round = 0; round < rounds; ++round) {
    for (int vi = 0; vi < kVariants; ++vi) {
      const Variant& v = variants[vi];
      const fs::path run = dir / (std::string(v.name) + "_" + std::to_string(round));
      std::vector<std::string> sets = {
          "model.dim=" + std::to_string(dim),
          "model.n_layers=" + std::to_string(layers),
          "model.n_heads=4",
          "model.n_kv_heads=2",
          "model.expert_hidden=" + std::to_string(2 * dim),
          "model.n_experts=" + std::to_string(experts),
          "model.top_k=" + std::to_string(top_k),
          "model.max_seq_len=" + std::to_string(seq),
          "train.seq_len=" + std::to_string(seq),
          std::string("grad.sparse_experts=") + (v.sparse ? "true" : "false"),
          "train.batch_size=" + std::to_string(batch),
          "train.steps=" + std::to_string(steps),
          "train.eval_every=0",
          "train.eval_batches=1",
          "train.progress=off",
          "data.dir=" + (dir / "data").string(),
          "train.run_dir=" + run.string(),
          "dist.ep=" + std::to_string(ep),
          std::string("dist.overlap=") + (v.overlap ? "true" : "false"),
          "dist.a2a_chunks=" + std::to_string(v.chunks),
          "dist.zero=" + std::to_string(v.zero)};
      if (bucket_mb > 0) {
        sets.push_back("dist.bucket_first_mb=" + std::to_string(bucket_mb));
        sets.push_back("dist.bucket_mb=" + std::to_string(bucket_mb));
      }
      RunConfig cfg = load_run_config("", sets);
      {
        Trainer t(cfg, false);
        t.run();
      }
      if (rank != 0) continue;
      std::ifstream in(run / "metrics.jsonl");
      for (std::string line; std::getline(in, line);) {
        auto j = nlohmann::json::parse(line);
        if (!j.contains("step_time_s") || j["step"].get<int>() <= 2) continue;
        int k = 0;
        for (const char* key : {"step_time_s", "compute_s", "comm_total_s", "comm_exposed_s"})
          samples[vi][k++].push_back(j[key].get<double>() * 1e3);
        samples[vi][k++].push_back(j["comm_efficiency"].get<double>());
        samples[vi][k++].push_back(j["overlap_ratio"].get<double>());
        samples[vi][k].push_back(j["bytes_grad"].get<double>() / 1024);
      }
    }
  }
  for (int vi = 0; vi < kVariants && rank == 0; ++vi) {
    const auto& m = samples[vi];
    std::printf("%-16s %9.2f %10.2f %9.2f %11.2f %10.3f %8.3f %9.1f %8.3f\n", variants[vi].name,
                median(m[0]), median(m[1]), median(m[2]), median(m[3]), median(m[4]), median(m[5]),
                median(m[6]), median(m[0]) / median(samples[0][0]));
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) fs::remove_all(dir);
  MPI_Finalize();
  return 0;
}
