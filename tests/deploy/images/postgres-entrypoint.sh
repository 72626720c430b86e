#!/bin/sh
# Make the cluster on first start (owned by postgres, password authentication over the network,
# trust on the local socket), then run PostgreSQL in the foreground as postgres.
set -eu
bin=$(ls -d /usr/lib/postgresql/*/bin | tail -n 1)
user=${POSTGRES_USER:-postgres}
as_postgres() {
    setpriv --reuid=postgres --regid=postgres --init-groups "$@"
}
mkdir -p "$PGDATA" /run/postgresql
chown postgres:postgres "$PGDATA" /run/postgresql
chmod 0700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    chown postgres "$pwfile"
    as_postgres "$bin/initdb" -D "$PGDATA" -U "$user" --pwfile="$pwfile" -E UTF8 --locale=C.UTF-8 \
        --auth-local=trust --auth-host=scram-sha-256 > /dev/null
    rm -f "$pwfile"
    echo "host all all 0.0.0.0/0 scram-sha-256" >> "$PGDATA/pg_hba.conf"
    echo "host all all ::/0 scram-sha-256" >> "$PGDATA/pg_hba.conf"
    as_postgres "$bin/pg_ctl" -D "$PGDATA" -o "-c listen_addresses=''" -w start > /dev/null
    if [ -n "${POSTGRES_DB:-}" ] && [ "$POSTGRES_DB" != postgres ]; then
        as_postgres "$bin/createdb" -U "$user" "$POSTGRES_DB"
    fi
    as_postgres "$bin/pg_ctl" -D "$PGDATA" -m fast -w stop > /dev/null
fi
exec setpriv --reuid=postgres --regid=postgres --init-groups \
    "$bin/postgres" -D "$PGDATA" -c listen_addresses='*'
