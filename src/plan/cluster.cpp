#include "plan/cluster.h"

#include <fmt/format.h>

#include <toml++/toml.h>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>

#include "core/check.h"
#include "io/file.h"

namespace moetrain::plan {

namespace {

// Bounds of the whole-number keys: far above any machine, and their product (the devices) far
// below int64's range.
constexpr int64_t kMaxDevicesPerNode = 1 << 16, kMaxNodes = 1 << 24, kMaxThreads = 1 << 16;

toml::table parse_toml(const std::string& path, const char* what) {
  MOETRAIN_CHECK(!std::filesystem::is_directory(path),
                 "{} file '{}' is a directory, not a TOML file", what, path);
  MOETRAIN_CHECK(std::filesystem::is_regular_file(path), "{} file '{}' does not exist", what, path);
  try {
    return toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    MOETRAIN_FAIL("{} file {}:{}:{}: TOML syntax error: {}", what, path, e.source().begin.line,
                  e.source().begin.column, e.description());
  }
}

// A number's value as a double. toml++ gives no double for an integer beyond 2^53 (it would
// round), so an integer is converted here: its range checks then see it, not "not a number".
std::optional<double> number(const toml::node& node) {
  if (const auto* i = node.as_integer()) return static_cast<double>(i->get());
  return node.value<double>();
}

// A required positive number: missing, not a number or ≤ 0 is an error naming the key.
double positive(const toml::table& t, const std::string& section, const char* key,
                const std::string& where) {
  const auto* node = t[section][key].node();
  MOETRAIN_CHECK(node != nullptr, "{}: {}.{} is missing (a positive number)", where, section, key);
  const auto v = number(*node);
  MOETRAIN_CHECK(v.has_value(), "{}: {}.{} must be a number", where, section, key);
  MOETRAIN_CHECK(std::isfinite(*v) && *v > 0, "{}: {}.{} = {}: must be positive", where, section,
                 key, *v);
  return *v;
}

double optional(const toml::table& t, const std::string& section, const char* key, double dflt,
                const std::string& where) {
  const auto* node = t[section][key].node();
  if (node == nullptr) return dflt;
  const auto v = number(*node);
  MOETRAIN_CHECK(v.has_value() && std::isfinite(*v) && *v >= 0, "{}: {}.{} must be a number ≥ 0",
                 where, section, key);
  return *v;
}

// A whole number in [1, max]: checked as a double before it becomes an integer, so a value
// beyond int64 (1e30) is refused, not converted (undefined behaviour).
int64_t positive_int(const toml::table& t, const std::string& section, const char* key,
                     const std::string& where, int64_t max) {
  const auto* node = t[section][key].node();
  MOETRAIN_CHECK(node != nullptr, "{}: {}.{} is missing (a whole number in [1, {}])", where,
                 section, key, max);
  if (const auto* i = node->as_integer()) {  // exact: 2^63 - 1 is named as written
    MOETRAIN_CHECK(i->get() >= 1 && i->get() <= max,
                   "{}: {}.{} = {}: must be a whole number in [1, {}]", where, section, key,
                   i->get(), max);
    return i->get();
  }
  const auto v = node->value<double>();
  MOETRAIN_CHECK(v.has_value(), "{}: {}.{} must be a whole number in [1, {}]", where, section, key,
                 max);
  MOETRAIN_CHECK(std::isfinite(*v) && *v >= 1 && *v <= static_cast<double>(max) &&
                     *v == std::floor(*v),
                 "{}: {}.{} = {}: must be a whole number in [1, {}]", where, section, key, *v, max);
  return static_cast<int64_t>(*v);
}

// A list of positive numbers (a measured table); empty when the key is absent.
std::vector<double> positive_list(const toml::table& t, const std::string& sec, const char* key,
                                  const std::string& where, bool zero_allowed = false) {
  std::vector<double> out;
  const auto* node = t[sec][key].node();
  if (node == nullptr) return out;
  const auto* arr = node->as_array();
  MOETRAIN_CHECK(arr != nullptr, "{}: {}.{} must be a list of numbers", where, sec, key);
  for (const auto& v : *arr) {
    const auto x = v.value<double>();
    MOETRAIN_CHECK(x.has_value() && std::isfinite(*x) && (*x > 0 || (zero_allowed && *x == 0)),
                   "{}: {}.{} must hold {} numbers", where, sec, key,
                   zero_allowed ? "non-negative" : "positive");
    out.push_back(*x);
  }
  return out;
}

void read_table(const toml::table& t, const std::string& sec, const char* dims_key,
                const char* rates_key, std::vector<double>& dims, std::vector<double>& rates,
                const std::string& where) {
  dims = positive_list(t, sec, dims_key, where);
  rates = positive_list(t, sec, rates_key, where);
  MOETRAIN_CHECK(dims.size() == rates.size(), "{}: device.{} and device.{} differ in length", where,
                 dims_key, rates_key);
  for (std::size_t i = 1; i < dims.size(); ++i)
    MOETRAIN_CHECK(dims[i] > dims[i - 1], "{}: device.{} must ascend", where, dims_key);
}

std::string list(const std::vector<double>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) s += fmt::format("{}{:.6e}", i ? ", " : "", v[i]);
  return s + "]";
}

// [device] kernels_<kind> = [[shape..., seconds], ...] (plan/kernel_table.h): every row the
// kind's columns and a time, all positive.
KernelTable read_kernels(const toml::table& t, const std::string& sec, const std::string& where) {
  KernelTable k;
  for (const std::string& kind : kernel_kinds()) {
    const std::string key = "kernels_" + kind;
    const auto* node = t[sec][key].node();
    if (node == nullptr) continue;
    const auto* arr = node->as_array();
    MOETRAIN_CHECK(arr != nullptr, "{}: {}.{} must be a list of rows [shape..., seconds]", where,
                   sec, key);
    for (const auto& row : *arr) {
      const auto* r = row.as_array();
      MOETRAIN_CHECK(r != nullptr && r->size() == kernel_columns(kind) + 1,
                     "{}: {}.{}: each row must hold {} numbers ({} shape columns, seconds)", where,
                     sec, key, kernel_columns(kind) + 1, kernel_columns(kind));
      std::vector<double> v;
      for (const auto& x : *r) {
        const auto d = x.value<double>();
        MOETRAIN_CHECK(d.has_value() && std::isfinite(*d) && *d > 0,
                       "{}: {}.{} must hold positive numbers", where, sec, key);
        v.push_back(*d);
      }
      const double seconds = v.back();
      v.pop_back();
      k.add(kind, v, seconds);
    }
  }
  return k;
}

DeviceModel device_from_table(const toml::table& t, const std::string& where,
                              const std::string& sec = "device") {
  DeviceModel d;
  d.name = t[sec]["name"].value_or(std::string("custom"));
  d.peak_flops_f32 = positive(t, sec, "peak_flops_f32", where);
  d.peak_flops_bf16 = optional(t, sec, "peak_flops_bf16", 0, where);
  d.gemm_max_efficiency = optional(t, sec, "gemm_max_efficiency", 1, where);
  MOETRAIN_CHECK(d.gemm_max_efficiency > 0 && d.gemm_max_efficiency <= 1,
                 "{}: device.gemm_max_efficiency = {}: must be in (0, 1]", where,
                 d.gemm_max_efficiency);
  d.memory_bytes = positive(t, sec, "memory_bytes", where);
  d.memory_bandwidth = positive(t, sec, "memory_bandwidth", where);
  d.norm_bandwidth = optional(t, sec, "norm_bandwidth", 0, where);
  d.gemm_small_dim = optional(t, sec, "gemm_small_dim", 0, where);
  d.gemm_call_s = optional(t, sec, "gemm_call_s", 0, where);
  d.comm_compute_share = optional(t, sec, "comm_compute_share", 0, where);
  MOETRAIN_CHECK(d.comm_compute_share >= 0 && d.comm_compute_share < 1,
                 "{}: {}.comm_compute_share = {}: must be in [0, 1)", where, sec,
                 d.comm_compute_share);
  d.attention_flops = optional(t, sec, "attention_flops", 0, where);
  const double threads = optional(t, sec, "threads", 0, where);
  MOETRAIN_CHECK(threads <= kMaxThreads && threads == std::floor(threads),
                 "{}: {}.threads = {}: must be a whole number in [0, {}] (0 = not a calibrated CPU)",
                 where, sec, threads, kMaxThreads);
  d.threads = static_cast<int64_t>(threads);
  read_table(t, sec, "gemm_f32_dims", "gemm_f32_flops", d.gemm_f32_dims, d.gemm_f32_flops, where);
  read_table(t, sec, "gemm_bf16_dims", "gemm_bf16_flops", d.gemm_bf16_dims, d.gemm_bf16_flops,
             where);
  d.kernels = read_kernels(t, sec, where);
  return d;
}

}  // namespace

