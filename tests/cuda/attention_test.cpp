// Tests of the device attention kernels (src/cuda/attention.cu): forward and backward against the
// CPU kernels of kernels/attention.h on the same random inputs, within per-element error bounds
// derived below, on the f32 path and on the tensor-core path (TF32 and bf16 GEMM modes); outputs
// fully overwritten; bitwise repeatable; argument checks.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "core/check.h"
#include "cuda/device.h"
#include "cuda/kernels.h"
#include "kernels/attention.h"
#include "support/device_buffers.h"

namespace {

using namespace moetrain::testing;

using moetrain::DeviceGemm;
using moetrain::cuda::DeviceBuffer;

struct Shape {
  int64_t B, T, NH, NKV, HS;
};

std::ostream& operator<<(std::ostream& os, const Shape& s) {
  return os << "B" << s.B << "_T" << s.T << "_NH" << s.NH << "_NKV" << s.NKV << "_HS" << s.HS;
}

// --- Error model -------------------------------------------------------------------------------
// Standard model fl(x op y) = (x op y)(1 + δ), |δ| ≤ u = 2^-24. An n-term dot product summed in
// any order, with or without FMA, is within γ_n·Σ|a_i b_i| of the exact value, γ_n = nu/(1 − nu).
// expf and logf are within 8u relative (CUDA's are ≤ 2 ulp = 4u, glibc's ≤ 1 ulp); an exp that
// underflows loses at most the smallest normal float. Each bound below is for ONE float
// implementation against exact arithmetic on the same float inputs, and is written so that it
// covers both the device's order of operations (online softmax, per-lane sums) and the CPU's
// (blocked GEMMs, double row sums). So each result must lie within its bound of the exact value,
// and the device and CPU results within twice the bound of each other.
// The tensor-core path also rounds every product operand (q, k, v, dout and the probabilities P
// and dS) to u_op relative (TF32 2^-11, bf16 2^-8: 11 and 8 significant bits): a product of two
// rounded operands carries g_op = 2·u_op + u_op² more relative error, which the bounds add to each
// product's term.
constexpr double kU = 0x1p-24;
constexpr double kLibm = 8 * kU;
constexpr double kMinNormal = 0x1p-126;
constexpr int64_t kChunk = 32;  // keys per online-softmax step of the device forward

double gamma_n(int64_t n) {
  const double nu = static_cast<double>(n) * kU;
  return nu / (1.0 - nu);
}

struct Problem {
  Shape s;
  std::vector<float> q, k, v, dout;
  int64_t nq() const { return s.B * s.T * s.NH * s.HS; }
  int64_t nkv() const { return s.B * s.T * s.NKV * s.HS; }
  int64_t nlse() const { return s.B * s.NH * s.T; }
  int64_t qi(int64_t b, int64_t t, int64_t h) const { return ((b * s.T + t) * s.NH + h) * s.HS; }
  int64_t ki(int64_t b, int64_t t, int64_t g) const { return ((b * s.T + t) * s.NKV + g) * s.HS; }
  int64_t li(int64_t b, int64_t h, int64_t t) const { return (b * s.NH + h) * s.T + t; }

