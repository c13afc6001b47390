function(moetrain_warnings target)
  # C++ only: nvcc takes host-compiler warnings through -Xcompiler.
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
endfunction()
