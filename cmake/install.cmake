# Install rules (`cmake --install`, `make install`) and the Debian package (`cpack -G DEB`,
# `make deb`). Included at the end of CMakeLists.txt: it only describes what the build made.
#
#   bin/moetrain                      the program
#   share/moetrain/configs/           configs/*.toml (and configs/plan/*.toml, which `moetrain plan` reads)
#   share/doc/moetrain/               README.md, docs/*.md and docs/*.svg under docs/, so the
#                                     README's links (docs/PERF.md, ...) resolve where installed
#
# The package's Depends are computed by dpkg-shlibdeps from the libraries the installed binary
# links, so they follow CMakeLists.txt without a list kept here. A build with the CUDA backend
# links the CUDA runtime from /usr/local/cuda, which no Debian package provides: `make deb`
# packages a build configured with -DMOETRAIN_WITH_CUDA=OFF, and cpack refuses any other.
include(GNUInstallDirs)

install(TARGETS moetrain RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/configs/
        DESTINATION ${CMAKE_INSTALL_DATADIR}/moetrain/configs
        FILES_MATCHING PATTERN "*.toml")
install(FILES ${PROJECT_SOURCE_DIR}/README.md DESTINATION ${CMAKE_INSTALL_DOCDIR})
file(GLOB moetrain_doc_files CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/docs/*.md
     ${PROJECT_SOURCE_DIR}/docs/*.svg)
install(FILES ${moetrain_doc_files} DESTINATION ${CMAKE_INSTALL_DOCDIR}/docs)

set(CPACK_PACKAGE_NAME moetrain)
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_PACKAGE_CONTACT "moetrain maintainers <maintainers@users.noreply.a-seed-80b23603.example>")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "trains Mixture-of-Experts language models on CPUs")
set(CPACK_DEBIAN_PACKAGE_DESCRIPTION
    "moetrain is a C++20 engine that trains Mixture-of-Experts (MoE) transformer\n\
language models and classifiers without a Python stack: GEMMs through oneDNN,\n\
expert and data parallelism over MPI, a parameter-server mode over ZeroMQ,\n\
checkpoints in Hugging Face Mixtral form. This package is built without the\n\
CUDA backend. Configs are in /usr/share/moetrain/configs; the demo trains on\n\
the text of the fortunes package.")
set(CPACK_DEBIAN_PACKAGE_MAINTAINER "${CPACK_PACKAGE_CONTACT}")
set(CPACK_DEBIAN_PACKAGE_SECTION science)
set(CPACK_DEBIAN_PACKAGE_PRIORITY optional)
set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
# fortunes: the demo corpus (configs/demo.toml); openmpi-bin: mpirun, which multi-process
# training and `moetrain launch` start (a single process needs only the library, a Depends).
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "fortunes, openmpi-bin")
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)  # moetrain_VERSION_ARCH.deb
set(CPACK_STRIP_FILES ON)
set(CPACK_PACKAGE_DIRECTORY ${PROJECT_BINARY_DIR})
# cpack reads cmake/cpack_options.cmake with the CPACK_ variables above; it refuses a Debian
# package of a build with the CUDA backend.
set(CPACK_MOETRAIN_CUDA ${moetrain_cuda})
set(CPACK_PROJECT_CONFIG_FILE ${PROJECT_SOURCE_DIR}/cmake/cpack_options.cmake)
include(CPack)
