// The parameter-server wire format and payload encodings, and the gatekeeper's pure planning
// functions: every malformed frame is refused with a reason, every encoding round-trips within
// its precision, int8 error feedback loses nothing over time.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "core/check.h"
#include "ps/codec.h"
#include "ps/message.h"
#include "ps/options.h"
#include "train/config_schema.h"
#include "support/expect_error.h"

using namespace moetrain;
using namespace moetrain::ps;
using moetrain::testing::expect_error;

namespace {

std::string sample_frame(std::string payload = "hello") {
  Header h;
  h.kind = static_cast<uint16_t>(Kind::Push);
  h.sender = 3;
  h.clock = 17;
  h.key_begin = 100;
  h.key_end = 200;
  h.ticket = 9;
  h.value = 2.5;
  return encode(h, payload);
}

TEST(PsMessage, RoundTrip) {
  const std::string f = sample_frame();
  Decoded d = decode(f.data(), f.size());
  EXPECT_EQ(d.header.kind_enum(), Kind::Push);
  EXPECT_EQ(d.header.sender, 3);
  EXPECT_EQ(d.header.clock, 17);
  EXPECT_EQ(d.header.key_end, 200);
  EXPECT_EQ(d.header.ticket, 9);
  EXPECT_EQ(d.header.value, 2.5);
  EXPECT_EQ(d.header.bytes, 5u);
  EXPECT_EQ(std::string(d.payload, d.header.bytes), "hello");
}

TEST(PsMessage, RejectsMalformedFrames) {
  std::string f = sample_frame();
  expect_error([&] { decode(f.data(), 10); }, "shorter than the 88-byte header");
  expect_error([&] { decode(f.data(), f.size() - 1); }, "truncated");
  std::string padded = f + "x";
  expect_error([&] { decode(padded.data(), padded.size()); }, "truncated or padded");

  std::string bad = f;
  bad[0] ^= 0x5a;
  expect_error([&] { decode(bad.data(), bad.size()); }, "bad magic");

  Header h;
  std::memcpy(&h, f.data(), sizeof h);
  auto with = [&](auto mutate) {
    Header x = h;
    mutate(x);
    std::string g = f;
    std::memcpy(g.data(), &x, sizeof x);
    return g;
  };
  std::string v = with([](Header& x) { x.version = 7; });
  expect_error([&] { decode(v.data(), v.size()); }, "wire version 7");
  std::string k = with([](Header& x) { x.kind = 999; });
  expect_error([&] { decode(k.data(), k.size()); }, "unknown message kind 999");
  std::string huge = with([](Header& x) { x.bytes = uint64_t{1} << 60; });
  expect_error([&] { decode(huge.data(), huge.size()); }, "exceeds the limit");
  std::string range = with([](Header& x) { x.key_end = 5; });
  expect_error([&] { decode(range.data(), range.size()); }, "bad key range");
  std::string flip = f;
  flip.back() ^= 1;
  expect_error([&] { decode(flip.data(), flip.size()); }, "checksum mismatch");
}

TEST(PsMessage, RandomBytesNeverDecode) {
  std::mt19937 rng(7);
  for (int i = 0; i < 2000; ++i) {
    std::string junk(rng() % 300, '\0');
    for (char& c : junk) c = static_cast<char>(rng());
    EXPECT_THROW(decode(junk.data(), junk.size()), Error);
  }
}

std::vector<float> ramp(int64_t n) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[i] = std::sin(0.37f * static_cast<float>(i)) * (1 + i % 5);
  return v;
}

Header push_header(Encoding e, bool sparse, std::size_t bytes) {
  Header h;
  h.flags = static_cast<uint32_t>(e) | (sparse ? kSparseFlag : 0u);
  h.bytes = bytes;
  return h;
}

TEST(PsCodec, DenseEncodingsRoundTrip) {
  const int64_t n = 1000;
  auto v = ramp(n);
  for (Encoding e : {Encoding::F32, Encoding::Bf16, Encoding::Int8}) {
    std::string p = encode_push(e, v.data(), n, nullptr, nullptr);
    EXPECT_EQ(p.size(), encoded_size(e, n));
    std::vector<float> out(n);
    decode_push(push_header(e, false, p.size()), p.data(), n, out.data(), nullptr);
    const double tol = e == Encoding::F32 ? 0 : e == Encoding::Bf16 ? 1.0 / 128 : 1.0 / 100;
    for (int64_t i = 0; i < n; ++i)
      ASSERT_LE(std::fabs(out[i] - v[i]), tol * 5 + 1e-7) << compression_name(e) << " at " << i;
  }
  EXPECT_EQ(encoded_size(Encoding::Int8, 1000), 4u * 4 + 1000);
  EXPECT_EQ(encoded_size(Encoding::Bf16, 1000), 2000u);
}