// Datasheet peaks (dense, no sparsity). f32 is the plain FP32 rate: the trainer's f32 GEMMs do
// not use TF32. The GEMM curve is the same for both and set from the datasheet, not fitted:
//  - gemm_max_efficiency 0.8: large cuBLAS bf16 GEMMs reach about 80% of the tensor-core peak
//    on both parts (clock throttling and tile quantisation take the rest);
//  - gemm_small_dim = peak_bf16 / memory_bandwidth, the roofline ridge in FLOP per byte. A bf16
//    GEMM whose smallest side is d does about d FLOPs per byte of the larger operand it streams,
//    so at d below the ridge it is memory bound; d / (d + ridge) joins the two regimes.
//  - gemm_call_s 5 µs: one kernel launch.
//  - comm_compute_share: 20 streaming multiprocessors of the part's (132 on an H100 SXM, 108 on
//    an A100) for an exchange or reduction that runs beside compute, the number DeepSeek-V3's
//    report gives for its all-to-all kernels to fill both NVLink and InfiniBand.
DeviceModel builtin_device(const std::string& name) {
  DeviceModel d;
  d.name = name;
  d.gemm_max_efficiency = 0.8;
  d.gemm_call_s = 5e-6;
  // Memory as the driver reports it (NVML's total, what nvidia-smi prints): an "80 GB" part
  // holds 81920 MiB (A100) or 81559 MiB (H100), not 80·10⁹ bytes.
  if (name == "a100") {  // A100 SXM 80 GB
    d.peak_flops_f32 = 19.5e12;
    d.peak_flops_bf16 = 312e12;
    d.memory_bytes = 81920.0 * 1048576;
    d.memory_bandwidth = 2.039e12;
    d.comm_compute_share = 20.0 / 108;
  } else if (name == "h100") {  // H100 SXM 80 GB
    d.peak_flops_f32 = 67e12;
    d.peak_flops_bf16 = 989e12;
    d.memory_bytes = 81559.0 * 1048576;
    d.memory_bandwidth = 3.35e12;
    d.comm_compute_share = 20.0 / 132;
  } else {
    MOETRAIN_CHECK(name != "cpu",
                   "device 'cpu' has no built-in figures: measure this machine with `moetrain "
                   "plan --calibrate --out PROFILE.toml` and pass --profile PROFILE.toml");
    MOETRAIN_CHECK(false, "device '{}': allowed are a100, h100, cpu (with --profile)", name);
  }
  d.gemm_small_dim = d.peak_flops_bf16 / d.memory_bandwidth;
  return d;
}

