// Test support (tests/cuda): device buffers to and from host vectors, a NaN fill for outputs a
// kernel must overwrite, and a bitwise comparison that names the first differing element.
#pragma once
#include <gtest/gtest.h>

#include <bit>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "cuda/device.h"

namespace moetrain::testing {

template <class T>
cuda::DeviceBuffer<T> to_device(const std::vector<T>& v) {
  cuda::DeviceBuffer<T> d(static_cast<int64_t>(v.size()));
  d.upload(v.data(), d.size());
  return d;
}

template <class T>
std::vector<T> to_host(const cuda::DeviceBuffer<T>& d) {
  std::vector<T> v(static_cast<std::size_t>(d.size()));
  d.download(v.data(), d.size());
  return v;
}

// DeviceBuffer::upload copies on the legacy default stream; a test that launches on a stream of
// its own waits for the device between uploading and launching.
inline void uploads_done() {
  MOETRAIN_CUDA_CHECK(cudaDeviceSynchronize());
}

// All-ones bytes (a NaN) in an output the kernel must overwrite, queued on the kernel's stream.
inline void poison(cuda::DeviceBuffer<float>& d, cudaStream_t s) {
  if (d.size() > 0)
    MOETRAIN_CUDA_CHECK(cudaMemsetAsync(d.data(), 0xff, sizeof(float) * d.size(), s));
}

// Every element bitwise equal; reports the first that is not.
inline void expect_same_bits(std::span<const float> got, std::span<const float> want,
                             const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i])) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << " on the device, "
                    << want[i] << " on the CPU";
      return;
    }
  }
}

}  // namespace moetrain::testing
