#include "ps/message.h"

#include <bit>
#include <cstring>

#include "core/check.h"
#include "io/crc32c.h"

namespace moetrain::ps {

static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

std::string_view kind_name(Kind kind) {
  switch (kind) {
    case Kind::Register:
      return "register";
    case Kind::Setup:
      return "setup";
    case Kind::Heartbeat:
      return "heartbeat";
    case Kind::HeartbeatAck:
      return "heartbeat-ack";
    case Kind::Push:
      return "push";
    case Kind::PushAck:
      return "push-ack";
    case Kind::Pull:
      return "pull";
    case Kind::PullReply:
      return "pull-reply";
    case Kind::Done:
      return "done";
    case Kind::Finish:
      return "finish";
    case Kind::FinishAck:
      return "finish-ack";
    case Kind::Shutdown:
      return "shutdown";
    case Kind::Replicate:
      return "replicate";
    case Kind::ReplicateAck:
      return "replicate-ack";
    case Kind::CheckpointQuery:
      return "checkpoint-query";
    case Kind::CheckpointList:
      return "checkpoint-list";
    case Kind::Restore:
      return "restore";
    case Kind::Restored:
      return "restored";
    case Kind::Snapshot:
      return "snapshot";
    case Kind::RowsQuery:
      return "rows-query";
    case Kind::RowsReady:
      return "rows-ready";
    case Kind::NormReport:
      return "norm-report";
    case Kind::ClipScale:
      return "clip-scale";
    case Kind::CapacityReport:
      return "capacity-report";
    case Kind::CapacityFactors:
      return "capacity-factors";
  }
  return "unknown";
}

uint32_t crc32_bytes(const void* data, std::size_t size, uint32_t crc) {
  return crc32c(data, size, crc);
}

namespace {

uint32_t frame_checksum(Header h, const char* payload, std::size_t bytes) {
  h.checksum = 0;
  uint32_t crc = crc32_bytes(&h, sizeof(h));
  return crc32_bytes(payload, bytes, crc);
}

}  // namespace

void seal(void* frame, std::size_t size) {
  MOETRAIN_CHECK(size >= sizeof(Header), "frame of {} bytes has no room for the header", size);
  Header h;
  std::memcpy(&h, frame, sizeof(h));
  MOETRAIN_CHECK(h.bytes == size - sizeof(Header),
                 "header declares {} payload bytes, frame holds {}", h.bytes,
                 size - sizeof(Header));
  h.magic = kMagic;
  h.version = kWireVersion;
  h.checksum = frame_checksum(h, static_cast<const char*>(frame) + sizeof(Header), h.bytes);
  std::memcpy(frame, &h, sizeof(h));
}

std::string encode(Header h, std::string_view payload) {
  h.magic = kMagic;
  h.version = kWireVersion;
  h.bytes = payload.size();
  h.checksum = frame_checksum(h, payload.data(), payload.size());
  std::string frame(sizeof(Header) + payload.size(), '\0');
  std::memcpy(frame.data(), &h, sizeof(h));
  if (!payload.empty()) std::memcpy(frame.data() + sizeof(h), payload.data(), payload.size());
  return frame;
}

Decoded decode(const void* data, std::size_t size) {
  MOETRAIN_CHECK(size >= sizeof(Header), "frame of {} bytes is shorter than the {}-byte header",
                 size, sizeof(Header));
  Decoded d;
  std::memcpy(&d.header, data, sizeof(Header));
  const Header& h = d.header;
  MOETRAIN_CHECK(h.magic == kMagic,
                 "bad magic 0x{:08x} (expected 0x{:08x}): not a moetrain message", h.magic, kMagic);
  MOETRAIN_CHECK(h.version == kWireVersion, "wire version {} (this build speaks version {})",
                 h.version, kWireVersion);
  MOETRAIN_CHECK(h.kind >= 1 && h.kind <= kMaxKind, "unknown message kind {} (known: 1..{})",
                 h.kind, kMaxKind);
  MOETRAIN_CHECK(h.bytes <= kMaxPayload, "declared payload of {} bytes exceeds the limit of {}",
                 h.bytes, kMaxPayload);
  MOETRAIN_CHECK(h.bytes == size - sizeof(Header),
                 "declared payload of {} bytes but the frame carries {} (truncated or padded)",
                 h.bytes, size - sizeof(Header));
  // A group size (bits 16–31) only on a push or its replication.
  const bool grouped = h.kind_enum() == Kind::Push || h.kind_enum() == Kind::Replicate;
  const uint32_t known = kEncodingMask | kSparseFlag | (grouped ? ~0u << kGroupShift : 0u);
  MOETRAIN_CHECK((h.flags & ~known) == 0 &&
                     (h.flags & kEncodingMask) <= static_cast<uint32_t>(Encoding::Json),
                 "unknown flags 0x{:x}", h.flags);
  MOETRAIN_CHECK(h.key_begin >= 0 && h.key_end >= h.key_begin, "bad key range [{}, {})",
                 h.key_begin, h.key_end);
  d.payload = static_cast<const char*>(data) + sizeof(Header);
  const uint32_t crc = frame_checksum(h, d.payload, h.bytes);
  MOETRAIN_CHECK(crc == h.checksum,
                 "checksum mismatch (header says 0x{:08x}, contents give 0x{:08x})", h.checksum,
                 crc);
  return d;
}

}  // namespace moetrain::ps