DeviceModel load_profile(const std::string& path) {
  const auto t = parse_toml(path, "profile");
  return device_from_table(t, "profile " + path);
}

namespace {

std::string device_section(const DeviceModel& d, const char* sec) {
  std::string s = fmt::format("[{}]\n", sec);
  s += fmt::format("name = \"{}\"\n", d.name);
  s += fmt::format("peak_flops_f32 = {:.6e}\n", d.peak_flops_f32);
  s += fmt::format("peak_flops_bf16 = {:.6e}\n", d.peak_flops_bf16);
  s += fmt::format("gemm_max_efficiency = {}\n", d.gemm_max_efficiency);
  s += fmt::format("memory_bytes = {:.6e}\n", d.memory_bytes);
  s += fmt::format("memory_bandwidth = {:.6e}\n", d.memory_bandwidth);
  s += fmt::format("norm_bandwidth = {:.6e}\n", d.norm_bandwidth);
  s += fmt::format("gemm_small_dim = {:.6g}\n", d.gemm_small_dim);
  s += fmt::format("gemm_call_s = {:.6e}\n", d.gemm_call_s);
  s += fmt::format("comm_compute_share = {:.6g}\n", d.comm_compute_share);
  s += fmt::format("attention_flops = {:.6e}\n", d.attention_flops);
  s += fmt::format("threads = {}\n", d.threads);
  s += "# GEMM FLOP/s measured by the smallest side of the shape\n";
  s += fmt::format("gemm_f32_dims = {}\ngemm_f32_flops = {}\n", list(d.gemm_f32_dims),
                   list(d.gemm_f32_flops));
  if (!d.gemm_bf16_dims.empty())
    s += fmt::format("gemm_bf16_dims = {}\ngemm_bf16_flops = {}\n", list(d.gemm_bf16_dims),
                     list(d.gemm_bf16_flops));
  if (!d.kernels.empty())
    s += "# kernels at the calibrated config's shapes: [shape..., seconds of forward + backward]\n";
  for (const auto& [kind, rows] : d.kernels.rows) {
    s += fmt::format("kernels_{} = [", kind);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      s += i ? ", [" : "[";
      for (std::size_t j = 0; j < rows[i].size(); ++j)
        s += j + 1 < rows[i].size() ? fmt::format("{}, ", rows[i][j])
                                    : fmt::format("{:.6e}]", rows[i][j]);
    }
    s += "]\n";
  }
  return s;
}

