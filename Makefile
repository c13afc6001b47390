# The README's commands. Each one installs what it needs, then builds.
BUILD_DIR ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
PREFIX ?= /usr/local
# The Debian package's own build: no CUDA backend (its runtime is in no Debian package), no tests
# or benchmarks (not installed).
DEB_BUILD_DIR ?= build-deb
# The CUDA backend (CMakeLists.txt): AUTO builds it where the toolkit is found. make demo builds it
# only where a GPU is present too (nothing else could run it); make test builds it wherever the
# toolkit is, so that the device code keeps compiling. The backend is a library of its own: when
# one command follows the other, only its objects are compiled, never the rest of the library.
CUDA ?= AUTO
DEMO_CUDA ?= $(if $(wildcard /dev/nvidia0),$(CUDA),OFF)
# A timestamped phase line.
phase = @echo "== [$$(date +%T)] $(1)"

.PHONY: all setup setup-peers setup-tests configure build test demo bench install deb format clean

all: build

setup:
	bash scripts/setup.sh

# PyTorch 2.x in .venv-bench for the peer benchmarks that make bench runs (bench/peers/); make test
# never needs it.
setup-peers:
	bash scripts/setup.sh --peers

configure: setup
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release -DMOETRAIN_WITH_CUDA=$(CUDA) $(CMAKE_FLAGS)

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	bash scripts/setup.sh --tests
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS) --timeout 600

# The first result: the moetrain binary only (tests and benchmarks build with make test and make
# bench), then scripts/demo.sh; each phase prints the time it starts.
demo:
	$(call phase,setup)
	bash scripts/setup.sh
	$(call phase,configure)
	cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=Release -DMOETRAIN_WITH_CUDA=$(DEMO_CUDA) $(CMAKE_FLAGS)
	$(call phase,build moetrain)
	cmake --build $(BUILD_DIR) -j $(JOBS) --target moetrain
	bash scripts/demo.sh $(BUILD_DIR)

bench: build
	cmake --build $(BUILD_DIR) -j $(JOBS) --target benches
	bash scripts/bench.sh $(BUILD_DIR)

# bin/moetrain, share/moetrain/configs, share/doc/moetrain under PREFIX (cmake/install.cmake).
install: build
	cmake --install $(BUILD_DIR) --prefix $(PREFIX)

# $(DEB_BUILD_DIR)/moetrain_VERSION_ARCH.deb; Depends from dpkg-shlibdeps (cmake/install.cmake).
deb: setup
	cmake -S . -B $(DEB_BUILD_DIR) -DCMAKE_BUILD_TYPE=Release -DMOETRAIN_WITH_CUDA=OFF \
	  -DMOETRAIN_BUILD_TESTS=OFF -DMOETRAIN_BUILD_BENCH=OFF $(CMAKE_FLAGS)
	cmake --build $(DEB_BUILD_DIR) -j $(JOBS) --target moetrain
	cd $(DEB_BUILD_DIR) && cpack -G DEB

format:
	find src tests bench \( -name '*.cpp' -o -name '*.h' \) | xargs clang-format -i

clean:
	rm -rf $(BUILD_DIR) $(DEB_BUILD_DIR)
