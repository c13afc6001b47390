#include "parallel/replica_sync.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"

namespace moetrain {

ReplicaSync::ReplicaSync(Comm& group, const MoeConfig& cfg) : group_(group), cfg_(cfg) {}

std::vector<ReplicaSync::Copy> ReplicaSync::copies(const Placement& p) const {
  MOETRAIN_CHECK(p.P == group_.size() && p.E == cfg_.E,
                 "replica sync: a placement of {} experts over {} ranks, the group has {} ranks "
                 "and the layer {} experts",
                 p.E, p.P, group_.size(), cfg_.E);
  const int64_t El = p.E / p.P;
  std::vector<Copy> out;
  for (int64_t s = 0; s < p.slots(); ++s) {
    const int32_t e = p.slot_expert[s];
    if (e >= 0 && p.rank_of(s) != e / El) out.push_back({e, e / El, p.rank_of(s)});
  }
  return out;
}

void ReplicaSync::move(const std::vector<Copy>& copies, bool to_owner, const MoeWeights& w,
                       std::vector<float>& received) {
  const int P = group_.size(), me = group_.rank();
  const int64_t block = cfg_.F * cfg_.C, bytes = 3 * block * static_cast<int64_t>(sizeof(float));
  std::vector<int64_t> send_counts(P, 0), recv_counts(P, 0), send_displs(P, 0), recv_displs(P, 0);
  for (const Copy& c : copies) {
    const int64_t from = to_owner ? c.holder : c.owner, to = to_owner ? c.owner : c.holder;
    if (from == me) send_counts[to] += bytes;
    if (to == me) recv_counts[from] += bytes;
  }
  for (int q = 1; q < P; ++q) {
    send_displs[q] = send_displs[q - 1] + send_counts[q - 1];
    recv_displs[q] = recv_displs[q - 1] + recv_counts[q - 1];
  }
  // Copies in slot order are grouped by holder; the owner side regroups by destination.
  send_.resize(static_cast<std::size_t>((send_displs[P - 1] + send_counts[P - 1]) / sizeof(float)));
  std::vector<int64_t> at(send_displs.begin(), send_displs.end());
  for (const Copy& c : copies) {
    const int64_t from = to_owner ? c.holder : c.owner, to = to_owner ? c.owner : c.holder;
    if (from != me) continue;
    float* dst = send_.data() + at[to] / static_cast<int64_t>(sizeof(float));
    std::memcpy(dst, w.w1 + c.expert * block, block * sizeof(float));
    std::memcpy(dst + block, w.w3 + c.expert * block, block * sizeof(float));
    std::memcpy(dst + 2 * block, w.w2 + c.expert * block, block * sizeof(float));
    at[to] += bytes;
  }
  received.resize(
      static_cast<std::size_t>((recv_displs[P - 1] + recv_counts[P - 1]) / sizeof(float)));
  group_.alltoallv(received.data(), recv_counts, recv_displs, send_.data(), send_counts,
                   send_displs);
}

void ReplicaSync::refresh(const Placement& p, const MoeWeights& w) {
  const std::vector<Copy> list = copies(p);
  if (list.empty()) return;
  std::vector<float> got;
  move(list, false, w, got);
  const int me = group_.rank();
  const int64_t block = cfg_.F * cfg_.C;
  // Received by source (owner) rank, each source's copies in slot order.
  int64_t at = 0;
  for (int q = 0; q < group_.size(); ++q)
    for (const Copy& c : list) {
      if (c.holder != me || c.owner != q) continue;
      std::memcpy(w.w1 + c.expert * block, got.data() + at, block * sizeof(float));
      std::memcpy(w.w3 + c.expert * block, got.data() + at + block, block * sizeof(float));
      std::memcpy(w.w2 + c.expert * block, got.data() + at + 2 * block, block * sizeof(float));
      at += 3 * block;
    }
}

void ReplicaSync::reduce_grads(const Placement& p, const MoeWeights& g) {
  const std::vector<Copy> list = copies(p);
  if (list.empty()) return;
  std::vector<float> got;
  move(list, true, g, got);
  const int me = group_.rank();
  const int64_t block = cfg_.F * cfg_.C;
  int64_t at = 0;
  for (int q = 0; q < group_.size(); ++q)
    for (const Copy& c : list) {
      if (c.owner != me || c.holder != q) continue;
      float* dst[3] = {g.w1 + c.expert * block, g.w3 + c.expert * block, g.w2 + c.expert * block};
      for (int m = 0; m < 3; ++m) {
        const float* src = got.data() + at + m * block;
        for (int64_t i = 0; i < block; ++i) dst[m][i] += src[i];
      }
      at += 3 * block;
    }
  for (const Copy& c : list) {
    if (c.holder != me) continue;
    std::fill_n(g.w1 + c.expert * block, block, 0.0f);
    std::fill_n(g.w3 + c.expert * block, block, 0.0f);
    std::fill_n(g.w2 + c.expert * block, block, 0.0f);
  }
}

}  // namespace moetrain
