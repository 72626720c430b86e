#!/bin/sh
# Make the cluster on first start (owned by postgres, password authentication from anywhere),
# then run PostgreSQL in the foreground as postgres.
set -eu
bin=$(ls -d /usr/lib/postgresql/*/bin | tail -n 1)
mkdir -p "$PGDATA"
chown postgres:postgres "$PGDATA"
chmod 0700 "$PGDATA"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    pwfile=$(mktemp)
    printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
    chown postgres "$pwfile"
    runuser -u postgres -- "$bin/initdb" -D "$PGDATA" -U "${POSTGRES_USER:-postgres}" \
        --pwfile="$pwfile" --auth-local=trust --auth-host=scram-sha-256 >/dev/null
    rm -f "$pwfile"
    echo "host all all 0.0.0.0/0 scram-sha-256" >> "$PGDATA/pg_hba.conf"
    echo "host all all ::/0 scram-sha-256" >> "$PGDATA/pg_hba.conf"
    runuser -u postgres -- "$bin/pg_ctl" -D "$PGDATA" -o "-c listen_addresses='' -k /tmp" -w start >/dev/null
    if [ -n "${POSTGRES_DB:-}" ] && [ "$POSTGRES_DB" != "${POSTGRES_USER:-postgres}" ]; then
        runuser -u postgres -- "$bin/createdb" -h /tmp -U "${POSTGRES_USER:-postgres}" "$POSTGRES_DB"
    fi
    runuser -u postgres -- "$bin/pg_ctl" -D "$PGDATA" -m fast -w stop >/dev/null
fi
exec runuser -u postgres -- "$bin/postgres" -D "$PGDATA" -c listen_addresses='*' -k /tmp
