#include "moe/dispatch.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>

#include "core/check.h"
#include "core/profile.h"

namespace moetrain {

namespace {
// Below this many floats of row traffic a parallel region costs more than it saves.
constexpr int64_t kParallelFloats = 1 << 15;
}  // namespace

int64_t apply_capacity(Routing& r, int64_t capacity) {
  PhaseScope phase_scope(Phase::Dispatch);
  const int64_t N = r.N, E = r.E, S = r.S;
  MOETRAIN_CHECK(capacity >= 0, "apply_capacity: capacity is {}, must be >= 0", capacity);
  r.expert = r.selected;
  // Group the assignments by expert (token order within an expert), then trim each group.
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t i = 0; i < N * S; ++i) {
    if (r.selected[i] >= 0) ++start[r.selected[i] + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> items(start[E]);
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < N * S; ++i) {
    if (r.selected[i] >= 0) items[fill[r.selected[i]]++] = i;
  }
  int64_t dropped = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : dropped) if (N * S > 4096)
  for (int64_t e = 0; e < E; ++e) {
    int64_t n = start[e + 1] - start[e];
    if (n <= capacity) continue;
    int64_t* first = items.data() + start[e];
    // Items are slot indices t·S + s, so index order is token order.
    std::sort(first, first + n, [&](int64_t a, int64_t b) {
      float wa = r.weight[a], wb = r.weight[b];
      return wa > wb || (wa == wb && a < b);
    });
    for (int64_t i = capacity; i < n; ++i) r.expert[first[i]] = -1;
    dropped += n - capacity;
  }
  return dropped;
}

int64_t reroute_overflow(Routing& r, int64_t capacity, const float* key, const float* score,
                         bool normalize) {
  PhaseScope phase_scope(Phase::Dispatch);
  const int64_t N = r.N, E = r.E, S = r.S;
  MOETRAIN_CHECK(capacity >= 0, "reroute_overflow: capacity is {}, must be >= 0", capacity);
  std::vector<int64_t> load(E, 0), displaced;
  for (int64_t i = 0; i < N * S; ++i) {
    if (r.expert[i] >= 0) {
      ++load[r.expert[i]];
    } else if (r.selected[i] >= 0) {
      displaced.push_back(i);
    }
  }
  if (displaced.empty()) return 0;
  std::sort(displaced.begin(), displaced.end(), [&](int64_t a, int64_t b) {
    float wa = r.weight[a], wb = r.weight[b];
    return wa > wb || (wa == wb && a < b);
  });
  std::vector<int32_t> order(E);
  std::vector<int64_t> touched;
  int64_t rerouted = 0;
  for (int64_t i : displaced) {
    const int64_t t = i / S;
    const float* kt = key + t * E;
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return kt[a] > kt[b]; });
    for (int32_t e : order) {
      if (kt[e] == -std::numeric_limits<float>::infinity()) break;  // the rest are masked too
      if (load[e] >= capacity) continue;
      bool held = false;
      for (int64_t j = 0; j < S; ++j) held |= weight_expert(r, t * S + j) == e;
      if (held) continue;
      r.expert[i] = e;
      ++load[e];
      ++rerouted;
      if (touched.empty() || touched.back() != t) touched.push_back(t);
      break;
    }
  }
  // The router's weight rule (kept_weights in router.cpp), in slot order as there.
  std::sort(touched.begin(), touched.end());
  touched.erase(std::unique(touched.begin(), touched.end()), touched.end());
  for (int64_t t : touched) {
    float sum = 0.0f;
    for (int64_t k = 0; k < S; ++k) sum += score[t * E + weight_expert(r, t * S + k)];
    const float inv = normalize ? 1.0f / sum : 1.0f;
    for (int64_t k = 0; k < S; ++k) {
      const int64_t i = t * S + k;
      r.weight[i] = score[t * E + weight_expert(r, i)] * inv;
    }
  }
  return rerouted;
}

