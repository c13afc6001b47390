// The model's one description over its operations (model/model_ops.h) held to a device's rules on
// this CPU: a stand-in device runs the CPU's kernels but keeps the parameters, gradients, tokens
// and every activation in memory of its own, and checks that each operation is handed pointers
// into that memory only (a host pointer reaching a GPU kernel is the bug this finds without a
// GPU). Its forward and backward must give the CPU model's bits.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "core/check.h"
#include "model/device_ops.h"
#include "model/params.h"
#include "model/transformer.h"
#include "support/small_models.h"

using namespace moetrain;

namespace {

// Every operation checks its buffers against the allocations it made, then runs CpuOps.
class CheckedOps final : public DeviceOps {
 public:
  CheckedOps(const ModelConfig& cfg, int64_t n_params, int* live)
      : cpu_(static_cast<float>(cfg.rope_theta)), n_params_(n_params), live_(live) {}
  ~CheckedOps() override {
    if (params_) deallocate(params_);
    if (grads_) deallocate(grads_);
  }
  int64_t calls() const { return calls_; }
  int64_t uploads() const { return uploads_; }

  void set_gemm(DeviceGemm) override {}
  void keep_attention_f32(bool) override {}
  void synchronize() override {}
  std::string describe() const override { return "checked stand-in"; }
  DeviceTrainingState& training_state() override {
    MOETRAIN_FAIL("the stand-in keeps no training state");
  }

  void* allocate(std::size_t bytes) override {
    void* p = cpu_.allocate(bytes);
    blocks_[static_cast<const char*>(p)] = bytes;
    ++*live_;
    return p;
  }
  void deallocate(void* p) override {
    ASSERT_EQ(blocks_.erase(static_cast<const char*>(p)), 1u) << "freeing memory not its own";
    --*live_;
    cpu_.deallocate(p);
  }
  const int32_t* ids(Ints& dev, const int32_t* host, int64_t n) override {
    dev.resize(*this, n);
    std::memcpy(dev.data(), host, sizeof(int32_t) * static_cast<std::size_t>(n));
    return dev.data();
  }
  const float* to_host(std::vector<float>& staging, const float* x, int64_t n) override {
    mine(x, n, "to_host");
    staging.assign(x, x + n);
    return staging.data();
  }
  void bind_params(const float* params) override {
    if (!params_) params_ = static_cast<float*>(allocate(sizeof(float) * n_params_));
    if (params == source_ && !stale_) return;
    std::memcpy(params_, params, sizeof(float) * static_cast<std::size_t>(n_params_));
    source_ = params, stale_ = false, ++uploads_;
    cpu_.bind_params(params_);
  }
  const float* params() const override { return params_; }
  void weights_changed() override { stale_ = true; }
  void begin_grads(const float* params, float* grads) override {
    ASSERT_TRUE(params == source_ && !stale_) << "backward with other parameters than forward's";
    ASSERT_NE(grads, nullptr);
    if (!grads_) grads_ = static_cast<float*>(allocate(sizeof(float) * n_params_));
    std::memset(grads_, 0, sizeof(float) * static_cast<std::size_t>(n_params_));
    cpu_.begin_grads(params_, grads_);
  }
  float* grads() override { return grads_; }
  void end_grads(float* grads) override {
    for (int64_t i = 0; i < n_params_; ++i) grads[i] += grads_[i];
  }

