# Read by cpack (CPACK_PROJECT_CONFIG_FILE, cmake/install.cmake) once per generator.
# A build with the CUDA backend links the CUDA runtime from the toolkit (/usr/local/cuda), which no
# Debian package provides: its package would not install on a machine without the toolkit.
if(CPACK_GENERATOR STREQUAL "DEB" AND CPACK_MOETRAIN_CUDA)
  message(FATAL_ERROR "this build has the CUDA backend (its binary links the CUDA runtime, which "
          "no Debian package provides); package a build configured with "
          "-DMOETRAIN_WITH_CUDA=OFF: `make deb` does")
endif()