  Problem(Shape shape, uint32_t seed, float qk_std = 1.0f) : s(shape) {
    std::mt19937 gen(seed);
    auto random = [&](int64_t n, float stddev) {
      std::normal_distribution<float> dist(0.0f, stddev);
      std::vector<float> x(static_cast<std::size_t>(n));
      for (float& e : x) e = dist(gen);
      return x;
    };
    q = random(nq(), qk_std);
    k = random(nkv(), qk_std);
    v = random(nkv(), 1.0f);
    dout = random(nq(), 1.0f);
  }
};

struct Outputs {
  std::vector<float> out, lse, dq, dk, dv;
};

// Exact values (double) and one implementation's error bound for each output. The backward terms
// use the given out and lse (the CPU forward's) as exact inputs, as both backward runs get them.
struct Reference {
  std::vector<double> out, lse, dq, dk, dv;
  std::vector<double> e_out, e_lse, e_dq, e_dk, e_dv;
};

Reference reference(const Problem& p, const std::vector<float>& out_in,
                    const std::vector<float>& lse_in, double u_op = 0) {
  const double g_op = 2 * u_op + u_op * u_op;
  const auto [B, T, NH, NKV, HS] = p.s;
  const int64_t G = NH / NKV;
  // The kernels' scale is this float; taken as an exact constant.
  const double sc = 1.0f / std::sqrt(static_cast<float>(HS));
  Reference r;
  for (auto* x : {&r.out, &r.dq, &r.e_out, &r.e_dq}) x->assign(p.nq(), 0.0);
  for (auto* x : {&r.dk, &r.dv, &r.e_dk, &r.e_dv}) x->assign(p.nkv(), 0.0);
  for (auto* x : {&r.lse, &r.e_lse}) x->assign(p.nlse(), 0.0);
  // Backward accumulators of the dk/dv bounds: Σ e_ds·|q|, Σ M·|q| (M bounds a computed |ds|),
  // Σ (ε_p·p + min normal)·|dout|, Σ p_hi·|dout|.
  std::vector<double> edk(p.nkv(), 0.0), mdk(p.nkv(), 0.0), edv(p.nkv(), 0.0), mdv(p.nkv(), 0.0);
  std::vector<double> score(T), abs_score(T), dp(T), abs_dp(T);

  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < NH; ++h) {
      const int64_t g = h / G;
      for (int64_t t = 0; t < T; ++t) {
        const float* qt = &p.q[p.qi(b, t, h)];
        const float* dot_ = &p.dout[p.qi(b, t, h)];
        // Scores s ≤ t: computed within e_s = γ_{HS+2}·A_s (the dot, then ·scale and −m or −lse
        // whose roundings are counted apart), A_s = scale·Σ|q k| ≥ |score_s|.
        double mx = -INFINITY, mn = INFINITY, delta = 0;
        for (int64_t s = 0; s <= t; ++s) {
          const float* ks = &p.k[p.ki(b, s, g)];
          const float* vs = &p.v[p.ki(b, s, g)];
          double a = 0, aa = 0, d = 0, dd = 0;
          for (int64_t x = 0; x < HS; ++x) {
            a += double(qt[x]) * ks[x];
            aa += std::abs(double(qt[x]) * ks[x]);
            d += double(dot_[x]) * vs[x];
            dd += std::abs(double(dot_[x]) * vs[x]);
          }
          score[s] = sc * a;
          abs_score[s] = sc * aa;
          dp[s] = d;
          abs_dp[s] = dd;
          mx = std::max(mx, score[s]);
          mn = std::min(mn, score[s]);
          delta = std::max(delta, (gamma_n(HS + 2) + g_op) * abs_score[s]);
        }

        // Forward. Each unnormalised weight exp(ŝ − m̂) carries a relative error ε_w from: its
        // score (e^Δ − 1), the subtraction (u·|ŝ − m̂| ≤ u(R + 2Δ), R the score range), expf,
        // and on the device one rescale per chunk (expf of a difference of maxima, and the
        // product). Weights perturbed by ≤ ε_w move out by ≤ 2ε_w/(1 − ε_w)·Σp|v| and lse by
        // ≤ ε_w; then the float sums (γ_{t+2} for Σ w·v, γ_{t+1} for l), 1/l and the product.
        const double range = mx - mn, chunks = double((t + kChunk) / kChunk);
        const double sub = kU * (range + 2 * delta);
        const double eps_round = sub + kLibm + chunks * (kLibm + sub + kU);
        const double eps_w = std::expm1(delta) + eps_round + (t + 1) * kMinNormal;
        double l = 0;
        for (int64_t s = 0; s <= t; ++s) l += std::exp(score[s] - mx);
        const int64_t li = p.li(b, h, t);
        r.lse[li] = mx + std::log(l);
        const double eps_l = eps_round + gamma_n(t + 1) + (t + 1) * kMinNormal;
        r.e_lse[li] =
            (delta + eps_l / (1 - eps_l) + kLibm * std::max(1.0, std::log(double(t + 1)))) *
                (1 + 2 * kU) +
            2 * kU * std::abs(r.lse[li]);
        const double rel_out = 2 * eps_w / (1 - eps_w) +
                               (gamma_n(t + 2) + gamma_n(t + 1) + 2 * kU + g_op) * (1 + 3 * eps_w);
        for (int64_t x = 0; x < HS; ++x) {
          double o = 0, po = 0, vmax = 0;
          for (int64_t s = 0; s <= t; ++s) {
            const double pv = std::exp(score[s] - r.lse[li]);
            const double vx = p.v[p.ki(b, s, g) + x];
            o += pv * vx;
            po += pv * std::abs(vx);
            vmax = std::max(vmax, std::abs(vx));
          }
          r.out[p.qi(b, t, h) + x] = o;
          r.e_out[p.qi(b, t, h) + x] =
              rel_out * po * (1 + 4 * kU) + 2 * (t + 1) * kMinNormal * vmax;
        }

        // Backward from the given out, lse. D = Σ dout·out within e_D; p = exp(ŝ − L) within
        // ε_p relative (score error e_s, the subtraction, expf) and the min normal;
        // ds = p·(dp − D) within e_ds, and a computed |ds| ≤ M.
        const double L = lse_in[li];
        const float* ot = &out_in[p.qi(b, t, h)];
        double D = 0, Dabs = 0;
        for (int64_t x = 0; x < HS; ++x) {
          D += double(dot_[x]) * ot[x];
          Dabs += std::abs(double(dot_[x]) * ot[x]);
        }
        const double e_D = gamma_n(HS) * Dabs;
        std::vector<double> e_acc(HS, 0.0), m_acc(HS, 0.0), dq(HS, 0.0);
        for (int64_t s = 0; s <= t; ++s) {
          const double es = (gamma_n(HS + 2) + g_op) * abs_score[s];
          const double arg = score[s] - L, pr = std::exp(arg);
          const double eps_p = std::expm1(es + kU * (std::abs(arg) + es)) * (1 + kLibm) + kLibm;
          const double p_err = eps_p * pr + kMinNormal, p_hi = pr + p_err;
          const double x = dp[s] - D;
          const double e_x = ((gamma_n(HS) + g_op) * abs_dp[s] + e_D) * (1 + kU) + kU * std::abs(x);
          const double ds = pr * x;
          const double m_ds = p_hi * (std::abs(x) + e_x) * (1 + kU) * (1 + g_op);
          // ds's own rounding and that of the operand it is multiplied with (k or q): g_op·M.
          const double e_ds =
              p_err * std::abs(x) + p_hi * e_x + kU * p_hi * (std::abs(x) + e_x) + g_op * m_ds;
          const int64_t ko = p.ki(b, s, g);
          for (int64_t y = 0; y < HS; ++y) {
            const double ky = p.k[ko + y], qy = qt[y], doy = dot_[y];
            dq[y] += sc * ds * ky;
            e_acc[y] += e_ds * std::abs(ky);
            m_acc[y] += m_ds * std::abs(ky);
            r.dk[ko + y] += sc * ds * qy;
            edk[ko + y] += e_ds * std::abs(qy);
            mdk[ko + y] += m_ds * std::abs(qy);
            r.dv[ko + y] += pr * doy;
            edv[ko + y] += (p_err + g_op * p_hi) * std::abs(doy);
            mdv[ko + y] += p_hi * (1 + g_op) * std::abs(doy);
          }
        }
        // dq = scale·Σ_{s ≤ t} ds·k: t + 1 products and sums, then the scale.
        const double gq = gamma_n(t + 2);
        for (int64_t y = 0; y < HS; ++y) {
          r.dq[p.qi(b, t, h) + y] = dq[y];
          r.e_dq[p.qi(b, t, h) + y] = sc * (e_acc[y] * (1 + gq) + gq * m_acc[y]);
        }
      }
    }
    // dk, dv of key s: G·(T − s) terms (the group's heads, queries t ≥ s), then dk's scale.
    for (int64_t s = 0; s < T; ++s) {
      const int64_t n = G * (T - s);
      for (int64_t g = 0; g < NKV; ++g) {
        for (int64_t y = 0; y < HS; ++y) {
          const int64_t at = p.ki(b, s, g) + y;
          r.e_dk[at] = sc * (edk[at] * (1 + gamma_n(n + 1)) + gamma_n(n + 1) * mdk[at]);
          r.e_dv[at] = edv[at] * (1 + gamma_n(n)) + gamma_n(n) * mdv[at];
        }
      }
    }
  }
  return r;
}