  const void* round(HalfBuffer&, const float*, int64_t) override { return nullptr; }
  void linear_forward(float* out, const float* inp, const void* inp_lp, int64_t w, int64_t N,
                      int64_t IC, int64_t OC, int64_t ld) override {
    mine(out, N * OC, "linear out"), mine(inp, N * IC, "linear inp");
    weight(w, OC * IC, "linear weight");
    EXPECT_EQ(ld, 0);
    cpu_.linear_forward(out, inp, inp_lp, w, N, IC, OC, ld);
  }
  void linear_backward_input(float* dinp, bool acc, const float* dout, const void* dout_lp,
                             int64_t w, int64_t N, int64_t IC, int64_t OC, int64_t ld) override {
    mine(dinp, N * IC, "linear dinp"), mine(dout, N * OC, "linear dout");
    weight(w, OC * IC, "linear weight");
    cpu_.linear_backward_input(dinp, acc, dout, dout_lp, w, N, IC, OC, ld);
  }
  void linear_backward_weight(float* dweight, const float* dout, const void* dout_lp,
                              const float* inp, const void* inp_lp, int64_t N, int64_t IC,
                              int64_t OC, int64_t ld) override {
    grad(dweight, OC * IC, "linear dweight"), mine(dout, N * OC, "linear dout");
    mine(inp, N * IC, "linear inp");
    cpu_.linear_backward_weight(dweight, dout, dout_lp, inp, inp_lp, N, IC, OC, ld);
  }
  void embedding_forward(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C,
                         int64_t V) override {
    mine(out, N * C, "embedding out"), mine(ids, N, "embedding ids");
    mine(table, V * C, "embedding table");
    cpu_.embedding_forward(out, ids, table, N, C, V);
  }
  void embedding_backward(float* dtable, const float* dout, const int32_t* ids, int64_t N,
                          int64_t C, int64_t V) override {
    grad(dtable, V * C, "embedding dtable"), mine(dout, N * C, "embedding dout");
    mine(ids, N, "embedding ids");
    cpu_.embedding_backward(dtable, dout, ids, N, C, V);
  }
  void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N,
                       int64_t C, float eps) override {
    mine(out, N * C, "norm out"), mine(rstd, N, "norm rstd"), mine(inp, N * C, "norm inp");
    mine(weight, C, "norm weight");
    cpu_.rmsnorm_forward(out, rstd, inp, weight, N, C, eps);
  }
  void add_rmsnorm_forward(float* out, float* rstd, float* xsum, const float* x,
                           const float* weight, int64_t N, int64_t C, float eps) override {
    mine(out, N * C, "norm out"), mine(rstd, N, "norm rstd"), mine(xsum, N * C, "norm sum");
    mine(x, N * C, "norm add"), mine(weight, C, "norm weight");
    cpu_.add_rmsnorm_forward(out, rstd, xsum, x, weight, N, C, eps);
  }
  void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp,
                        const float* weight, const float* rstd, int64_t N, int64_t C,
                        const float* dadd) override {
    mine(dinp, N * C, "norm dinp"), grad(dweight, C, "norm dweight");
    mine(dout, N * C, "norm dout"), mine(inp, N * C, "norm inp"), mine(weight, C, "norm weight");
    mine(rstd, N, "norm rstd");
    if (dadd) mine(dadd, N * C, "norm dadd");
    cpu_.rmsnorm_backward(dinp, dweight, dout, inp, weight, rstd, N, C, dadd);
  }
  void rope_forward(float* out, const float* inp, const int32_t* pos, int64_t N, int64_t NH,
                    int64_t HS, int64_t T) override {
    mine(out, N * NH * HS, "rope out"), mine(inp, N * NH * HS, "rope inp");
    mine(pos, N, "rope pos");
    cpu_.rope_forward(out, inp, pos, N, NH, HS, T);
  }
  void rope_backward(float* dinp, const float* dout, const int32_t* pos, int64_t N, int64_t NH,
                     int64_t HS, int64_t T) override {
    mine(dinp, N * NH * HS, "rope dinp"), mine(dout, N * NH * HS, "rope dout");
    mine(pos, N, "rope pos");
    cpu_.rope_backward(dinp, dout, pos, N, NH, HS, T);
  }
  void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v,
                         int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) override {
    mine(out, B * T * NH * HS, "attention out"), mine(lse, B * NH * T, "attention lse");
    mine(q, B * T * NH * HS, "attention q"), mine(k, B * T * NKV * HS, "attention k");
    mine(v, B * T * NKV * HS, "attention v");
    cpu_.attention_forward(out, lse, q, k, v, B, T, NH, NKV, HS);
  }
  void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                          const float* k, const float* v, const float* out, const float* lse,
                          int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS) override {
    const int64_t nq = B * T * NH * HS, nk = B * T * NKV * HS;
    mine(dq, nq, "attention dq"), mine(dk, nk, "attention dk"), mine(dv, nk, "attention dv");
    mine(dout, nq, "attention dout"), mine(q, nq, "attention q"), mine(k, nk, "attention k");
    mine(v, nk, "attention v"), mine(out, nq, "attention out");
    mine(lse, B * NH * T, "attention lse");
    cpu_.attention_backward(dq, dk, dv, dout, q, k, v, out, lse, B, T, NH, NKV, HS);
  }
  void swiglu_forward(float* out, const float* a, const float* b, int64_t n) override {
    mine(out, n, "swiglu out"), mine(a, n, "swiglu a"), mine(b, n, "swiglu b");
    cpu_.swiglu_forward(out, a, b, n);
  }
  void swiglu_backward(float* da, float* db, const float* dout, const float* a, const float* b,
                       int64_t n) override {
    mine(da, n, "swiglu da"), mine(db, n, "swiglu db"), mine(dout, n, "swiglu dout");
    mine(a, n, "swiglu a"), mine(b, n, "swiglu b");
    cpu_.swiglu_backward(da, db, dout, a, b, n);
  }
  void add(float* out, const float* a, const float* b, int64_t n) override {
    mine(out, n, "add out"), mine(a, n, "add a"), mine(b, n, "add b");
    cpu_.add(out, a, b, n);
  }
  void softmax_xent_forward(float* losses, float* lse, const float* logits, const int32_t* targets,
                            int64_t N, int64_t V) override {
    mine(losses, N, "xent losses"), mine(lse, N, "xent lse"), mine(logits, N * V, "xent logits");
    mine(targets, N, "xent targets");
    cpu_.softmax_xent_forward(losses, lse, logits, targets, N, V);
  }
  void softmax_xent_backward(float* dlogits, float dloss, const float* logits, const float* lse,
                             const int32_t* targets, int64_t N, int64_t V) override {
    mine(dlogits, N * V, "xent dlogits"), mine(logits, N * V, "xent logits");
    mine(lse, N, "xent lse"), mine(targets, N, "xent targets");
    cpu_.softmax_xent_backward(dlogits, dloss, logits, lse, targets, N, V);
  }
  void moe_forward(MoeLayer& moe, int64_t l, float* out, const float* inp, int64_t N,
                   const MoeBlockOffsets& o, const MoeStep& step, bool replay) override {
    mine(out, N * cfg_C(moe), "moe out"), mine(inp, N * cfg_C(moe), "moe inp");
    moe_rows_[l] = N;
    cpu_.moe_forward(moe, l, out, inp, N, o, step, replay);
  }
  void moe_backward(MoeLayer& moe, int64_t l, float* dinp, const float* dout,
                    const MoeBlockOffsets& o, float moe_weight) override {
    mine(dinp, moe_rows_[l] * cfg_C(moe), "moe dinp");
    mine(dout, moe_rows_[l] * cfg_C(moe), "moe dout");
    cpu_.moe_backward(moe, l, dinp, dout, o, moe_weight);
  }

 private:
  static int64_t cfg_C(MoeLayer& moe) { return moe.config().C; }
  // n elements at p lie inside one allocation of this memory.
  template <class T>
  void mine(const T* p, int64_t n, const char* what) {
    ++calls_;
    const char* c = reinterpret_cast<const char*>(p);
    auto it = blocks_.upper_bound(c);
    const bool inside = p && it != blocks_.begin() &&
                        c + n * static_cast<int64_t>(sizeof(T)) <=
                            std::prev(it)->first + static_cast<int64_t>(std::prev(it)->second);
    EXPECT_TRUE(inside) << what << ": " << n << " elements not in this device's memory";
  }
  void weight(int64_t w, int64_t n, const char* what) {
    EXPECT_TRUE(w >= 0 && w + n <= n_params_) << what << " at " << w;
  }
  void grad(const float* g, int64_t n, const char* what) {
    EXPECT_TRUE(g >= grads_ && g + n <= grads_ + n_params_) << what << ": not in the gradient";
  }

  CpuOps cpu_;
  int64_t n_params_;
  int* live_;
  std::map<const char*, std::size_t> blocks_;
  float* params_ = nullptr;
  float* grads_ = nullptr;
  const float* source_ = nullptr;
  bool stale_ = true;
  std::map<int64_t, int64_t> moe_rows_;
  int64_t calls_ = 0, uploads_ = 0;
};

