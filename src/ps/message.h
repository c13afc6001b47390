// The parameter-server wire format: every message is one ZeroMQ frame holding a fixed 88-byte
// little-endian header followed by `bytes` of payload. The checksum (CRC-32C) covers the header
// (with the checksum field zeroed) and the payload, so a flipped bit anywhere is caught. Control
// messages carry JSON; data messages (push, pull replies) carry floats in the encoding that the
// flags name (see codec.h).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace moetrain::ps {

enum class Kind : uint16_t {
  Register = 1,     // node → scheduler: JSON {role, ...}
  Setup,            // scheduler → node: JSON job layout (config, servers, workers, options)
  Heartbeat,        // node → scheduler; value = worker throughput (rows/s)
  HeartbeatAck,     // scheduler → node
  Push,             // worker → server: gradients of [key_begin, key_end) at `clock`
  PushAck,          // server → worker
  Pull,             // worker → server: parameters once `clock` allows (consistency mode), in the
                    // encoding its flags name
  PullReply,        // server → worker: parameters in the pull's encoding; aux0 = the clock the
                    // worker should continue at
  Done,             // worker → scheduler: all steps pushed
  Finish,           // scheduler → node: the job is over (JSON {lead: bool} for workers)
  FinishAck,        // node → scheduler: final state written
  Shutdown,         // scheduler → node: stop now (JSON {reason}); non-zero exit unless ok
  Replicate,        // primary server → its backup: one applied update (f32 summed gradient,
                    // then aux0 bytes of the update rule's side input: the sparse-expert mask);
                    // clock = the update's clock, value = lr,
                    // aux1 = the pushing worker and ticket = its clock after the push (async, ssp)
  ReplicateAck,     // backup → primary: clock = the backup's version after applying
  CheckpointQuery,  // scheduler → server: which checkpointed clocks do you hold?
  CheckpointList,   // server → scheduler: JSON {clocks: [...]}
  Restore,          // scheduler → server: JSON {clock, generation}: roll back to that checkpoint
  Restored,         // server → scheduler: JSON {clock}
  Snapshot,         // primary server → a new backup: its whole state at version `clock`
                    // (f32 values, then aux1 state buffers of the update rule, then the worker
                    // clocks as int64 pairs); aux0 = the update rule's step count
  RowsQuery,        // scheduler → worker: a new row split is coming; stop before the next clock
  RowsReady,        // worker → scheduler: JSON {clock}: the next clock it would start
  NormReport,       // primary server → scheduler: JSON {version, generation, kind, part}: its
                    // range's part of a sync update's global figures (ps/global_norm.h)
  ClipScale,        // scheduler → server: JSON {version, generation, kind, sum} (+ norm, scale
                    // for a clip round)
  CapacityReport,   // worker → scheduler: JSON {clock, generation, figures}: its clock's MoE
                    // figures for the dynamic capacity controller (ps/capacity_rounds.h); without
                    // figures, a request for the factors of `clock`
  CapacityFactors,  // scheduler → worker: JSON {clock, generation, state}: the capacity
                    // controllers' state to compute `clock` with
};
constexpr uint16_t kMaxKind = static_cast<uint16_t>(Kind::CapacityFactors);
std::string_view kind_name(Kind kind);

constexpr uint32_t kMagic = 0x5350544du;  // "MTPS" read as little-endian bytes
constexpr uint16_t kWireVersion = 5;
// A push of the whole parameter vector of a model of a few hundred million floats still fits.
constexpr uint64_t kMaxPayload = uint64_t{1} << 32;

// Payload encodings (flags bits 0..3) and the sparse bit (a range list precedes the values).
enum class Encoding : uint32_t { F32 = 0, Bf16 = 1, Int8 = 2, Json = 3 };
constexpr uint32_t kEncodingMask = 0xf;
constexpr uint32_t kSparseFlag = 0x10;
// Push and Replicate: bits 16–31 hold the size of the worker group the pushing worker belongs to
// (0 or 1: a worker alone). Workers g·P … g·P + P − 1 form group g; outside sync, a server applies
// the P pushes of a group's clock as one update (ps/consistency.h).
constexpr uint32_t kGroupShift = 16;
inline int64_t group_size_of(uint32_t flags) {
  const int64_t p = static_cast<int64_t>(flags >> kGroupShift);
  return p > 1 ? p : 1;
}
inline uint32_t group_flags(int64_t group_size) {
  return group_size > 1 ? static_cast<uint32_t>(group_size) << kGroupShift : 0u;
}

struct Header {
  uint32_t magic = kMagic;
  uint16_t version = kWireVersion;
  uint16_t kind = 0;
  int32_t sender = -1;  // node id (−1: not yet registered)
  uint32_t flags = 0;
  int64_t clock = 0;
  int64_t key_begin = 0;  // [key_begin, key_end) of the flat parameter vector
  int64_t key_end = 0;
  int64_t ticket = 0;  // request id, echoed by replies
  int64_t aux0 = 0;    // kind-specific (Push: rows of the worker's batch)
  int64_t aux1 = 0;    // kind-specific (Push: rows of the global batch)
  double value = 0;    // kind-specific (Push: the worker's loss)
  uint64_t bytes = 0;  // payload size
  uint32_t checksum = 0;
  // Bumped by every roll-back to a server checkpoint; servers drop pushes and pulls of an older
  // generation (they belong to the clocks that were undone).
  uint32_t generation = 0;

  Kind kind_enum() const { return static_cast<Kind>(kind); }
  Encoding encoding() const { return static_cast<Encoding>(flags & kEncodingMask); }
};
static_assert(sizeof(Header) == 88, "the wire header is 88 bytes");

// Header + payload as one frame, checksum filled in.
std::string encode(Header h, std::string_view payload);

// For frames built in place: `frame` (size bytes) holds a header whose `bytes` says size − 88
// and the payload after it; fills in magic, version and the checksum.
void seal(void* frame, std::size_t size);

// A validated view of a frame: the header and a pointer to the payload inside `data`.
struct Decoded {
  Header header;
  const char* payload = nullptr;
};

// Validates a frame: size ≥ header, magic, version, a known kind, the declared size against the
// limit and the frame, flags, key range, checksum. Throws an Error saying which check failed and
// with what value; never reads outside [data, data + size).
Decoded decode(const void* data, std::size_t size);

// CRC-32C (io/crc32c.h: the SSE4.2 instruction where the CPU has it), continued from `crc`.
uint32_t crc32_bytes(const void* data, std::size_t size, uint32_t crc = 0);

}  // namespace moetrain::ps