// Every |got_i − want_i| ≤ factor·bound_i; reports the worst element relative to its bound.
void expect_within(const std::vector<float>& got, const std::vector<double>& want,
                   const std::vector<double>& bound, double factor, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double worst = 0;
  int64_t at = -1;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(double(got[i]) - want[i]);
    const double ratio = err == 0 ? 0 : err / (factor * bound[i]);
    if (!(ratio <= worst)) worst = ratio, at = static_cast<int64_t>(i);  // NaN lands here too
  }
  if (at < 0) return;
  EXPECT_LE(worst, 1.0) << what << ": worst element " << at << " got " << got[at] << " want "
                        << want[at] << " error " << std::abs(double(got[at]) - want[at])
                        << " tolerance " << factor * bound[at];
}

// |a_i − b_i| ≤ 2·bound_i: two implementations each within bound_i of the exact value.
void expect_agree(const std::vector<float>& a, const std::vector<float>& b,
                  const std::vector<double>& bound, const std::string& what) {
  expect_within(a, std::vector<double>(b.begin(), b.end()), bound, 2.0, what);
}

Outputs run_cpu(const Problem& p) {
  const auto [B, T, NH, NKV, HS] = p.s;
  Outputs r{std::vector<float>(p.nq()), std::vector<float>(p.nlse()), std::vector<float>(p.nq()),
            std::vector<float>(p.nkv()), std::vector<float>(p.nkv())};
  moetrain::attention_forward(r.out.data(), r.lse.data(), p.q.data(), p.k.data(), p.v.data(), B, T,
                              NH, NKV, HS);
  moetrain::attention_backward(r.dq.data(), r.dk.data(), r.dv.data(), p.dout.data(), p.q.data(),
                               p.k.data(), p.v.data(), r.out.data(), r.lse.data(), B, T, NH, NKV,
                               HS);
  return r;
}