// A dense block, a shared expert and capacity dropping, besides the routed experts.
ModelConfig mixed_config() {
  ModelConfig c = moetrain::testing::small_lm(40, 32, 24, 2);
  c.n_layers = 3;
  c.dense_every = 2;  // block 1 dense
  c.shared_expert_hidden = 16;
  c.capacity_factor = 1.0;
  c.max_seq_len = 16;
  c.aux_loss_coef = 0.01;
  c.z_loss_coef = 0.001;
  return c;
}

struct Steps {
  std::vector<LossParts> parts;
  std::vector<float> grads, logits;
};

// Two steps (the parameters move in between) of forward and backward on the same batch; the
// second step's gradient.
Steps run(Transformer& model, std::vector<float> params) {
  const ModelConfig& cfg = model.config();
  const int64_t B = 2, T = 12, N = B * T;
  std::vector<int32_t> inputs(N), targets(N);
  for (int64_t i = 0; i < N; ++i) {
    inputs[i] = static_cast<int32_t>((i * 11 + 5) % cfg.vocab_size);
    targets[i] = i % 7 == 3 ? -1 : static_cast<int32_t>((i * 3 + 2) % cfg.vocab_size);
  }
  Steps r;
  r.grads.assign(params.size(), 0.0f);
  for (int s = 0; s < 2; ++s) {
    MoeStep step;
    step.step = static_cast<uint64_t>(s);
    r.parts.push_back(model.forward(params.data(), inputs.data(), targets.data(), B, T, step));
    // From zero: a device sums its gradient apart and adds it in, the CPU into the buffer.
    std::fill(r.grads.begin(), r.grads.end(), 0.0f);
    model.backward(params.data(), r.grads.data(), 0.5f);
    for (std::size_t i = 0; i < params.size(); ++i) params[i] -= 0.01f * r.grads[i];
    model.weights_changed();
  }
  const float* lg = model.logits();
  r.logits.assign(lg, lg + N * cfg.vocab_size);
  return r;
}

}  // namespace