TEST(PsCodec, SparseKeepsOnlyTheRanges) {
  const int64_t n = 300;
  auto v = ramp(n);
  std::vector<Span> keep = {{0, 10}, {50, 100}, {299, 1}};
  std::string p = encode_push(Encoding::F32, v.data(), n, &keep, nullptr);
  EXPECT_EQ(p.size(), 4 + 3 * 16 + 111 * 4u);
  std::vector<float> out(n, 99.0f);
  std::vector<Span> got;
  decode_push(push_header(Encoding::F32, true, p.size()), p.data(), n, out.data(), &got);
  ASSERT_EQ(got.size(), 3u);
  for (int64_t i = 0; i < n; ++i) {
    const bool in = i < 10 || (i >= 50 && i < 150) || i == 299;
    EXPECT_EQ(out[i], in ? v[i] : 0.0f) << i;
  }
  // A range reaching past the key range, and ranges out of order, are refused.
  std::vector<Span> over = {{290, 20}};
  std::string q = encode_push(Encoding::F32, v.data(), 320, &over, nullptr);
  expect_error(
      [&] {
        decode_push(push_header(Encoding::F32, true, q.size()), q.data(), n, out.data(), nullptr);
      },
      "outside");
  std::string r = p;
  uint32_t big = 1u << 30;
  std::memcpy(r.data(), &big, 4);
  expect_error(
      [&] {
        decode_push(push_header(Encoding::F32, true, r.size()), r.data(), n, out.data(), nullptr);
      },
      "ranges");
  expect_error(
      [&] {
        decode_push(push_header(Encoding::F32, false, p.size()), p.data(), n, out.data(), nullptr);
      },
      "take");
}

TEST(PsCodec, Int8ErrorFeedbackLosesNothingOverTime) {
  const int64_t n = 777;
  auto g = ramp(n);
  std::vector<float> residual(n, 0.0f), sent_total(n, 0.0f);
  const int rounds = 50;
  for (int r = 0; r < rounds; ++r) {
    std::string p = encode_push(Encoding::Int8, g.data(), n, nullptr, residual.data());
    std::vector<float> out(n);
    decode_push(push_header(Encoding::Int8, false, p.size()), p.data(), n, out.data(), nullptr);
    for (int64_t i = 0; i < n; ++i) sent_total[i] += out[i];
  }
  // What arrived plus what is still held equals what was pushed, to float rounding.
  for (int64_t i = 0; i < n; ++i)
    ASSERT_NEAR(sent_total[i] + residual[i], rounds * g[i], 1e-3 * (1 + std::fabs(rounds * g[i])));
}

TEST(PsPlan, KeyRangesTileAndAlign) {
  auto r = split_keys(1000, 3);
  ASSERT_EQ(r.size(), 3u);
  EXPECT_EQ(r[0].begin, 0);
  EXPECT_EQ(r[2].end, 1000);
  for (std::size_t i = 1; i < r.size(); ++i) {
    EXPECT_EQ(r[i].begin, r[i - 1].end);
    EXPECT_EQ(r[i].begin % 16, 0);
  }
}