// [cluster] compute_share_p{procs} = [[ratio, share], ...] (ratios ascending, shares in
// (0, 1]); empty lists where the profile has none for that process count.
std::pair<std::vector<double>, std::vector<double>> share_table(const toml::table& t,
                                                                int64_t procs,
                                                                const std::string& where) {
  std::pair<std::vector<double>, std::vector<double>> out;
  const std::string key = fmt::format("compute_share_p{}", procs);
  const auto* node = t["cluster"][key].node();
  if (node == nullptr) return out;
  const auto* arr = node->as_array();
  MOETRAIN_CHECK(arr != nullptr, "{}: cluster.{} must be a list of [ratio, share]", where, key);
  for (const auto& row : *arr) {
    const auto* r = row.as_array();
    MOETRAIN_CHECK(r != nullptr && r->size() == 2, "{}: cluster.{}: each row is [ratio, share]",
                   where, key);
    const auto ratio = (*r)[0].value<double>();
    const auto share = (*r)[1].value<double>();
    MOETRAIN_CHECK(ratio && share && std::isfinite(*ratio) && *ratio > 0 && std::isfinite(*share) &&
                       *share > 0,
                   "{}: cluster.{} must hold positive numbers", where, key);
    MOETRAIN_CHECK(out.first.empty() || *ratio > out.first.back(),
                   "{}: cluster.{}: the ratios must ascend", where, key);
    out.first.push_back(*ratio);
    out.second.push_back(std::min(1.0, *share));  // above 1 is noise: no process outruns a core
  }
  return out;
}

}  // namespace

void save_profile(const DeviceModel& d, const DeviceModel& single, double intra_bandwidth,
                  double intra_latency, const std::vector<CommFigures>& comm,
                  const std::string& path) {
  std::string s =
      "# Written by `moetrain plan --calibrate`: this machine, measured with every\n"
      "# thread ([device]) and with one ([single_thread]).\n";
  s += device_section(d, "device") + "\n" + device_section(single, "single_thread");
  s += "\n[cluster]\n";
  s += fmt::format("intra_node_bandwidth = {:.6e}\n", intra_bandwidth);
  s += fmt::format("intra_node_latency = {:.6e}\n", intra_latency);
  if (!comm.empty()) {
    std::vector<double> procs, lat, a2a, ar, late, bound, self;
    for (const CommFigures& f : comm) {
      procs.push_back(static_cast<double>(f.procs));
      lat.push_back(f.latency);
      a2a.push_back(f.alltoall_bandwidth);
      ar.push_back(f.allreduce_bandwidth);
      late.push_back(f.late_penalty);
      bound.push_back(f.receiver_bound);
      self.push_back(f.self_reduce_bandwidth);
    }
    s += "# collectives measured under MPI with comm_procs processes (plan/calibrate_comm.h)\n";
    s += fmt::format("comm_procs = {}\ncomm_latency = {}\ncomm_alltoall_bandwidth = {}\n"
                     "comm_allreduce_bandwidth = {}\ncomm_late_penalty = {}\n"
                     "comm_alltoall_receiver_bound = {}\ncomm_self_reduce_bandwidth = {}\n",
                     list(procs), list(lat), list(a2a), list(ar), list(late), list(bound),
                     list(self));
    // The compute share of oversubscribed processes, per process count where measured:
    // [[ratio of compute to communication, share], ...].
    for (const CommFigures& f : comm) {
      if (f.share.empty()) continue;
      s += fmt::format("compute_share_p{} = [", f.procs);
      for (std::size_t i = 0; i < f.share.size(); ++i)
        s += fmt::format("{}[{:.6e}, {:.6e}]", i ? ", " : "", f.share_ratio[i], f.share[i]);
      s += "]\n";
    }
  }
  write_file_atomic(path, s);
}