// The device forward on p's inputs, and the device backward on p's inputs with the given out and
// lse (the CPU forward's, so that the backward comparison carries no forward differences).
// Outputs start as NaN: every element must be overwritten.
Outputs run_device(const Problem& p, const std::vector<float>& out_in,
                   const std::vector<float>& lse_in, DeviceGemm mode = DeviceGemm::F32) {
  const auto [B, T, NH, NKV, HS] = p.s;
  moetrain::cuda::Context ctx;
  ctx.set_gemm_mode(mode);
  const cudaStream_t s = ctx.stream();
  DeviceBuffer<float> q = to_device(p.q), k = to_device(p.k), v = to_device(p.v),
                      dout = to_device(p.dout), out_d = to_device(out_in),
                      lse_d = to_device(lse_in);
  DeviceBuffer<float> out(p.nq()), lse(p.nlse()), dq(p.nq()), dk(p.nkv()), dv(p.nkv());
  // upload() copies on the legacy stream, which the context's non-blocking stream does not wait
  // for.
  MOETRAIN_CUDA_CHECK(cudaDeviceSynchronize());
  for (DeviceBuffer<float>* x : {&out, &lse, &dq, &dk, &dv}) {
    MOETRAIN_CUDA_CHECK(cudaMemsetAsync(x->data(), 0xff, sizeof(float) * x->size(), s));
  }
  moetrain::cuda::attention_forward(ctx, out.data(), lse.data(), q.data(), k.data(), v.data(), B, T,
                                    NH, NKV, HS);
  moetrain::cuda::attention_backward(ctx, dq.data(), dk.data(), dv.data(), dout.data(), q.data(),
                                     k.data(), v.data(), out_d.data(), lse_d.data(), B, T, NH, NKV,
                                     HS);
  ctx.sync();
  return {to_host(out), to_host(lse), to_host(dq), to_host(dk), to_host(dv)};
}

// The unit roundoff of the tensor-core path's operands in each GEMM mode (0: the f32 path).
double operand_roundoff(DeviceGemm mode) {
  switch (mode) {
    case DeviceGemm::TF32:
      return 0x1p-11;
    case DeviceGemm::BF16:
      return 0x1p-8;
    case DeviceGemm::F32:
      break;
  }
  return 0;
}

