#!/usr/bin/env bash
# A throwaway PostgreSQL server for the tests of `hilum serve --db postgres://...`.
#
# Installs Debian's `postgresql` package if it is missing, creates a cluster in
# target/hilum-postgres (or $HILUM_PG_DIR) on first use, starts it on 127.0.0.1 on a free port
# (every run: servers do not outlive a CI job), creates the database `hilum_test`, and prints
#   export HILUM_TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:PORT/hilum_test
#   export HILUM_TEST_POSTGRES_CA=DIR/tls/ca.crt
# on stdout; progress goes to stderr. Idempotent: a cluster that is already running is reused.
#
# TLS: a throwaway CA (DIR/tls/ca.crt) signs the server's certificate for 127.0.0.1 and
# localhost, and the cluster runs with `ssl = on`, so that the tests can connect with
# sslmode=verify-full&sslrootcert=$HILUM_TEST_POSTGRES_CA. Plain connections are still
# accepted (the tests of the other sslmodes use them).
#
# Test cluster only: trust authentication on loopback, fsync off. Never point it at real
# data. Stop it with: runuser -u postgres -- pg_ctl -D target/hilum-postgres/data stop
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

# The CA and the server certificate (ECDSA P-256: quick to make, and rustls takes it).
tls="$dir/tls"
new_cert=0
if [ ! -f "$tls/server.crt" ] || [ ! -f "$tls/ca.crt" ]; then
    log "making a test CA and a server certificate in $tls"
    if ! command -v openssl >/dev/null; then
        log "installing Debian's openssl package (apt-get), for the test certificate"
        if [ "$(id -u)" -eq 0 ]; then sudo=(); else sudo=(sudo); fi
        export DEBIAN_FRONTEND=noninteractive
        "${sudo[@]}" apt-get update -qq >&2
        "${sudo[@]}" apt-get install -y -qq --no-install-recommends openssl >&2
    fi
    mkdir -p "$tls"
    ec=(-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes)
    openssl req -x509 "${ec[@]}" -days 3650 -subj "/CN=Hilum test CA" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
        -keyout "$tls/ca.key" -out "$tls/ca.crt" 2>/dev/null
    openssl req -new "${ec[@]}" -subj "/CN=localhost" \
        -keyout "$tls/server.key" -out "$tls/server.csr" 2>/dev/null
    printf '%s\n' "subjectAltName=DNS:localhost,IP:127.0.0.1" "basicConstraints=critical,CA:FALSE" \
        "keyUsage=critical,digitalSignature" "extendedKeyUsage=serverAuth" >"$tls/server.ext"
    openssl x509 -req -in "$tls/server.csr" -CA "$tls/ca.crt" -CAkey "$tls/ca.key" -CAcreateserial \
        -days 3650 -extfile "$tls/server.ext" -out "$tls/server.crt" 2>/dev/null
    new_cert=1
fi
# PostgreSQL refuses a key that others can read.
chown -R "$owner" "$tls"
chmod 700 "$tls"
chmod 600 "$tls/server.key" "$tls/ca.key"
chmod 644 "$tls/ca.crt" "$tls/server.crt"
conf="$data/postgresql.conf"
if ! grep -q "^# hilum test TLS" "$conf"; then
    printf '%s\n' "# hilum test TLS (scripts/setup_postgres.sh)" "ssl = on" \
        "ssl_cert_file = '$tls/server.crt'" "ssl_key_file = '$tls/server.key'" >>"$conf"
    new_cert=1
fi

port=""
if as_pg "$bindir/pg_ctl" -D "$data" status >/dev/null 2>&1; then
    # postmaster.pid: line 4 is the port.
    port="$(sed -n 4p "$data/postmaster.pid")"
    log "reusing the running server on 127.0.0.1:$port"
    if [ "$new_cert" = 1 ]; then
        # SSL settings take effect on reload (PostgreSQL 10 and later).
        log "reloading it to turn TLS on"
        as_pg "$bindir/pg_ctl" -D "$data" reload >&2
        sleep 1
    fi
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
if [ "$(psql_ -d postgres -tAc "SHOW ssl")" != on ]; then
    log "error: TLS is not on in the server on 127.0.0.1:$port (see $dir/server.log)"
    exit 1
fi
echo "export HILUM_TEST_POSTGRES_URL=postgres://postgres@127.0.0.1:$port/$db"
echo "export HILUM_TEST_POSTGRES_CA=$tls/ca.crt"