ClusterSpec load_cluster(const std::string& path, const std::string& profile) {
  const auto t = parse_toml(path, "cluster");
  const std::string where = "cluster " + path;
  ClusterSpec c;
  const std::string dev = t["cluster"]["device"].value_or(std::string());
  if (t["device"].is_table()) {
    c.device = device_from_table(t, where);
  } else if (dev == "cpu" || dev.empty()) {
    MOETRAIN_CHECK(!profile.empty(),
                   "{}: cluster.device is {} and there is no [device] table: name a100 or h100, "
                   "or pass --profile PROFILE.toml (moetrain plan --calibrate)",
                   where, dev.empty() ? "missing" : "'cpu'");
    c.device = load_profile(profile);
  } else {
    c.device = builtin_device(dev);
  }
  c.devices_per_node = positive_int(t, "cluster", "devices_per_node", where, kMaxDevicesPerNode);
  c.nodes = positive_int(t, "cluster", "nodes", where, kMaxNodes);
  c.intra_node_bandwidth = positive(t, "cluster", "intra_node_bandwidth", where);
  c.disk_bandwidth = optional(t, "cluster", "disk_bandwidth", 0, where);
  c.inter_node_bandwidth = positive(t, "cluster", "inter_node_bandwidth", where);
  c.intra_node_latency = positive(t, "cluster", "intra_node_latency", where);
  c.inter_node_latency = positive(t, "cluster", "inter_node_latency", where);
  c.spine_bandwidth = optional(t, "cluster", "spine_bandwidth", 0, where);
  c.disk_bandwidth = optional(t, "cluster", "disk_bandwidth", 0, where);
  validate(c, where);
  return c;
}

ClusterSpec local_cluster(const std::string& profile, int64_t procs, int64_t threads) {
  MOETRAIN_CHECK(procs >= 1, "--procs {}: must be ≥ 1", procs);
  MOETRAIN_CHECK(threads >= 0, "--threads {}: must be ≥ 0 (0 = cores / processes)", threads);
  const auto t = parse_toml(profile, "profile");
  const std::string where = "profile " + profile;
  ClusterSpec c;
  c.device = device_from_table(t, where);
  MOETRAIN_CHECK(c.device.threads > 0, "{}: device.threads is missing (a positive number)", where);
  // Processes split the cores (train.threads = 0 gives each cores / processes threads): each
  // process is a device with the rates measured at its thread count — all threads, or one —
  // and in between the one-thread rates times its threads (threads rarely scale better).
  // Oversubscribed (processes × threads > cores), a process gets its fair share of the cores,
  // cores / processes, whatever its thread count: more threads than cores add no speed.
  // Memory is shared too.
  const int64_t cores = c.device.threads;
  const int64_t asked = threads > 0 ? threads : std::max<int64_t>(1, cores / procs);
  // Cores' worth of one-thread speed this process gets (below 1 when processes outnumber cores).
  const double mine =
      std::min(static_cast<double>(asked), static_cast<double>(cores) / static_cast<double>(procs));
  // One-thread processes that outnumber the cores, where the calibration measured that many:
  // the device is one process computing alone (a core), and the cost model gives its compute
  // the measured share of it (how much of their compute the processes overlap with each
  // other's communication depends on the transport and on the step, which only the cost model
  // knows). Other thread counts get the fair share, cores / processes.
  auto shares = share_table(t, procs, where);
  const bool measured_share = asked == 1 && procs > cores && !shares.first.empty();
  double share = 1;
  if (mine < static_cast<double>(cores)) {
    MOETRAIN_CHECK(t["single_thread"].is_table(),
                   "{}: [single_thread] is missing (calibrate again with this version)", where);
    c.device = device_from_table(t, where, "single_thread");
    share = measured_share ? 1.0 : mine;
  }
  if (measured_share) {
    // The fair share is the floor: processes that all compute at once get cores / processes
    // each. A reading below it (a fast exchange between short computations) is the exchange
    // taking longer in the loop than on time, because its peers must be scheduled to progress
    // it — communication, which the collectives measured with as many processes already carry.
    c.compute_share_ratio = shares.first;
    for (double& v : shares.second) v = std::max(v, mine);
    c.compute_share = shares.second;
  }
  c.device.peak_flops_f32 *= share;
  c.device.peak_flops_bf16 *= share;
  c.device.attention_flops *= share;
  c.device.memory_bandwidth *= share;
  c.device.norm_bandwidth *= share;
  for (auto* rates : {&c.device.gemm_f32_flops, &c.device.gemm_bf16_flops})
    for (double& r : *rates) r *= share;
  c.device.kernels.scale_time(1 / share);
  c.device.memory_bytes /= static_cast<double>(procs);
  c.devices_per_node = procs;
  c.nodes = 1;
  c.intra_node_bandwidth = positive(t, "cluster", "intra_node_bandwidth", where);
  c.intra_node_latency = positive(t, "cluster", "intra_node_latency", where);
  // The collectives measured with the process count nearest this run's (more on a tie): they
  // are what the transport does here; the copy-rate figures above are the fallback.
  const auto procs_list = positive_list(t, "cluster", "comm_procs", where);
  if (!procs_list.empty()) {
    const auto lat = positive_list(t, "cluster", "comm_latency", where);
    const auto a2a = positive_list(t, "cluster", "comm_alltoall_bandwidth", where);
    const auto ar = positive_list(t, "cluster", "comm_allreduce_bandwidth", where);
    auto late = positive_list(t, "cluster", "comm_late_penalty", where, true);
    if (late.empty()) late.assign(procs_list.size(), 0.0);
    auto bound = positive_list(t, "cluster", "comm_alltoall_receiver_bound", where, true);
    if (bound.empty()) bound.assign(procs_list.size(), 1.0);  // profiles from before it
    auto self = positive_list(t, "cluster", "comm_self_reduce_bandwidth", where, true);
    if (self.empty()) self.assign(procs_list.size(), 0.0);
    MOETRAIN_CHECK(lat.size() == procs_list.size() && a2a.size() == procs_list.size() &&
                       ar.size() == procs_list.size() && late.size() == procs_list.size() &&
                       bound.size() == procs_list.size() && self.size() == procs_list.size(),
                   "{}: cluster.comm_procs, comm_latency, comm_alltoall_bandwidth, "
                   "comm_allreduce_bandwidth, comm_late_penalty, comm_alltoall_receiver_bound "
                   "and comm_self_reduce_bandwidth must have the same length",
                   where);
    for (double b : bound)
      MOETRAIN_CHECK(b <= 1, "{}: cluster.comm_alltoall_receiver_bound must hold numbers in "
                     "[0, 1]", where);
    std::size_t best = 0;
    for (std::size_t i = 1; i < procs_list.size(); ++i) {
      const double d = std::fabs(procs_list[i] - static_cast<double>(procs));
      const double b = std::fabs(procs_list[best] - static_cast<double>(procs));
      if (d < b || (d == b && procs_list[i] > procs_list[best])) best = i;
    }
    c.intra_node_latency = lat[best];
    c.intra_node_bandwidth = a2a[best];
    c.intra_node_allreduce_bandwidth = ar[best];
    c.late_penalty = late[best];
    c.a2a_receiver_bound = bound[best];
    c.self_reduce_bandwidth = self[best];
  }
  c.inter_node_bandwidth = c.intra_node_bandwidth;  // one node: never used
  c.inter_node_latency = c.intra_node_latency;
  // Processes whose threads fill the cores leave no core to a communication thread.
  c.comm_shares_cores = procs > 1 && static_cast<double>(procs) * mine >= static_cast<double>(cores);
  c.shared_cores = cores;
  validate(c, where);
  return c;
}