// Returns the device's outputs and the f32 reference, for callers that check more.
std::pair<Outputs, Reference> check_against_cpu(const Problem& p,
                                                DeviceGemm mode = DeviceGemm::F32) {
  const Outputs cpu = run_cpu(p);
  const Outputs dev = run_device(p, cpu.out, cpu.lse, mode);
  const Reference ref = reference(p, cpu.out, cpu.lse);
  const Reference rd =
      mode == DeviceGemm::F32 ? ref : reference(p, cpu.out, cpu.lse, operand_roundoff(mode));
  // The contract: the device agrees with the CPU kernel within the two implementations' bounds
  // (the device's is the larger with rounded operands).
  expect_agree(dev.out, cpu.out, rd.e_out, "out vs CPU");
  expect_agree(dev.lse, cpu.lse, rd.e_lse, "lse vs CPU");
  expect_agree(dev.dq, cpu.dq, rd.e_dq, "dq vs CPU");
  expect_agree(dev.dk, cpu.dk, rd.e_dk, "dk vs CPU");
  expect_agree(dev.dv, cpu.dv, rd.e_dv, "dv vs CPU");
  // Each within its own bound of the exact values; the CPU's check guards the bound itself.
  expect_within(dev.out, ref.out, rd.e_out, 1.0, "device out");
  expect_within(dev.lse, ref.lse, rd.e_lse, 1.0, "device lse");
  expect_within(dev.dq, ref.dq, rd.e_dq, 1.0, "device dq");
  expect_within(dev.dk, ref.dk, rd.e_dk, 1.0, "device dk");
  expect_within(dev.dv, ref.dv, rd.e_dv, 1.0, "device dv");
  expect_within(cpu.out, ref.out, ref.e_out, 1.0, "CPU out");
  expect_within(cpu.lse, ref.lse, ref.e_lse, 1.0, "CPU lse");
  expect_within(cpu.dq, ref.dq, ref.e_dq, 1.0, "CPU dq");
  expect_within(cpu.dk, ref.dk, ref.e_dk, 1.0, "CPU dk");
  expect_within(cpu.dv, ref.dv, ref.e_dv, 1.0, "CPU dv");
  return {dev, ref};
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

}  // namespace

class CudaAttentionTest : public ::testing::TestWithParam<Shape> {};

TEST_P(CudaAttentionTest, MatchesCpuKernel) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  check_against_cpu(Problem(GetParam(), 1234));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAttentionTest,
    ::testing::Values(Shape{2, 17, 4, 2, 16},    // GQA, T below one chunk of 32 keys
                      Shape{1, 1, 4, 2, 16},     // a single position
                      Shape{1, 1, 1, 1, 1},      // everything 1
                      Shape{1, 130, 2, 1, 64},   // multi-query, T over four chunks
                      Shape{2, 45, 6, 2, 33},    // odd HS, not a multiple of 32
                      Shape{3, 33, 3, 3, 1},     // MHA, HS = 1, T one past a chunk
                      Shape{1, 70, 2, 2, 256},   // the largest HS
                      Shape{1, 300, 4, 2, 96}),  // long rows, many chunks
    [](const auto& info) {
      std::ostringstream os;
      os << info.param;
      return os.str();
    });

// The tensor-core path (TF32 and bf16 GEMM modes) on the same shapes, within its bounds.
class CudaAttentionTensorCoreTest : public ::testing::TestWithParam<std::tuple<DeviceGemm, Shape>> {
};

TEST_P(CudaAttentionTensorCoreTest, MatchesCpuKernelWithinTheRoundedOperandsBound) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  check_against_cpu(Problem(std::get<1>(GetParam()), 1234), std::get<0>(GetParam()));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaAttentionTensorCoreTest,
    ::testing::Combine(::testing::Values(DeviceGemm::TF32, DeviceGemm::BF16),
                       ::testing::Values(Shape{2, 17, 4, 2, 16}, Shape{1, 1, 1, 1, 1},
                                         Shape{1, 130, 2, 1, 64}, Shape{2, 45, 6, 2, 33},
                                         Shape{3, 33, 3, 3, 1}, Shape{1, 70, 2, 2, 256},
                                         Shape{1, 300, 4, 2, 96})),
    [](const auto& info) {
      std::ostringstream os;
      os << (std::get<0>(info.param) == DeviceGemm::TF32 ? "tf32_" : "bf16_")
         << std::get<1>(info.param);
      return os.str();
    });

TEST(CudaAttention, TensorCorePathRoundsItsOperands) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  // With bf16 operands the outputs leave the f32 bound somewhere: the rounding is real (and the
  // tensor-core path, not the f32 one, ran).
  const Problem p({1, 130, 2, 1, 64}, 4321);
  const auto [dev, ref] = check_against_cpu(p, DeviceGemm::BF16);
  double worst = 0;
  for (std::size_t i = 0; i < dev.out.size(); ++i)
    worst = std::max(worst, std::abs(dev.out[i] - ref.out[i]) / ref.e_out[i]);
  EXPECT_GT(worst, 1.0) << "bf16 attention outputs all within the f32 bound";
}

