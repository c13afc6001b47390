// CRC-32C (Castagnoli, the iSCSI / ext4 / RocksDB checksum): reflected polynomial 0x82F63B78,
// initial value and final xor 0xFFFFFFFF. Checkpoint pieces are checksummed with it because x86
// computes it in hardware (SSE4.2 `crc32`, 8 bytes per instruction, three independent streams
// on long inputs); without SSE4.2 a slice-by-8 table gives the same values.
#pragma once
#include <cstddef>
#include <cstdint>

namespace moetrain {

// The CRC-32C of `n` bytes continued from `crc` (the value returned for the bytes before them;
// 0 to start): crc32c(b, crc32c(a)) == crc32c(a ++ b).
uint32_t crc32c(const void* data, std::size_t n, uint32_t crc = 0);

// The two implementations behind crc32c(), for tests and benchmarks.
uint32_t crc32c_table(const void* data, std::size_t n, uint32_t crc = 0);
// Only when crc32c_hardware_available().
uint32_t crc32c_hardware(const void* data, std::size_t n, uint32_t crc = 0);
bool crc32c_hardware_available();

}  // namespace moetrain
