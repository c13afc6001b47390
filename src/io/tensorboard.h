// TensorBoard event files, written without TensorFlow or a protobuf library.
//
// An event file is a sequence of TFRecords: uint64 length (little-endian), masked CRC-32C of those
// 8 bytes, the data, masked CRC-32C of the data. Each record holds one serialized tensorflow.Event;
// the first carries file_version "brain.Event:2", the others wall_time, step and a Summary of
// scalar values (simple_value, a float) and histograms (HistogramProto), each with an optional
// description (SummaryMetadata.summary_description). The few messages and
// fields involved are encoded by hand (varints, fixed64 doubles, fixed32 floats, length-delimited
// and packed fields, with tensorflow's field numbers): that is shorter than a .proto, its
// generated code and a dependency on libprotobuf, and it cannot drift from what is written here.
//
// Every record is written whole with one fwrite and flushed, so a crash leaves the complete
// records before it readable (a reader stops at a torn last one). A failed write is an Error
// naming the file.
#pragma once
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace moetrain {

// The directory of a run's event files.
inline constexpr const char* kTensorboardDir = "tb";

// TFRecord's checksum of `n` bytes: CRC-32C rotated right by 15 and offset by 0xa282ead8 (so that
// a CRC over data that embeds CRCs stays meaningful).
uint32_t masked_crc32c(const void* data, std::size_t n);

// `data` framed as one TFRecord.
std::string tfrecord_frame(std::string_view data);

// The records of a TFRecord file whose checksums hold, in order, up to the first incomplete one
// (a torn tail from a crash ends the list quietly). A record whose checksum is wrong is an Error
// naming the file and the offset.
std::vector<std::string> read_tfrecords(const std::filesystem::path& path);

// A histogram as TensorBoard's HistogramProto holds it: bucket i counts the values in
// [bucket_limit[i-1], bucket_limit[i]) (from min for i = 0); min, max, num, sum and sum_squares
// describe the values themselves.
struct Histogram {
  double min = 0, max = 0, num = 0, sum = 0, sum_squares = 0;
  std::vector<double> bucket_limit;  // (buckets) right edges, increasing
  std::vector<double> bucket;        // (buckets) counts
};

// The values of one Event's Summary, encoded as they are added. A non-empty `description` goes
// into the value's SummaryMetadata (summary_description), which TensorBoard shows beside the
// tag's chart; it keeps the first one it reads for a tag, so once per tag and file is enough.
class Summary {
 public:
  void add_scalar(std::string_view tag, float value, std::string_view description = {});
  void add_histogram(std::string_view tag, const Histogram& h, std::string_view description = {});
  bool empty() const { return bytes_.empty(); }
  // The serialized tensorflow.Summary message.
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

// Serialized tensorflow.Event messages.
std::string encode_file_version_event(double wall_time);
std::string encode_summary_event(double wall_time, int64_t step, const Summary& summary);
// SessionLog START at `step`: what TensorFlow writes when a run restarts from a checkpoint.
std::string encode_restart_event(double wall_time, int64_t step);

// Seconds since the epoch, as TensorBoard's wall_time.
double wall_time_now();

// One event file: a new RUN_DIR/tb/events.out.tfevents.<time>.<host> (".<n>" appended when a
// file of that name exists already: a resumption within the same second), starting with the
// file-version event. Default-constructed: writes nothing.
class EventFileWriter {
 public:
  EventFileWriter() = default;
  explicit EventFileWriter(const std::filesystem::path& dir);
  ~EventFileWriter();
  EventFileWriter(EventFileWriter&&) noexcept;
  EventFileWriter& operator=(EventFileWriter&&) noexcept;

  bool active() const { return file_ != nullptr; }
  const std::filesystem::path& path() const { return path_; }
  // One event at `step` holding `summary` (nothing when it is empty); appended and flushed.
  void write(int64_t step, const Summary& summary);
  // Marks a restart: TensorBoard's readers drop the events of step ≥ `step` read before this
  // one (an earlier file's, from the run a resumption replaces).
  void write_restart(int64_t step);

 private:
  void append(const std::string& event);

  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
};

}  // namespace moetrain