TEST(CudaAttention, TensorCorePathWithLargeScoresAndManyChunks) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  check_against_cpu(Problem({2, 40, 4, 2, 16}, 77, 4.0f), DeviceGemm::BF16);
  check_against_cpu(Problem({2, 40, 4, 2, 16}, 77, 4.0f), DeviceGemm::TF32);
}

TEST(CudaAttention, LargeScoresStayWithinBounds) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  // Scores spread over ±50 and more: the running max must carry the online softmax, and weights
  // underflow.
  check_against_cpu(Problem({2, 40, 4, 2, 16}, 77, 4.0f));
}

TEST(CudaAttention, RepeatedCallsAreBitwiseIdentical) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  const Problem p({2, 75, 4, 1, 40}, 99);
  const Outputs cpu = run_cpu(p);
  for (DeviceGemm mode : {DeviceGemm::F32, DeviceGemm::TF32, DeviceGemm::BF16}) {
    SCOPED_TRACE(static_cast<int>(mode));
    const Outputs a = run_device(p, cpu.out, cpu.lse, mode),
                  b = run_device(p, cpu.out, cpu.lse, mode);
    EXPECT_TRUE(same_bits(a.out, b.out));
    EXPECT_TRUE(same_bits(a.lse, b.lse));
    EXPECT_TRUE(same_bits(a.dq, b.dq));
    EXPECT_TRUE(same_bits(a.dk, b.dk));
    EXPECT_TRUE(same_bits(a.dv, b.dv));
  }
}

TEST(CudaAttention, EmptyShapesLaunchNothing) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  moetrain::cuda::Context ctx;
  for (const Shape& s : {Shape{0, 4, 2, 1, 8}, Shape{2, 0, 2, 1, 8}}) {
    SCOPED_TRACE(::testing::PrintToString(s));
    EXPECT_NO_THROW(moetrain::cuda::attention_forward(ctx, nullptr, nullptr, nullptr, nullptr,
                                                      nullptr, s.B, s.T, s.NH, s.NKV, s.HS));
    EXPECT_NO_THROW(moetrain::cuda::attention_backward(ctx, nullptr, nullptr, nullptr, nullptr,
                                                       nullptr, nullptr, nullptr, nullptr, nullptr,
                                                       s.B, s.T, s.NH, s.NKV, s.HS));
  }
  ctx.sync();
}

TEST(CudaAttention, RejectsBadArguments) {
  std::string why;
  if (!moetrain::cuda::device_available(&why)) GTEST_SKIP() << why;
  moetrain::cuda::Context ctx;
  DeviceBuffer<float> buf(1 << 16);
  float* f = buf.data();
  const auto& c = ctx;
  using moetrain::Error;
  using moetrain::cuda::attention_backward;
  using moetrain::cuda::attention_forward;
  EXPECT_THROW(attention_forward(c, f, f, f, f, f, 1, 4, 6, 4, 8), Error);    // NH % NKV != 0
  EXPECT_THROW(attention_forward(c, f, f, f, f, f, 1, 4, 4, 0, 8), Error);    // NKV = 0
  EXPECT_THROW(attention_forward(c, f, f, f, f, f, 1, 4, 4, 2, 0), Error);    // HS = 0
  EXPECT_THROW(attention_forward(c, f, f, f, f, f, 1, 4, 4, 2, 257), Error);  // HS over 256
  EXPECT_THROW(attention_forward(c, f, f, f, f, f, 1, -1, 4, 2, 8), Error);
  EXPECT_THROW(attention_forward(c, nullptr, f, f, f, f, 1, 4, 4, 2, 8), Error);
  EXPECT_THROW(attention_backward(c, f, f, f, f, f, f, f, f, f, 1, 4, 6, 4, 8), Error);
  EXPECT_THROW(attention_backward(c, f, f, f, f, f, f, f, f, f, 1, 4, 4, 2, 300), Error);
  EXPECT_THROW(attention_backward(c, f, f, f, f, f, f, f, f, nullptr, 1, 4, 4, 2, 8), Error);
  ctx.sync();
}