TEST(ModelOps, TheDescriptionOnADevicesMemoryGivesTheCpuBits) {
  const ModelConfig cfg = mixed_config();
  Transformer cpu(cfg), dev(cfg);
  // The CPU's bf16 operands set as a trainer sets them before handing the model to a device: the
  // device keeps its own operands, so the CPU's weight copy is never made.
  dev.set_precision(DType::BF16);
  std::vector<float> params(static_cast<std::size_t>(cpu.layout().size()));
  init_params(params.data(), cpu.layout(), cfg, 11);
  int live = 0;
  auto ops = std::make_unique<CheckedOps>(cfg, dev.layout().size(), &live);
  CheckedOps* checked = ops.get();
  dev.set_device(std::move(ops));
  ASSERT_NE(dev.device_ops(), nullptr);
  // The gradients reach the caller's buffer when backward ends: no hook says so earlier.
  int hooks = 0;
  dev.set_grads_ready_hook([&](int64_t) { ++hooks; });

  const Steps a = run(cpu, params), b = run(dev, params);
  EXPECT_GT(checked->calls(), 100);  // every operation went through the stand-in
  EXPECT_EQ(checked->uploads(), 2);  // the parameters went over once a step
  ASSERT_EQ(a.parts.size(), b.parts.size());
  for (std::size_t s = 0; s < a.parts.size(); ++s) {
    EXPECT_EQ(a.parts[s].total, b.parts[s].total) << "step " << s;
    EXPECT_EQ(a.parts[s].aux, b.parts[s].aux) << "step " << s;
    EXPECT_EQ(a.parts[s].targets, b.parts[s].targets);
  }
  EXPECT_GT(a.parts[1].aux, 0.0);
  EXPECT_EQ(std::memcmp(a.grads.data(), b.grads.data(), a.grads.size() * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(a.logits.data(), b.logits.data(), a.logits.size() * sizeof(float)), 0);
  EXPECT_EQ(hooks, 0);
  {
    const std::vector<int32_t> tokens(8, 1);
    MoeStep step;
    step.training = false;
    dev.forward(params.data(), tokens.data(), tokens.data(), 1, 8, step);
    EXPECT_EQ(dev.lp_copy_of(params.data()).data, nullptr);
  }

  // Back on the CPU: the buffers leave the device's memory, and the bits stay.
  EXPECT_GT(live, 0);
  dev.set_device("cpu");
  dev.set_precision(DType::F32);  // as the CPU model computes
  const Steps c = run(dev, params);
  EXPECT_EQ(std::memcmp(a.grads.data(), c.grads.data(), a.grads.size() * sizeof(float)), 0);
  EXPECT_EQ(live, 2);  // its own parameters and gradient: every activation moved
  EXPECT_GT(hooks, 0);  // on the CPU, as backward goes
}

TEST(ModelOps, ADeviceRefusesWhatOnlyTheCpuRuns) {
  const ModelConfig cfg = mixed_config();
  Transformer model(cfg);
  int live = 0;
  model.set_device(std::make_unique<CheckedOps>(cfg, model.layout().size(), &live));
  EXPECT_THROW(model.set_recompute(Recompute::Moe), Error);
  EXPECT_THROW(model.set_split_backward(true), Error);
  EXPECT_THROW(model.set_stage(0, 1), Error);
  std::vector<float> params(static_cast<std::size_t>(model.layout().size()));
  init_params(params.data(), model.layout(), cfg, 3);
  KvCache cache = model.make_kv_cache(4);
  const int32_t tokens[2] = {1, 2};
  EXPECT_THROW(model.prefill(params.data(), tokens, 2, cache), Error);

  // The other way round: a model split for zero_bubble is not handed to a device.
  Transformer split(cfg);
  split.set_split_backward(true);
  EXPECT_THROW(split.set_device(std::make_unique<CheckedOps>(cfg, split.layout().size(), &live)),
               Error);
  EXPECT_EQ(split.device_ops(), nullptr);
}
