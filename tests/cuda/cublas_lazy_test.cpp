// cuBLAS and cuBLASLt are loaded by their first call (src/cuda/cublas_lazy.cpp), not at start:
// a program that never calls them never maps them. Runs without a GPU (the calls below are
// host-side: a status string and a matrix layout descriptor).
#include <gtest/gtest.h>

#include <cublasLt.h>
#include <cublas_v2.h>

#include <fstream>
#include <sstream>
#include <string>

namespace {

bool mapped(const std::string& library) {
  std::ifstream maps("/proc/self/maps");
  std::stringstream all;
  all << maps.rdbuf();
  return all.str().find(library) != std::string::npos;
}

TEST(CublasLazy, LibrariesAreMappedByTheirFirstCallOnly) {
  EXPECT_FALSE(mapped("libcublasLt.so")) << "cuBLASLt was loaded at start";
  EXPECT_FALSE(mapped("libcublas.so")) << "cuBLAS was loaded at start";

  // The library's own text ("success" in cuBLAS 13, "CUBLAS_STATUS_SUCCESS" in earlier ones).
  const std::string text = cublasGetStatusString(CUBLAS_STATUS_SUCCESS);
  EXPECT_TRUE(text.find("success") != std::string::npos ||
              text.find("SUCCESS") != std::string::npos)
      << text;
  EXPECT_TRUE(mapped("libcublas.so"));

  cublasLtMatrixLayout_t layout = nullptr;
  const cublasStatus_t st = cublasLtMatrixLayoutCreate(&layout, CUDA_R_32F, 4, 8, 4);
  EXPECT_TRUE(mapped("libcublasLt.so"));
  if (st == CUBLAS_STATUS_SUCCESS)
    EXPECT_EQ(cublasLtMatrixLayoutDestroy(layout), CUBLAS_STATUS_SUCCESS);
}

}  // namespace