TEST(PsPlan, RowsFollowTheWeights) {
  EXPECT_EQ(split_rows(8, {1, 1}), (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(split_rows(9, {1, 1, 1}), (std::vector<int64_t>{3, 3, 3}));
  EXPECT_EQ(split_rows(12, {2, 1}), (std::vector<int64_t>{8, 4}));
  auto r = split_rows(5, {100, 1, 1});
  EXPECT_EQ(r[1], 1);
  EXPECT_EQ(r[0] + r[1] + r[2], 5);
  expect_error([] { split_rows(2, {1, 1, 1}); }, "cannot feed 3 workers");
}

TEST(PsOptions, RejectBadValuesByName) {
  PsOptions o;
  o.consistency = "eventual";
  expect_error([&] { o.validate(); }, "--consistency 'eventual'");
  o = {};
  o.consistency = "quorum";
  o.workers = 3;
  o.quorum = 4;
  expect_error([&] { o.validate(); }, "--quorum 4");
  o = {};
  o.staleness = 2;
  expect_error([&] { o.validate(); }, "only meaningful with --consistency ssp or half_sync");
  o = {};
  o.consistency = "half_sync";
  o.staleness = 1;
  expect_error([&] { o.validate(); }, "--half-sync-wait-ms 0: with --consistency half_sync");
  for (double bad : {-5.0, 1e9, std::nan("")}) {
    o.half_sync_wait_ms = bad;
    expect_error([&] { o.validate(); }, "must be in (0, 60000] milliseconds");
  }
  o.half_sync_wait_ms = 20;
  o.validate();
  EXPECT_EQ(PsOptions::from_json(o.to_json()).half_sync_wait_ms, 20);
  o.staleness = -1;
  expect_error([&] { o.validate(); }, "--staleness -1: must be ≥ 0");
  o = {};
  o.consistency = "ssp";
  o.half_sync_wait_ms = 10;
  expect_error([&] { o.validate(); },
               "--half-sync-wait-ms 10 is only meaningful with --consistency half_sync");
  o = {};
  o.consistency = "average";
  expect_error([&] { o.validate(); }, "--local-steps 0: with --consistency average it must be in");
  o.local_steps = 4;
  o.validate();
  EXPECT_EQ(PsOptions::from_json(o.to_json()).local_steps, 4);
  o.push_compression = "int8";
  expect_error([&] { o.validate(); },
               "--push-compression int8 with --consistency average: pushes carry parameters");
  o = {};
  o.local_steps = 2;
  expect_error([&] { o.validate(); },
               "--local-steps 2 is only meaningful with --consistency average");
  o = {};
  o.push_compression = "zip";
  expect_error([&] { o.validate(); },
               "--push-compression 'zip': allowed are none, bf16, int8");
  o = {};
  o.pull_compression = "fp8";
  expect_error([&] { o.validate(); }, "--pull-compression 'fp8': allowed are none, bf16, int8");
  EXPECT_THROW(PsOptions::from_json(o.to_json()), Error);
  o.pull_compression = "int8";
  EXPECT_EQ(PsOptions::from_json(o.to_json()).pull_encoding(), Encoding::Int8);
  o = {};
  o.heartbeat_timeout = 0.1;
  expect_error([&] { o.validate(); }, "--heartbeat-timeout");
  RunConfig cfg;
  PsOptions one, two;
  two.servers = 2;
  // Clipping by the global norm over several servers: sync gathers the partial norms of one
  // update, average clips on the workers; the modes that apply pushes one by one are refused.
  check_ps_run_config(cfg, one);
  check_ps_run_config(cfg, two);
  two.consistency = "average";
  check_ps_run_config(cfg, two);
  for (const char* mode : {"quorum", "async", "ssp", "half_sync"}) {
    two.consistency = mode;
    expect_error([&] { check_ps_run_config(cfg, two); },
                 fmt::format("optim.grad_clip = 1 with --servers 2 and --consistency {}", mode)
                     .c_str());
    one.consistency = mode;
    check_ps_run_config(cfg, one);
  }
  one.consistency = two.consistency = "sync";
  // Aux-loss-free balancing: sync sums a clock's expert loads; they and the biases travel as f32.
  cfg.model.router = RouterKind::SigmoidBias;
  cfg.optim.grad_clip = 0;
  check_ps_run_config(cfg, two);
  two.consistency = "async";
  expect_error([&] { check_ps_run_config(cfg, two); },
               "model.router = sigmoid_bias with --consistency async");
  two.consistency = "sync";
  two.pull_compression = "bf16";
  expect_error([&] { check_ps_run_config(cfg, two); },
               "model.router = sigmoid_bias with --push-compression none --pull-compression bf16");
  two.pull_compression = "none";
  cfg.model.n_experts = 4;
  check_worker_group(cfg, two, 2);  // a group carries the loads and biases as dense keys
  cfg.model.router = RouterKind::TopKSoftmax;
  cfg.optim.grad_clip = 1;
  cfg.optim.grad_clip = 0;
  cfg.model.capacity = CapacityMode::Dynamic;
  cfg.model.capacity_factor = 1.0;
  check_ps_run_config(cfg, two);  // sync: the scheduler runs the controllers (capacity_test.cpp)
  two.consistency = "async";
  expect_error([&] { check_ps_run_config(cfg, two); },
               "model.capacity = dynamic with --consistency async");
  two.consistency = "sync";
  cfg.model.capacity = CapacityMode::Fixed;
  // Sparse expert gradients: sync sums a clock's expert token counts, which travel as exact f32
  // (at most 2^24 tokens a micro-batch); a backup replays each update with its mask.
  cfg.grad.sparse_experts = true;
  check_ps_run_config(cfg, two);
  two.consistency = "async";
  expect_error([&] { check_ps_run_config(cfg, two); },
               "grad.sparse_experts = true with --consistency async");
  one.consistency = "average";
  expect_error([&] { check_ps_run_config(cfg, one); },
               "grad.sparse_experts = true with --consistency average");
  one.consistency = two.consistency = "sync";
  two.push_compression = "int8";
  expect_error([&] { check_ps_run_config(cfg, two); },
               "grad.sparse_experts = true with --push-compression int8");
  two.push_compression = "none";
  two.server_replicas = 2;
  check_ps_run_config(cfg, two);
  two.server_replicas = 1;
  {
    // 256 workers × 1024 rows × train.seq_len tokens ≥ 2^25.
    RunConfig big = cfg;
    big.train.batch_size = 1024;
    PsOptions many = two;
    many.workers = 256;
    ASSERT_GE(big.train.seq_len, 128);
    expect_error([&] { check_ps_run_config(big, many); }, "could make an expert's count inexact");
  }
  cfg.model.n_experts = 4;
  check_worker_group(cfg, two, 2);  // and the expert token counts
  // Hot-expert replicas live on a group's other ranks: refused on a worker alone, and beyond the
  // experts a rank holds.
  cfg.placement.spare_slots = 1;
  check_worker_group(cfg, two, 2);
  expect_error([&] { check_worker_group(cfg, two, 1); },
               "placement.spare_slots = 1 on a worker without --ep");
  cfg.placement.spare_slots = 3;
  expect_error([&] { check_worker_group(cfg, two, 2); },
               "placement.spare_slots = 3 with --ep 2: at most the experts a rank holds (2 of 4)");
  cfg.placement.spare_slots = 0;
  cfg.grad.sparse_experts = false;
  // Expert reweighting: grad_norm, importance, and utilisation (from the expert count keys), in
  // sync with several servers.
  cfg.grad.expert_reweight = "grad_norm";
  check_ps_run_config(cfg, two);
  two.consistency = "async";
  expect_error([&] { check_ps_run_config(cfg, two); },
               "grad.expert_reweight = grad_norm with --servers 2 and --consistency async");
  one.consistency = "async";
  check_ps_run_config(cfg, one);
  one.consistency = "average";
  expect_error([&] { check_ps_run_config(cfg, one); },
               "grad.expert_reweight = grad_norm with --servers 1 and --consistency average");
  one.consistency = two.consistency = "sync";
  cfg.grad.expert_reweight = "importance";
  check_ps_run_config(cfg, two);
  cfg.grad.expert_reweight = "utilisation";
  check_ps_run_config(cfg, two);
  two.consistency = "quorum";
  two.quorum = 1;
  expect_error([&] { check_ps_run_config(cfg, two); },
               "grad.expert_reweight = utilisation with --consistency quorum");
  two.consistency = "sync";
  two.quorum = 0;
  cfg.grad.expert_reweight = "none";
  check_ps_run_config(cfg, two);
  // Settings a worker would ignore are refused by key, each named with its value.
  cfg.dist.ep = 2;
  cfg.dist.zero = 1;
  expect_error([&] { check_ps_run_config(cfg, two); }, "dist.ep = 2, dist.zero = 1: parameter-server");
  cfg.dist = {};
  for (const char* set : {"dist.sync=\"params\"", "dist.grad_reduce_dtype=\"bf16\"",
                          "dist.a2a_chunks=2", "dist.hierarchical=true"}) {
    RunConfig c = cfg;
    std::vector<Field> fields;
    add_dist_fields(fields, c.dist);
    ConfigSchema(fields).apply_overrides({set});
    const std::string key = std::string(set).substr(0, std::string(set).find('='));
    expect_error([&] { check_ps_run_config(c, two); }, (key + " = ").c_str());
  }
  cfg.train.precision = Precision::FP16;
  expect_error([&] { check_ps_run_config(cfg, two); }, "train.precision = fp16");
  cfg.train.precision = Precision::BF16;
  check_ps_run_config(cfg, two);
  cfg.train.device = "cuda";
  expect_error([&] { check_ps_run_config(cfg, two); }, "train.device = cuda");
}

// A frame built in place and sealed decodes like the encoded one.
TEST(PsMessage, SealedInPlaceEqualsEncoded) {
  Header h;
  h.kind = static_cast<uint16_t>(Kind::PullReply);
  h.clock = 4;
  h.generation = 2;
  const std::string payload(1000, 'z');
  const std::string a = encode(h, payload);
  std::string b(sizeof(Header) + payload.size(), '\0');
  h.bytes = payload.size();
  std::memcpy(b.data(), &h, sizeof h);
  std::memcpy(b.data() + sizeof h, payload.data(), payload.size());
  seal(b.data(), b.size());
  EXPECT_EQ(a, b);
  EXPECT_EQ(decode(b.data(), b.size()).header.generation, 2u);
}

}  // namespace
