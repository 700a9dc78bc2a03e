# The two README commands:
#   make run   installs the Debian packages, builds, and serves the bundled model over the OpenAI API
#              (prints a curl line to try it, then blocks serving; Ctrl-C drains and exits)
#   make test  installs, builds and runs every CPU test (unit, oracle, plan, bad input, the CUDA op
#              bodies and kernels on the host emulator; bad input, plan files and the validator also
#              under ASan/UBSan; the plan protocol under ThreadSanitizer)
# GPU tests (CTest label `gpu`) run on the GPU machine only: `make test-gpu`.

BUILD ?= build
ASAN_BUILD ?= build-asan
TSAN_BUILD ?= build-tsan
JOBS ?= $(shell nproc)
# The model `make run` serves: the bundled K3-architecture code model (models/plow-k3-code-small/README.md).
MODEL ?= models/plow-k3-code-small
HOST ?= 127.0.0.1
PORT ?= 8000
CMAKE_FLAGS ?=

.PHONY: setup build run test test-asan test-tsan test-gpu test-multigpu clean

setup:
	@bash scripts/setup.sh

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

run: build
	$(BUILD)/bin/plow inspect --model $(MODEL) > /dev/null
	@echo "plow: serving $(MODEL) on http://$(HOST):$(PORT) (Ctrl-C to stop). Try, from another terminal:"
	@echo "  curl -s http://$(HOST):$(PORT)/v1/completions -H 'Content-Type: application/json' -d '{\"prompt\": \"def fibonacci(n):\", \"max_tokens\": 48}'"
	$(BUILD)/bin/plow serve --model $(MODEL) --host $(HOST) --port $(PORT)

test: build
	cmake --build $(BUILD) -j $(JOBS) --target emu_tests
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS) -LE gpu
	$(MAKE) test-asan
	$(MAKE) test-tsan

# Load-time validation and bad input under AddressSanitizer + UndefinedBehaviorSanitizer.
test-asan: setup
	cmake -S . -B $(ASAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Debug -DPLOW_SANITIZE=ON
	cmake --build $(ASAN_BUILD) -j $(JOBS) --target unit_tests cli_tests plan_unit_tests plan_cli_tests tokenizer_tests chat_template_tests scheduler_tests plow
	cd $(ASAN_BUILD) && ctest --output-on-failure -j $(JOBS) -L unit

# The plan interpreter's counter protocol under ThreadSanitizer: stress (random delays, 200 steps),
# batches and kernel errors; any race report fails the run.
test-tsan: setup
	cmake -S . -B $(TSAN_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPLOW_TSAN=ON
	cmake --build $(TSAN_BUILD) -j $(JOBS) --target plan_tests
	cd $(TSAN_BUILD) && TSAN_OPTIONS=halt_on_error=1 ctest --output-on-failure -j $(JOBS) -L plan -R 'Stress|PlanBatch'

test-gpu: build
	cd $(BUILD) && ctest --output-on-failure -L gpu -LE multigpu

# Tensor parallelism over NCCL: needs two or more GPUs (fails on fewer).
test-multigpu: build
	cd $(BUILD) && ctest --output-on-failure -L multigpu

clean:
	rm -rf $(BUILD) $(ASAN_BUILD) $(TSAN_BUILD)
