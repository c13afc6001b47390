#include "io/tensorboard.h"

#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <utility>

#include "core/check.h"
#include "io/crc32c.h"
#include "io/file.h"

namespace fs = std::filesystem;

namespace moetrain {

namespace {

// Protobuf wire types.
enum Wire : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

// tensorflow.Event, tensorflow.Summary, Summary.Value and HistogramProto field numbers
// (tensorflow/core/util/event.proto, tensorflow/core/framework/summary.proto).
enum EventField : uint32_t {
  kWallTime = 1,
  kStep = 2,
  kFileVersion = 3,
  kSummary = 5,
  kSessionLog = 7
};
enum SessionLogField : uint32_t { kStatus = 1 };
constexpr uint64_t kSessionStart = 1;  // SessionLog.SessionStatus.START
enum SummaryField : uint32_t { kValue = 1 };
enum ValueField : uint32_t { kTag = 1, kSimpleValue = 2, kHisto = 5, kMetadata = 9 };
enum SummaryMetadataField : uint32_t { kSummaryDescription = 3 };
enum HistoField : uint32_t {
  kMin = 1,
  kMax = 2,
  kNum = 3,
  kSum = 4,
  kSumSquares = 5,
  kBucketLimit = 6,
  kBucket = 7
};

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

void put_tag(std::string& out, uint32_t field, Wire wire) {
  put_varint(out, field << 3 | wire);
}

template <class T>
void put_le(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // x86 is little-endian, as the wire format
  out.append(b, sizeof(T));
}

void put_double(std::string& out, uint32_t field, double v) {
  put_tag(out, field, kFixed64);
  put_le(out, v);
}

void put_bytes(std::string& out, uint32_t field, std::string_view bytes) {
  put_tag(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out.append(bytes);
}

void put_packed_doubles(std::string& out, uint32_t field, const std::vector<double>& v) {
  if (v.empty()) return;
  put_tag(out, field, kLengthDelimited);
  put_varint(out, v.size() * sizeof(double));
  for (double d : v) put_le(out, d);
}

std::string host_name() {
  char buf[HOST_NAME_MAX + 1] = {};
  if (gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

// Value.metadata holding only the description; nothing when it is empty.
void put_description(std::string& value, std::string_view description) {
  if (description.empty()) return;
  std::string meta;
  put_bytes(meta, kSummaryDescription, description);
  put_bytes(value, kMetadata, meta);
}

}  // namespace

uint32_t masked_crc32c(const void* data, std::size_t n) {
  const uint32_t crc = crc32c(data, n);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord_frame(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  put_le(out, static_cast<uint64_t>(data.size()));
  put_le(out, masked_crc32c(out.data(), 8));
  out.append(data);
  put_le(out, masked_crc32c(data.data(), data.size()));
  return out;
}

std::vector<std::string> read_tfrecords(const fs::path& path) {
  MappedFile f(path);
  const uint8_t* p = f.data();
  const std::size_t n = f.size();
  std::vector<std::string> out;
  std::size_t at = 0;
  while (n - at >= 12) {
    uint64_t len = 0;
    uint32_t len_crc = 0;
    std::memcpy(&len, p + at, 8);
    std::memcpy(&len_crc, p + at + 8, 4);
    MOETRAIN_CHECK(
        masked_crc32c(p + at, 8) == len_crc,
        "{}: the record at byte {} has a corrupt length (checksum {:08x}, stored {:08x})",
        path.string(), at, masked_crc32c(p + at, 8), len_crc);
    if (len > n - at - 12 || n - at - 12 - len < 4) break;  // torn: the file ends inside it
    const uint8_t* data = p + at + 12;
    uint32_t data_crc = 0;
    std::memcpy(&data_crc, data + len, 4);
    MOETRAIN_CHECK(masked_crc32c(data, len) == data_crc,
                   "{}: the record at byte {} ({} bytes) has a corrupt body (checksum {:08x}, "
                   "stored {:08x})",
                   path.string(), at, len, masked_crc32c(data, len), data_crc);
    out.emplace_back(reinterpret_cast<const char*>(data), len);
    at += 12 + len + 4;
  }
  return out;
}

void Summary::add_scalar(std::string_view tag, float value, std::string_view description) {
  std::string v;
  put_bytes(v, kTag, tag);
  // Written even when 0: simple_value is a member of a oneof, whose presence is what a reader
  // tests.
  put_tag(v, kSimpleValue, kFixed32);
  put_le(v, value);
  put_description(v, description);
  put_bytes(bytes_, kValue, v);
}

void Summary::add_histogram(std::string_view tag, const Histogram& h,
                            std::string_view description) {
  MOETRAIN_CHECK(h.bucket.size() == h.bucket_limit.size(),
                 "histogram '{}': {} buckets but {} bucket limits", tag, h.bucket.size(),
                 h.bucket_limit.size());
  std::string histo;
  put_double(histo, kMin, h.min);
  put_double(histo, kMax, h.max);
  put_double(histo, kNum, h.num);
  put_double(histo, kSum, h.sum);
  put_double(histo, kSumSquares, h.sum_squares);
  put_packed_doubles(histo, kBucketLimit, h.bucket_limit);
  put_packed_doubles(histo, kBucket, h.bucket);
  std::string v;
  put_bytes(v, kTag, tag);
  put_bytes(v, kHisto, histo);
  put_description(v, description);
  put_bytes(bytes_, kValue, v);
}

std::string encode_file_version_event(double wall_time) {
  std::string e;
  put_double(e, kWallTime, wall_time);
  put_bytes(e, kFileVersion, "brain.Event:2");
  return e;
}

namespace {

std::string event_head(double wall_time, int64_t step) {
  std::string e;
  put_double(e, kWallTime, wall_time);
  put_tag(e, kStep, kVarint);
  put_varint(e, static_cast<uint64_t>(step));  // int64: negatives as 10-byte two's complement
  return e;
}

}  // namespace

std::string encode_summary_event(double wall_time, int64_t step, const Summary& summary) {
  std::string e = event_head(wall_time, step);
  put_bytes(e, kSummary, summary.bytes());
  return e;
}

std::string encode_restart_event(double wall_time, int64_t step) {
  std::string e = event_head(wall_time, step);
  std::string log;
  put_tag(log, kStatus, kVarint);
  put_varint(log, kSessionStart);
  put_bytes(e, kSessionLog, log);
  return e;
}

double wall_time_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

EventFileWriter::EventFileWriter(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  MOETRAIN_CHECK(!ec, "cannot create {}: {}", dir.string(), ec.message());
  const double now = wall_time_now();
  const std::string base =
      "events.out.tfevents." + std::to_string(static_cast<int64_t>(now)) + "." + host_name();
  // "x": never append to another writer's file.
  for (int n = 0; !file_; ++n) {
    path_ = dir / (n == 0 ? base : base + "." + std::to_string(n));
    file_ = std::fopen(path_.c_str(), "wbx");
    MOETRAIN_CHECK(file_ != nullptr || errno == EEXIST, "cannot open {} for writing: {}",
                   path_.string(), std::strerror(errno));
  }
  append(encode_file_version_event(now));
}

EventFileWriter::~EventFileWriter() {
  if (file_) std::fclose(file_);
}

EventFileWriter::EventFileWriter(EventFileWriter&& o) noexcept
    : path_(std::move(o.path_)), file_(std::exchange(o.file_, nullptr)) {}

EventFileWriter& EventFileWriter::operator=(EventFileWriter&& o) noexcept {
  if (this != &o) {
    if (file_) std::fclose(file_);
    path_ = std::move(o.path_);
    file_ = std::exchange(o.file_, nullptr);
  }
  return *this;
}

void EventFileWriter::write(int64_t step, const Summary& summary) {
  if (!file_ || summary.empty()) return;
  append(encode_summary_event(wall_time_now(), step, summary));
}

void EventFileWriter::write_restart(int64_t step) {
  if (file_) append(encode_restart_event(wall_time_now(), step));
}

void EventFileWriter::append(const std::string& event) {
  const std::string record = tfrecord_frame(event);
  append_whole(::fileno(file_), path_, record);
}

}  // namespace moetrain