void validate(const ClusterSpec& c, const std::string& where) {
  const DeviceModel& d = c.device;
  MOETRAIN_CHECK(d.peak_flops_f32 > 0, "{}: device.peak_flops_f32 must be positive", where);
  MOETRAIN_CHECK(d.memory_bandwidth > 0, "{}: device.memory_bandwidth must be positive", where);
  MOETRAIN_CHECK(d.memory_bytes > 0, "{}: device.memory_bytes must be positive", where);
  MOETRAIN_CHECK(c.devices_per_node > 0 && c.nodes > 0,
                 "{}: cluster.devices_per_node and cluster.nodes must be positive", where);
  MOETRAIN_CHECK(c.intra_node_bandwidth > 0 && c.inter_node_bandwidth > 0,
                 "{}: cluster.intra_node_bandwidth and inter_node_bandwidth must be positive",
                 where);
}

double compute_share(const ClusterSpec& c, double ratio) {
  const auto& r = c.compute_share_ratio;
  const auto& v = c.compute_share;
  if (v.empty()) return 1;
  if (!(ratio > r.front())) return v.front();
  if (ratio >= r.back()) return v.back();
  const std::size_t i =
      static_cast<std::size_t>(std::upper_bound(r.begin(), r.end(), ratio) - r.begin());
  const double w = std::log(ratio / r[i - 1]) / std::log(r[i] / r[i - 1]);
  return v[i - 1] + w * (v[i] - v[i - 1]);
}

}  // namespace moetrain::plan