void build_layout(DispatchLayout& layout, const Routing& r) {
  PhaseScope phase_scope(Phase::Dispatch);
  const int64_t N = r.N, E = r.E, S = r.S;
  layout.N = N, layout.E = E, layout.S = S;
  layout.counts.assign(E, 0);
  for (int64_t i = 0; i < N * S; ++i) {
    int32_t e = r.expert[i];
    if (e >= 0) ++layout.counts[e];
  }
  layout.offsets.assign(E + 1, 0);
  for (int64_t e = 0; e < E; ++e) layout.offsets[e + 1] = layout.offsets[e] + layout.counts[e];
  const int64_t R = layout.offsets[E];
  layout.R = R;
  layout.row_token.resize(R);
  layout.row_slot.resize(R);
  layout.row_weight.resize(R);
  layout.slot_row.resize(N * S);
  // Walking slots in token order keeps each expert's rows in ascending token index.
  std::vector<int64_t> fill(layout.offsets.begin(), layout.offsets.end() - 1);
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t s = 0; s < S; ++s) {
      int32_t e = r.expert[t * S + s];
      if (e < 0) {
        layout.slot_row[t * S + s] = -1;
        continue;
      }
      int64_t row = fill[e]++;
      layout.row_token[row] = static_cast<int32_t>(t);
      layout.row_slot[row] = static_cast<int32_t>(s);
      layout.row_weight[row] = r.weight[t * S + s];
      layout.slot_row[t * S + s] = static_cast<int32_t>(row);
    }
  }
}

void permute_forward(float* xp, const float* inp, const DispatchLayout& layout, int64_t C) {
  PhaseScope phase_scope(Phase::Dispatch);
  const int64_t R = layout.R;
  const int32_t* tok = layout.row_token.data();
#pragma omp parallel for schedule(static) if (R * C > kParallelFloats)
  for (int64_t r = 0; r < R; ++r) std::memcpy(xp + r * C, inp + tok[r] * C, sizeof(float) * C);
}

void permute_backward(float* dinp, const float* dxp, const DispatchLayout& layout, int64_t C,
                      bool accumulate) {
  PhaseScope phase_scope(Phase::Dispatch);
  const int64_t N = layout.N, S = layout.S;
  const int32_t* slot_row = layout.slot_row.data();
#pragma omp parallel for schedule(static) if (N * S * C > kParallelFloats)
  for (int64_t t = 0; t < N; ++t) {
    float* d = dinp + t * C;
    if (!accumulate) std::memset(d, 0, sizeof(float) * C);
    for (int64_t s = 0; s < S; ++s) {
      int64_t row = slot_row[t * S + s];
      if (row < 0) continue;
      const float* g = dxp + row * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) d[c] += g[c];
    }
  }
}

void combine_forward(float* out, const float* y, const DispatchLayout& layout, int64_t C,
                     bool accumulate) {
  PhaseScope phase_scope(Phase::Dispatch);
  const int64_t N = layout.N, S = layout.S;
  const int32_t* slot_row = layout.slot_row.data();
  const float* rw = layout.row_weight.data();
#pragma omp parallel for schedule(static) if (N * S * C > kParallelFloats)
  for (int64_t t = 0; t < N; ++t) {
    float* o = out + t * C;
    if (!accumulate) std::memset(o, 0, sizeof(float) * C);
    for (int64_t s = 0; s < S; ++s) {
      int64_t row = slot_row[t * S + s];
      if (row < 0) continue;
      const float* yr = y + row * C;
      const float w = rw[row];
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) o[c] += w * yr[c];
    }
  }
}

void combine_backward(float* dy, float* dweight, const float* dout, const float* y,
                      const DispatchLayout& layout, int64_t C) {
  PhaseScope phase_scope(Phase::Dispatch);
  const int64_t N = layout.N, S = layout.S;
  const int32_t* slot_row = layout.slot_row.data();
  const float* rw = layout.row_weight.data();
#pragma omp parallel for schedule(static) if (N * S * C > kParallelFloats)
  for (int64_t t = 0; t < N; ++t) {
    const float* g = dout + t * C;
    for (int64_t s = 0; s < S; ++s) {
      int64_t row = slot_row[t * S + s];
      if (row < 0) {
        dweight[t * S + s] = 0.0f;
        continue;
      }
      const float* yr = y + row * C;
      float* dyr = dy + row * C;
      const float w = rw[row];
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < C; ++c) {
        dot += g[c] * yr[c];
        dyr[c] = w * g[c];
      }
      dweight[t * S + s] = dot;
    }
  }
}

}  // namespace moetrain
