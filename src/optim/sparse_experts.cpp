#include "optim/sparse_experts.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <utility>

#include "core/check.h"

namespace moetrain {

namespace {

double share(int64_t part, int64_t whole) {
  return whole > 0 ? static_cast<double>(part) / static_cast<double>(whole) : 0.0;
}

}  // namespace

std::vector<ExpertPiece> expert_pieces(const ParamTable& layout) {
  // The block of an expert tensor is its name up to ".experts.".
  std::map<std::string, int64_t> block_of;
  std::vector<std::pair<int64_t, const ParamInfo*>> found;
  int64_t E = 0;
  for (const ParamInfo& p : layout.params()) {
    if (p.expert < 0) continue;
    const std::size_t at = p.name.find(".experts.");
    MOETRAIN_CHECK(at != std::string::npos,
                   "expert tensor '{}' is not named <block>.experts.<j>.<name>", p.name);
    const auto [it, fresh] =
        block_of.try_emplace(p.name.substr(0, at), static_cast<int64_t>(block_of.size()));
    found.emplace_back(it->second, &p);
    E = std::max(E, p.expert + 1);
  }
  std::vector<ExpertPiece> out;
  for (const auto& [m, p] : found) out.push_back({p->offset, p->numel, m * E + p->expert});
  return out;
}

int64_t min_touched_micro_batches(int64_t A, double p) {
  // The small slack keeps ceil(0.3 · 10) at 3 despite rounding.
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(p * static_cast<double>(A) - 1e-9)));
}

std::vector<uint8_t> active_experts(std::span<const int64_t> counts, int64_t A, int64_t keys,
                                    double p) {
  MOETRAIN_CHECK(static_cast<int64_t>(counts.size()) == A * keys,
                 "active_experts: {} counts for {} micro-batches of {} experts", counts.size(), A,
                 keys);
  const int64_t need = min_touched_micro_batches(A, p);
  std::vector<uint8_t> out(static_cast<std::size_t>(keys), 0);
  for (int64_t k = 0; k < keys; ++k) {
    int64_t touched = 0;
    for (int64_t a = 0; a < A; ++a) touched += counts[a * keys + k] > 0;
    out[k] = touched >= need;
  }
  return out;
}

std::vector<FrozenRange> frozen_ranges(std::span<const ExpertPiece> pieces,
                                       std::span<const uint8_t> active) {
  std::vector<FrozenRange> out;
  for (const ExpertPiece& p : pieces) {
    MOETRAIN_CHECK(p.key >= 0 && p.key < static_cast<int64_t>(active.size()),
                   "expert key {} outside the mask of {}", p.key, active.size());
    if (active[p.key]) continue;
    if (!out.empty() && out.back().offset + out.back().size == p.offset) {
      out.back().size += p.size;
    } else {
      out.push_back({p.offset, p.size});
    }
  }
  return out;
}

SparseExperts::SparseExperts(const ParamTable& layout, int64_t layers, int64_t E, int64_t A,
                             double p)
    : pieces_(expert_pieces(layout)), layers_(layers), E_(E), A_(A), p_(p) {
  std::sort(pieces_.begin(), pieces_.end(),
            [](const ExpertPiece& a, const ExpertPiece& b) { return a.offset < b.offset; });
  MOETRAIN_CHECK(A > 0 && layers >= 0 && E > 0, "sparse experts: A = {}, layers = {}, E = {}", A,
                 layers, E);
  for (const ExpertPiece& piece : pieces_)
    MOETRAIN_CHECK(piece.key < layers * E,
                   "sparse experts: the layout has more expert blocks than the {} MoE layers",
                   layers);
  counts_.assign(static_cast<std::size_t>(A * layers * E), 0);
  active_.assign(static_cast<std::size_t>(layers * E), 1);
  held_.assign(static_cast<std::size_t>(layers), 1);
}

void SparseExperts::hold_layers(std::vector<uint8_t> held) {
  MOETRAIN_CHECK(static_cast<int64_t>(held.size()) == layers_,
                 "sparse experts: {} held-layer flags for {} MoE layers", held.size(), layers_);
  held_ = std::move(held);
}

void SparseExperts::start_step() {
  std::fill(counts_.begin(), counts_.end(), 0);
}

void SparseExperts::record(int64_t micro, int64_t layer, const int64_t* tokens_per_expert) {
  MOETRAIN_CHECK(micro >= 0 && micro < A_ && layer >= 0 && layer < layers_,
                 "sparse experts: micro-batch {} of {}, layer {} of {}", micro, A_, layer, layers_);
  std::copy_n(tokens_per_expert, E_, counts_.begin() + (micro * layers_ + layer) * E_);
}

void SparseExperts::agree(Comm& comm) {
  comm.allreduce(counts_.data(), static_cast<int64_t>(counts_.size()));
  active_ = active_experts(counts_, A_, layers_ * E_, p_);
  const int64_t keys = layers_ * E_;
  for (int64_t k = 0; k < keys; ++k)
    if (!held_[static_cast<std::size_t>(k / E_)]) active_[static_cast<std::size_t>(k)] = 1;
  frozen_ = frozen_ranges(pieces_, active_);
  inactive_ = static_cast<int64_t>(std::count(active_.begin(), active_.end(), uint8_t{0}));
  touched_ = 0, masked_ = 0;
  for (int64_t a = 0; a < A_; ++a)
    for (int64_t k = 0; k < keys; ++k)
      if (counts_[a * keys + k] > 0) {
        ++touched_;
        if (!active_[k]) ++masked_;
      }
  masked_share_ = share(masked_, touched_);
}

void SparseExperts::sum_figures(Comm& comm) {
  int64_t figures[3] = {inactive_, touched_, masked_};
  comm.allreduce(figures, 3);
  inactive_ = figures[0], touched_ = figures[1], masked_ = figures[2];
  masked_share_ = share(masked_, touched_);
}

void SparseExperts::zero_frozen(float* grads) {
  for (const FrozenRange& r : frozen_) std::fill_n(grads + r.offset, r.size, 0.0f);
  // Inactive keys' rows now hold zeros, and no reduction, gather or scaling of this step writes
  // anything else into them: the next step need not zero them again.
  known_zero_.assign(active_.size(), 0);
  for (std::size_t k = 0; k < active_.size(); ++k) known_zero_[k] = active_[k] ? 0 : 1;
}

void SparseExperts::zero_grads(float* grads, int64_t n) const {
  int64_t at = 0;
  for (const ExpertPiece& p : pieces_) {
    if (known_zero_.empty() || !known_zero_[static_cast<std::size_t>(p.key)]) continue;
    if (p.offset > at) std::fill(grads + at, grads + p.offset, 0.0f);
    at = std::max(at, p.offset + p.size);
  }
  if (n > at) std::fill(grads + at, grads + n, 0.0f);
}

}  // namespace moetrain
