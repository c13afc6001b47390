// Parameter-server transport cost over a loopback DEALER/ROUTER pair, against raw ZeroMQ sends
// of the same bytes:
//   push  the worker builds the frame in place (header, encoding, CRC-32C) and sends it; the
//         server validates it (checksum) and decodes it as it does for real (a dense f32 push is
//         read where it arrived, other encodings are decoded), then acknowledges with a header.
//         Raw: the same number of bytes sent from a buffer, an empty reply.
//   pull  a header-only request; the server copies its range into a frame built in place and
//         seals it; the worker validates it and copies the values into its parameters.
//         Raw: an empty request, the same number of bytes back from a buffer.
//   curve the ps path over CURVE sockets with the job-key scheme of ps/security.h (ZAP handler
//         included), against the same path in plaintext.
// Every variant does one untimed round trip first (the connection, and CURVE's handshake).
// Prints medians of 5 runs. Only in builds with ZeroMQ.
#ifdef MOETRAIN_WITH_ZMQ
#include <zmq.hpp>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <thread>
#include <vector>

#include "core/timer.h"
#include "ps/codec.h"
#include "ps/message.h"
#include "ps/security.h"
#include "ps/transport.h"

using namespace moetrain;
using namespace moetrain::ps;

namespace {

enum class Op { Push, Pull };

JobKeys g_keys;

double round_trips(int64_t n, int iters, bool ps, Encoding enc, Op op, bool curve = false) {
  if (curve)
    use_curve(g_keys);
  else
    use_plaintext();
  zmq::context_t ctx;
  zmq::socket_t router(ctx, zmq::socket_type::router), dealer(ctx, zmq::socket_type::dealer);
  secure_server(ctx, router);
  router.bind("tcp://127.0.0.1:*");
  secure_client(dealer);
  dealer.connect(router.get(zmq::sockopt::last_endpoint));
  ++iters;  // the first, untimed
  const std::size_t bytes = op == Op::Push ? encoded_size(enc, n) : static_cast<std::size_t>(n) * 4;
  std::thread server([&] {
    std::vector<float> dst(static_cast<std::size_t>(n)), params(dst.size(), 0.5f);
    const std::string raw(bytes, 'x');
    volatile float sink = 0;
    for (int i = 0; i < iters; ++i) {
      zmq::message_t id, frame;
      (void)router.recv(id);
      (void)router.recv(frame);
      router.send(id, zmq::send_flags::sndmore);
      if (!ps) {
        if (op == Op::Push) router.send(zmq::message_t(), zmq::send_flags::none);
        else router.send(zmq::buffer(raw), zmq::send_flags::none);
        continue;
      }
      Decoded d = decode(frame.data(), frame.size());
      if (op == Op::Push) {
        if (enc == Encoding::F32) {
          sink = reinterpret_cast<const float*>(d.payload)[n - 1];
        } else {
          decode_push(d.header, d.payload, n, dst.data(), nullptr);
        }
        Header ack;
        ack.kind = static_cast<uint16_t>(Kind::PushAck);
        router.send(zmq::buffer(encode(ack, {})), zmq::send_flags::none);
      } else {
        Header h;
        h.kind = static_cast<uint16_t>(Kind::PullReply);
        h.flags = static_cast<uint32_t>(Encoding::F32);
        h.key_end = n;
        zmq::message_t m = new_frame(h, bytes);
        std::memcpy(frame_payload(m), params.data(), bytes);
        seal(m.data(), m.size());
        router.send(m, zmq::send_flags::none);
      }
    }
    (void)sink;
  });
  std::vector<float> g(static_cast<std::size_t>(n));
  for (int64_t i = 0; i < n; ++i) g[i] = static_cast<float>(i % 97) * 1e-3f;
  std::vector<float> residual(g.size(), 0.0f), params(g.size());
  const std::string raw(bytes, 'x');
  Timer t;
  for (int i = 0; i < iters; ++i) {
    if (i == 1) t.reset();
    zmq::message_t reply;
    if (!ps) {
      if (op == Op::Push) dealer.send(zmq::buffer(raw), zmq::send_flags::none);
      else dealer.send(zmq::message_t(), zmq::send_flags::none);
      (void)dealer.recv(reply);
      continue;
    }
    Header h;
    h.key_end = n;
    if (op == Op::Push) {
      h.kind = static_cast<uint16_t>(Kind::Push);
      h.flags = static_cast<uint32_t>(enc);
      zmq::message_t m = new_frame(h, bytes);
      write_push(enc, g.data(), n, nullptr, enc == Encoding::Int8 ? residual.data() : nullptr,
                 frame_payload(m));
      seal(m.data(), m.size());
      dealer.send(m, zmq::send_flags::none);
      (void)dealer.recv(reply);
      (void)decode(reply.data(), reply.size());
    } else {
      h.kind = static_cast<uint16_t>(Kind::Pull);
      zmq::message_t m = new_frame(h, 0);
      seal(m.data(), m.size());
      dealer.send(m, zmq::send_flags::none);
      (void)dealer.recv(reply);
      Decoded d = decode(reply.data(), reply.size());
      std::memcpy(params.data(), d.payload, d.header.bytes);
    }
  }
  const double s = t.seconds();
  server.join();
  return s / (iters - 1);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main() {
  char pub[41] = {}, sec[41] = {};
  if (zmq_curve_keypair(pub, sec) != 0) {
    std::printf("bench_ps: this libzmq has no CURVE\n");
    return 1;
  }
  g_keys = {pub, sec};
  std::printf("%-5s %-10s %-6s %12s %12s %12s %8s %12s %10s\n", "op", "floats", "enc", "bytes",
              "raw_us", "ps_us", "ps/raw", "curve_us", "curve/ps");
  for (Op op : {Op::Push, Op::Pull}) {
    for (int64_t n : {int64_t{1} << 16, int64_t{1} << 20, int64_t{1} << 22}) {
      for (Encoding enc : {Encoding::F32, Encoding::Bf16, Encoding::Int8}) {
        if (op == Op::Pull && enc != Encoding::F32) continue;  // pulls are f32
        const int iters = n >= (1 << 22) ? 10 : 50;
        std::vector<double> raw, ps, cur;
        // Interleaved, so both see the same machine load.
        for (int r = 0; r < 5; ++r) {
          raw.push_back(round_trips(n, iters, false, enc, op));
          ps.push_back(round_trips(n, iters, true, enc, op));
          cur.push_back(round_trips(n, iters, true, enc, op, true));
        }
        const double a = median(raw), b = median(ps), c = median(cur);
        const std::size_t bytes =
            (op == Op::Push ? encoded_size(enc, n) : static_cast<std::size_t>(n) * 4) +
            sizeof(Header);
        std::printf("%-5s %-10lld %-6s %12zu %12.1f %12.1f %8.2f %12.1f %10.2f\n",
                    op == Op::Push ? "push" : "pull", static_cast<long long>(n),
                    std::string(compression_name(enc)).c_str(), bytes, a * 1e6, b * 1e6, b / a,
                    c * 1e6, c / b);
      }
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
