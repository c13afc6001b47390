// Parameter-server transport cost: a push (header, CRC-32, encoding, validation, decode) and its
// acknowledgement over a loopback DEALER/ROUTER pair, against raw ZeroMQ sends of the same bytes
// with an empty reply; and the bytes a push takes dense f32, bf16 and int8. Prints medians.
// Only in builds with ZeroMQ.
#ifdef MOETRAIN_WITH_ZMQ
#include <zmq.hpp>

#include <algorithm>
#include <cstdio>
#include <thread>
#include <vector>

#include "core/timer.h"
#include "ps/codec.h"
#include "ps/message.h"

using namespace moetrain;
using namespace moetrain::ps;

namespace {

// Round trips of `frames` over a ROUTER echo thread that, when `ps` is set, validates and
// decodes each push before acknowledging it with a header-only message.
double round_trips(int64_t n, int iters, bool ps, Encoding enc) {
  zmq::context_t ctx;
  zmq::socket_t router(ctx, zmq::socket_type::router), dealer(ctx, zmq::socket_type::dealer);
  router.bind("tcp://127.0.0.1:*");
  dealer.connect(router.get(zmq::sockopt::last_endpoint));
  std::thread server([&] {
    std::vector<float> dst(static_cast<std::size_t>(n));
    for (int i = 0; i < iters; ++i) {
      zmq::message_t id, frame;
      (void)router.recv(id);
      (void)router.recv(frame);
      router.send(id, zmq::send_flags::sndmore);
      if (ps) {
        Decoded d = decode(frame.data(), frame.size());
        decode_push(d.header, d.payload, n, dst.data(), nullptr);
        Header ack;
        ack.kind = static_cast<uint16_t>(Kind::PushAck);
        router.send(zmq::buffer(encode(ack, {})), zmq::send_flags::none);
      } else {
        router.send(zmq::message_t(), zmq::send_flags::none);
      }
    }
  });
  std::vector<float> g(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) g[i] = static_cast<float>(i % 97) * 1e-3f;
  std::vector<float> residual(g.size(), 0.0f);
  const std::string raw(encoded_size(enc, n), 'x');
  Timer t;
  for (int i = 0; i < iters; ++i) {
    if (ps) {
      Header h;
      h.kind = static_cast<uint16_t>(Kind::Push);
      h.flags = static_cast<uint32_t>(enc);
      h.key_end = n;
      dealer.send(zmq::buffer(encode(h, encode_push(enc, g.data(), n, nullptr,
                                                    enc == Encoding::Int8 ? residual.data() : nullptr))),
                  zmq::send_flags::none);
      zmq::message_t reply;
      (void)dealer.recv(reply);
      (void)decode(reply.data(), reply.size());
    } else {
      dealer.send(zmq::buffer(raw), zmq::send_flags::none);
      zmq::message_t reply;
      (void)dealer.recv(reply);
    }
  }
  const double s = t.seconds();
  server.join();
  return s / iters;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  std::printf("%-10s %-6s %12s %12s %12s %8s\n", "floats", "enc", "bytes", "raw_us", "ps_us",
              "ps/raw");
  for (int64_t n : {int64_t{1} << 16, int64_t{1} << 20, int64_t{1} << 22}) {
    for (Encoding enc : {Encoding::F32, Encoding::Bf16, Encoding::Int8}) {
      const int iters = n >= (1 << 22) ? 10 : 50;
      std::vector<double> raw, ps;
      for (int r = 0; r < 5; ++r) {
        raw.push_back(round_trips(n, iters, false, enc));
        ps.push_back(round_trips(n, iters, true, enc));
      }
      const double a = median(raw), b = median(ps);
      std::printf("%-10lld %-6s %12zu %12.1f %12.1f %8.2f\n", static_cast<long long>(n),
                  std::string(compression_name(enc)).c_str(), encoded_size(enc, n) + sizeof(Header),
                  a * 1e6, b * 1e6, b / a);
    }
  }
  return 0;
}
#else
#include <cstdio>
int main() {
  std::printf("bench_ps: this build has no ZeroMQ (MOETRAIN_WITH_ZMQ=OFF); nothing to measure\n");
  return 0;
}
#endif
