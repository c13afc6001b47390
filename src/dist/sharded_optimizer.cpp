#include "dist/sharded_optimizer.h"

#include <cstring>

#include "core/check.h"

namespace moetrain {

void gather_pieces(Comm& comm, std::span<const FlatPiece> pieces, float* full, int root) {
  const int P = comm.size();
  MOETRAIN_CHECK(root >= 0 && root < P, "gather_pieces: root {} outside [0, {})", root, P);
  // (offset, size) pairs, then the data, each rank to root only.
  std::vector<int64_t> meta;
  int64_t floats = 0;
  for (const FlatPiece& p : pieces) {
    meta.push_back(p.offset), meta.push_back(p.size);
    floats += p.size;
  }
  std::vector<int64_t> n_pieces = comm.allgather_one(static_cast<int64_t>(pieces.size()));
  std::vector<int64_t> sc(P, 0), sd(P, 0), rc(P, 0), rd(P, 0);
  sc[root] = static_cast<int64_t>(meta.size() * sizeof(int64_t));
  int64_t total_meta = 0;
  if (comm.rank() == root) {
    for (int q = 0; q < P; ++q) {
      rc[q] = n_pieces[q] * 2 * static_cast<int64_t>(sizeof(int64_t));
      rd[q] = total_meta;
      total_meta += rc[q];
    }
  }
  std::vector<int64_t> all_meta(static_cast<std::size_t>(total_meta / sizeof(int64_t)));
  comm.alltoallv(all_meta.data(), rc, rd, meta.data(), sc, sd);

  std::vector<float> packed(static_cast<std::size_t>(floats));
  int64_t at = 0;
  for (const FlatPiece& p : pieces) {
    if (p.size > 0)
      std::memcpy(packed.data() + at, p.data, static_cast<std::size_t>(p.size) * sizeof(float));
    at += p.size;
  }
  sc[root] = floats * static_cast<int64_t>(sizeof(float));
  int64_t total = 0;
  if (comm.rank() == root) {
    std::size_t m = 0;
    for (int q = 0; q < P; ++q) {
      int64_t n = 0;
      for (int64_t i = 0; i < n_pieces[q]; ++i, m += 2) n += all_meta[m + 1];
      rc[q] = n * static_cast<int64_t>(sizeof(float));
      rd[q] = total;
      total += rc[q];
    }
  }
  std::vector<float> all(static_cast<std::size_t>(total / sizeof(float)));
  comm.alltoallv(all.data(), rc, rd, packed.data(), sc, sd);
  if (comm.rank() != root) return;
  MOETRAIN_CHECK(full != nullptr || total == 0, "gather_pieces: null destination on root");
  at = 0;
  for (std::size_t m = 0; m < all_meta.size(); m += 2) {
    std::memcpy(full + all_meta[m], all.data() + at,
                static_cast<std::size_t>(all_meta[m + 1]) * sizeof(float));
    at += all_meta[m + 1];
  }
}

ShardedOptimizer::ShardedOptimizer(const OptimizerConfig& config,
                                   std::span<const ParamRange> groups,
                                   std::vector<OptimPiece> pieces)
    : pieces_(std::move(pieces)) {
  // An empty range gives the state names even to a rank without pieces.
  for (const StateBuffer& sb : make_optimizer(config, groups, 0, 0)->state())
    names_.push_back(sb.name);
  for (const OptimPiece& p : pieces_) {
    MOETRAIN_CHECK(p.offset >= 0 && p.size >= 0, "optimizer piece [{}, +{}) is invalid", p.offset,
                   p.size);
    opts_.push_back(make_optimizer(config, groups, p.offset, p.offset + p.size));
  }
}

void ShardedOptimizer::step(float* params, const float* grads, float lr) {
  for (auto& o : opts_) o->step(params + o->begin(), grads + o->begin(), lr);
  ++step_count_;
}

void ShardedOptimizer::set_step_count(int64_t steps) {
  MOETRAIN_CHECK(steps >= 0, "optimizer step count {} must be >= 0", steps);
  for (auto& o : opts_) o->set_step_count(steps);
  step_count_ = steps;
}

std::span<float> ShardedOptimizer::whole_state(int s) {
  MOETRAIN_CHECK(opts_.size() == 1 && pieces_[0].offset == 0,
                 "whole_state: the optimizer holds {} pieces, not one from offset 0", opts_.size());
  return opts_[0]->state().at(static_cast<std::size_t>(s)).values;
}

void ShardedOptimizer::gather_state(Comm& comm, int s, float* full, int root) {
  std::vector<FlatPiece> mine;
  for (std::size_t i = 0; i < opts_.size(); ++i) {
    if (!pieces_[i].writer) continue;
    std::span<float> v = opts_[i]->state().at(static_cast<std::size_t>(s)).values;
    mine.push_back({pieces_[i].offset, pieces_[i].size, v.data()});
  }
  gather_pieces(comm, mine, full, root);
}

void ShardedOptimizer::load_state(int s, const float* full) {
  for (std::size_t i = 0; i < opts_.size(); ++i) {
    std::span<float> v = opts_[i]->state().at(static_cast<std::size_t>(s)).values;
    if (!v.empty()) std::memcpy(v.data(), full + pieces_[i].offset, v.size() * sizeof(float));
  }
}

}  // namespace moetrain
