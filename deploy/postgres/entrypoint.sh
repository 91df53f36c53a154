#!/bin/sh
# iop-postgres: make the cluster on the first start (role and database `iop`), then run the
# server in the foreground with `exec`, so `docker stop` reaches it.
set -eu
if [ ! -s "$PGDATA/PG_VERSION" ]; then
    auth=trust
    pwfile=""
    if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then
        auth=scram-sha-256
        pwfile="--pwfile=$POSTGRES_PASSWORD_FILE"
    fi
    initdb -D "$PGDATA" --username=iop --encoding=UTF8 --auth-local=trust \
        --auth-host="$auth" $pwfile
    echo "host all all 0.0.0.0/0 $auth" >> "$PGDATA/pg_hba.conf"
    pg_ctl -D "$PGDATA" -o "-c listen_addresses=127.0.0.1" -w start
    psql -X -q -h 127.0.0.1 -U iop -d postgres -c 'CREATE DATABASE iop'
    pg_ctl -D "$PGDATA" -m fast -w stop
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' -c unix_socket_directories=/tmp "$@"
