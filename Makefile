# Vesta: two commands do everything on a fresh machine.
#   make run    build and start vestad on the embedded default with a volume `demo`
#   make test   the whole suite: format, lints, unit, property and end-to-end tests
CARGO ?= cargo
PROFILE_DIR := $(CURDIR)/target/release

.PHONY: all deps build test run lint fmt bench bench-uncached clean

all: build

deps:
	@scripts/deps.sh

build: deps
	$(CARGO) build --release --workspace --bins

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --release --workspace --all-targets -- -D warnings

test: build lint
	VESTA_BIN_DIR=$(PROFILE_DIR) $(CARGO) test --release --workspace

run: build
	@VESTA_BIN_DIR=$(PROFILE_DIR) scripts/run.sh

fmt:
	$(CARGO) fmt --all

bench: bench-uncached

bench-uncached: build
	VESTA_BIN_DIR=$(PROFILE_DIR) bench/uncached.sh

clean:
	$(CARGO) clean
