function(moetrain_warnings target)
  # No contraction of a·b + c into an FMA, also in a build for a newer instruction set
  # (-march=native): results must not depend on the CPU (bitwise resume across machines, the GPU
  # kernels held to the CPU's bits).
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-ffp-contract=off>)
  # C++ only: nvcc takes host-compiler warnings through -Xcompiler.
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
endfunction()
