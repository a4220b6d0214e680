#!/usr/bin/env bash
# A throwaway PostgreSQL server for the tests of `hilum serve --db postgres://...`.
#
# Installs Debian's `postgresql` package if it is missing, creates a cluster in
# target/hilum-postgres (or $HILUM_PG_DIR) on first use, starts it on 127.0.0.1 on a free port
# (every run: servers do not outlive a CI job), creates the database `hilum_test`, and prints
#   export HILUM_TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:PORT/hilum_test
# on stdout; progress goes to stderr. Idempotent: a cluster that is already running is reused.
#
# Test cluster only: trust authentication on loopback, no TLS, fsync off. Never point it at
# real data. Stop it with: runuser -u postgres -- pg_ctl -D target/hilum-postgres/data stop
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
dir="${HILUM_PG_DIR:-$root/target/hilum-postgres}"
db=hilum_test

log() { echo "setup_postgres: $*" >&2; }

find_bindir() {
    ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1
}

bindir="$(find_bindir)"
if [ -z "$bindir" ] || [ ! -x "$bindir/pg_ctl" ]; then
    log "installing Debian's postgresql package (apt-get)"
    if [ "$(id -u)" -eq 0 ]; then sudo=(); else sudo=(sudo); fi
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update -qq >&2
    # The package's own cluster is not needed: only the binaries are used.
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends postgresql >&2
    bindir="$(find_bindir)"
    [ -n "$bindir" ] || { log "error: postgresql installed but no /usr/lib/postgresql/*/bin"; exit 1; }
fi

# PostgreSQL refuses to run as root: as root, run it as the `postgres` user.
if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || useradd --system --home-dir /var/lib/postgresql --shell /bin/bash postgres
    as_pg() { runuser -u postgres -- "$@"; }
    owner=postgres
else
    as_pg() { "$@"; }
    owner="$(id -un)"
fi

prepare_dir() {
    mkdir -p "$1" && chown "$owner" "$1" && chmod 700 "$1" && as_pg test -w "$1"
}
if ! prepare_dir "$dir" 2>/dev/null; then
    # e.g. a checkout under /root, which the postgres user cannot enter.
    log "$dir is not usable by $owner; using /tmp instead"
    dir="/tmp/hilum-postgres-$(id -u)"
    prepare_dir "$dir"
fi
data="$dir/data"

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

if [ ! -f "$data/PG_VERSION" ]; then
    log "creating a cluster in $data"
    as_pg "$bindir/initdb" -D "$data" -U postgres --auth=trust --encoding=UTF8 --no-sync >/dev/null
fi

port=""
if as_pg "$bindir/pg_ctl" -D "$data" status >/dev/null 2>&1; then
    # postmaster.pid: line 4 is the port.
    port="$(sed -n 4p "$data/postmaster.pid")"
    log "reusing the running server on 127.0.0.1:$port"
else
    port="$(free_port)"
    log "starting PostgreSQL ($("$bindir/postgres" --version)) on 127.0.0.1:$port"
    as_pg "$bindir/pg_ctl" -D "$data" -l "$dir/server.log" -w -t 60 \
        -o "-p $port -k $dir -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200" \
        start >&2 || { cat "$dir/server.log" >&2; exit 1; }
fi

psql_() { as_pg "$bindir/psql" -X -q -h 127.0.0.1 -p "$port" -U postgres "$@"; }
if [ "$(psql_ -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$db'")" != 1 ]; then
    psql_ -d postgres -c "CREATE DATABASE $db" >&2
fi
echo "export HILUM_TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:$port/$db"
