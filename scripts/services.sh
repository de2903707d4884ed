#!/usr/bin/env bash
# Make sure the test servers are reachable: PostgreSQL and Redis. Starts the machine's own
# servers when they are installed but down; otherwise says what is missing and fails.
set -euo pipefail
pg_url="${JOBPLANE_TEST_POSTGRES_URL:-postgresql://postgres@127.0.0.1:5432/test}"
redis_url="${JOBPLANE_TEST_REDIS_URL:-redis://127.0.0.1:6379/0}"

pg_up() { .venv/bin/python - "$pg_url" <<'PY'
import sys, psycopg
try:
    psycopg.connect(sys.argv[1], connect_timeout=3).close()
except Exception as exc:
    print(f"  postgres: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
    sys.exit(1)
PY
}
redis_up() { .venv/bin/python - "$redis_url" <<'PY'
import sys, redis
try:
    redis.Redis.from_url(sys.argv[1], socket_connect_timeout=3).ping()
except Exception as exc:
    print(f"  redis: {exc}", file=sys.stderr)
    sys.exit(1)
PY
}
wait_for() { for _ in $(seq 1 30); do "$1" 2>/dev/null && return 0; sleep 1; done; "$1"; }

if ! pg_up; then
  if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
    echo "services: starting PostgreSQL" >&2
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
    wait_for pg_up || { echo "services: PostgreSQL did not come up at $pg_url" >&2; exit 1; }
  else
    echo "services: PostgreSQL is not reachable at $pg_url and not installed here;" \
         "set JOBPLANE_TEST_POSTGRES_URL to a server (trust auth, a database to connect to)" >&2
    exit 1
  fi
fi
if ! redis_up; then
  if command -v redis-server >/dev/null; then
    echo "services: starting Redis" >&2
    mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
      --dir /var/lib/redis --logfile /var/log/redis/ci.log
    wait_for redis_up || { echo "services: Redis did not come up at $redis_url" >&2; exit 1; }
  else
    echo "services: Redis is not reachable at $redis_url and redis-server is not installed;" \
         "set JOBPLANE_TEST_REDIS_URL" >&2
    exit 1
  fi
fi
echo "services: PostgreSQL and Redis are reachable" >&2
