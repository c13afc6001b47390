#include "parallel/sparse_grad.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>

#include "core/check.h"
#include "core/dtype.h"

namespace moetrain {

int64_t sparse_keep(int64_t n, double ratio) {
  if (n <= 0) return 0;
  const auto k = static_cast<int64_t>(std::ceil(ratio * static_cast<double>(n)));
  return std::clamp<int64_t>(k, 1, n);
}

int64_t sparse_list_bytes(int64_t k, GradWire wire) {
  MOETRAIN_CHECK(wire != GradWire::Int8, "sparse gradient lists carry f32 or bf16 values");
  return k * (4 + (wire == GradWire::BF16 ? 2 : 4));
}

void select_top_k(const float* g, float* residual, int64_t n, int64_t k, GradWire wire,
                  uint8_t* list, std::vector<uint64_t>& scratch) {
  MOETRAIN_CHECK(k >= 0 && k <= n && n <= (int64_t{1} << 31),
                 "top-{} of {} gradient values: k must be in [0, n], n below 2^31", k, n);
  MOETRAIN_CHECK(wire != GradWire::Int8, "sparse gradient lists carry f32 or bf16 values");
  // v = g + residual, in the residual's place. A zero residual adds nothing (and keeps a −0).
  for (int64_t i = 0; i < n; ++i) residual[i] = residual[i] != 0.0f ? g[i] + residual[i] : g[i];
  // Keys ordered by |v| (its bits without the sign: monotone in the magnitude, NaN above Inf),
  // then by the lower position: the k largest keys are the selection, one set on every machine.
  scratch.resize(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t mag = std::bit_cast<uint32_t>(residual[i]) & 0x7fffffffu;
    scratch[i] = (mag << 32) | (0xffffffffu - static_cast<uint32_t>(i));
  }
  if (k < n)
    std::nth_element(scratch.begin(), scratch.begin() + k, scratch.end(), std::greater<>());
  auto* index = reinterpret_cast<int32_t*>(list);
  for (int64_t j = 0; j < k; ++j)
    index[j] = static_cast<int32_t>(0xffffffffu - static_cast<uint32_t>(scratch[j] & 0xffffffffu));
  std::sort(index, index + k);
  uint8_t* values = list + 4 * k;
  for (int64_t j = 0; j < k; ++j) {
    const int32_t i = index[j];
    const float v = residual[i];
    float sent = v;
    if (wire == GradWire::BF16) {
      const bf16 b(v);
      std::memcpy(values + 2 * j, &b.bits, 2);
      sent = b.to_float();
    } else {
      std::memcpy(values + 4 * j, &v, 4);
    }
    // v − round(v) is exact in f32; a non-finite value is sent and not carried.
    residual[i] = std::isfinite(v) ? v - sent : 0.0f;
  }
  // A non-finite value not sent is dropped rather than carried into every later step (a NaN
  // sorts above all finite values, so one of them is on the wire whenever any exists).
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(residual[i])) residual[i] = 0.0f;
}

void accumulate_lists(float* out, int32_t* counts, int64_t n, const uint8_t* lists, int P,
                      int64_t k, GradWire wire) {
  std::fill_n(out, n, 0.0f);
  std::fill_n(counts, n, 0);
  const int64_t bytes = sparse_list_bytes(k, wire);
  for (int q = 0; q < P; ++q) {
    const uint8_t* list = lists + q * bytes;
    const uint8_t* values = list + 4 * k;
    for (int64_t j = 0; j < k; ++j) {
      int32_t i;
      std::memcpy(&i, list + 4 * j, 4);
      MOETRAIN_CHECK(i >= 0 && i < n, "sparse gradient list of rank {}: position {} outside {}",
                     q, i, n);
      float v;
      if (wire == GradWire::BF16) {
        uint16_t b;
        std::memcpy(&b, values + 2 * j, 2);
        v = bf16::from_bits(b).to_float();
      } else {
        std::memcpy(&v, values + 4 * j, 4);
      }
      out[i] = counts[i] == 0 ? v : out[i] + v;
      ++counts[i];
    }
  }
}

}  // namespace moetrain

namespace moetrain {

int SparseBuckets::add_bucket(int64_t n) {
  Slot s;
  s.n = n;
  s.at = static_cast<int64_t>(residual_.size());
  residual_.resize(residual_.size() + static_cast<std::size_t>(n), 0.0f);
  slots_.push_back(std::move(s));
  return static_cast<int>(slots_.size()) - 1;
}

int64_t SparseBuckets::reduce(int slot, Comm& comm, const float* packed, float* sum) {
  Slot& s = slots_[slot];
  const int P = comm.size();
  const int64_t k = keep(slot), bytes = sparse_list_bytes(k, wire_);
  send_.resize(static_cast<std::size_t>(bytes));
  select_top_k(packed, residual_.data() + s.at, s.n, k, wire_, send_.data(), scratch_);
  s.recv.resize(static_cast<std::size_t>(P * bytes));
  std::vector<int64_t> counts(P, bytes), displs(P);
  for (int q = 0; q < P; ++q) displs[q] = q * bytes;
  comm.allgatherv(s.recv.data(), counts, displs, send_.data());
  resum(slot, sum);
  values_ += s.n;
  for (int64_t i = 0; i < s.n; ++i) {
    entries_ += counts_[i] > 0;
    contributions_ += counts_[i];
  }
  bytes_ += bytes * (P - 1);
  return bytes * (P - 1);
}

void SparseBuckets::resum(int slot, float* sum) {
  const Slot& s = slots_[slot];
  const int64_t bytes = sparse_list_bytes(keep(slot), wire_);
  const int P = static_cast<int>(static_cast<int64_t>(s.recv.size()) / std::max<int64_t>(bytes, 1));
  counts_.resize(static_cast<std::size_t>(s.n));
  accumulate_lists(sum, counts_.data(), s.n, s.recv.data(), P, keep(slot), wire_);
}

}  // namespace moetrain
