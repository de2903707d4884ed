"""Settings a user gets wrong, or spells another program's way: each is read as meant or
refused in one line (exit status 2), never with a traceback."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings, SettingsConfigDict

import jobplane_cli.main as cli_main
from jobplane.settings import CommonSettings, normalise_database_url
from jobplane_worker.settings import WorkerSettings
from tests.cli_helpers import free_port, run_cli
from tests.fixtures.private_servers import private_redis


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr
    [line] = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    return line


def test_libpq_sslmode_works_against_the_server(pg_database_url: str) -> None:
    """``?sslmode=…`` as managed Postgres providers hand it out: the local server has no TLS,
    so ``disable`` connects (asyncpg's own spelling, ``ssl``, too)."""
    for query in ("?sslmode=disable", "?ssl=disable"):
        result = run_cli("migrate", JOBPLANE_DATABASE_URL=pg_database_url + query)
        assert result.returncode == 0, result.stderr
        assert "database schema at revision" in result.stderr


def test_sslmode_becomes_asyncpgs_ssl_and_the_rest_of_the_url_stays() -> None:
    url = "postgresql://u:p%40ss@db.example:5433/jp?target_session_attrs=read-write&sslmode=verify-full"
    assert normalise_database_url(url) == (
        "postgresql+asyncpg://u:p%40ss@db.example:5433/jp"
        "?target_session_attrs=read-write&ssl=verify-full"
    )
    assert normalise_database_url("postgres://db/jp") == "postgresql+asyncpg://db/jp"
    # Several hosts (SQLAlchemy reads each ``host``) and the statement cache pass as they are.
    hosts = "postgresql://u@/jp?host=a:5432&host=b:5432&prepared_statement_cache_size=0"
    assert normalise_database_url(hosts) == hosts.replace("postgresql:", "postgresql+asyncpg:")


@pytest.mark.parametrize(
    ("query", "named"),
    [
        (
            "?sslmode=require&connect_timeout=5&application_name=x",
            "application_name, connect_timeout",
        ),
        ("?sslmode=sometimes", "sslmode in the URL must be one of: disable, allow"),
        ("?sslmode=require&ssl=require", "give sslmode (or ssl) once"),
    ],
)
def test_a_parameter_asyncpg_does_not_take_is_one_line(query: str, named: str) -> None:
    result = run_cli(
        "migrate",
        JOBPLANE_DATABASE_URL="postgresql://jp:hunter2@127.0.0.1:1/jp" + query,
        JOBPLANE_STARTUP_TIMEOUT_S="0",
    )
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert line.startswith("error: JOBPLANE_DATABASE_URL:") and named in line
    assert "hunter2" not in result.stderr


@pytest.mark.parametrize(
    ("env", "queues"),
    [
        ("default", ["default"]),
        ("default,mail", ["default", "mail"]),
        (" default , mail ,", ["default", "mail"]),
        ('["default", "mail"]', ["default", "mail"]),
    ],
)
def test_queues_are_comma_separated_as_the_flag_takes_them_or_a_json_list(
    monkeypatch: pytest.MonkeyPatch, env: str, queues: list[str]
) -> None:
    monkeypatch.setenv("JOBPLANE_QUEUES", env)
    assert WorkerSettings().queues == queues


@pytest.mark.parametrize(
    ("env", "why"),
    [
        ('["default",', "not valid JSON"),
        (" , ", "name at least one queue"),
        ('{"a": 1}', "not a queue name"),
        ("default;mail", "not a queue name: 'default;mail'"),
    ],
)
def test_bad_queues_are_one_line(sqlite_database_url: str, env: str, why: str) -> None:
    result = run_cli(
        "worker",
        "--app",
        "tests.apps.basic:app",
        JOBPLANE_DATABASE_URL=sqlite_database_url,
        JOBPLANE_QUEUES=env,
    )
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert line.startswith("error: JOBPLANE_QUEUES:") and why in line


class _Tagged(BaseSettings):
    """A setting pydantic-settings decodes as JSON itself (no validator sees the text)."""

    model_config = SettingsConfigDict(env_prefix="JOBPLANE_")
    tags: dict[str, int] = {}


def test_a_value_pydantic_settings_cannot_decode_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("JOBPLANE_TAGS", "{secret-value")
    monkeypatch.setattr(cli_main, "cli", _Tagged)
    with pytest.raises(SystemExit) as exit_:
        cli_main.main()
    assert exit_.value.code == 2
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith("error: JOBPLANE_TAGS: the value cannot be read")
    assert "secret-value" not in line


def test_an_unknown_log_level_is_one_line_and_any_case_of_a_known_one_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    result = run_cli("token", "ls", JOBPLANE_LOG_LEVEL="LOUD")
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert line.startswith("error: JOBPLANE_LOG_LEVEL:") and "DEBUG" in line
    monkeypatch.setenv("JOBPLANE_LOG_LEVEL", "warning")
    assert CommonSettings().log_level == "WARNING"


def usage_error(stderr: str) -> str:
    """The text of a usage error, out of its box and its wrapping."""
    assert "Traceback" not in stderr
    return " ".join(stderr.replace("│", " ").split())


def test_revoking_something_that_is_not_a_token_id_is_a_usage_error(
    sqlite_database_url: str,
) -> None:
    result = run_cli("token", "revoke", "nope", JOBPLANE_DATABASE_URL=sqlite_database_url)
    assert result.returncode == 2, result.stderr
    assert "'nope' is not a token id" in usage_error(result.stderr)


def test_an_args_file_that_cannot_be_read_is_a_usage_error(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent.json"
    result = run_cli(
        "trigger",
        "send_receipt",
        "--args",
        f"@{missing}",
        "--url",
        "http://127.0.0.1:1",
        COLUMNS="400",  # the path unwrapped
    )
    assert result.returncode == 2, result.stderr
    assert f"cannot read {missing}: No such file or directory" in usage_error(result.stderr)


@pytest.mark.parametrize(
    "env",
    ["JOBPLANE_RETENTION_DAYS=1000000", "JOBPLANE_UNKNOWN_JOB_TIMEOUT_S=1e12"],
    ids=["retention", "unknown-job-timeout"],
)
def test_a_duration_past_a_century_is_refused_in_one_line(env: str) -> None:
    """The leader subtracts these from the database's time: ``JOBPLANE_RETENTION_DAYS=1000000``
    raised OverflowError at its first housekeeping and ended every scheduler in turn."""
    name, value = env.split("=")
    settings = {"JOBPLANE_DATABASE_URL": "sqlite:///unused.db", name: value}
    result = run_cli("scheduler", env=settings)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {name}: Input should be less than or equal to"), line


@pytest.mark.parametrize(
    ("role", "env", "said"),
    [
        # Accepted, each of these ended every attempt longer than about half the lease
        # Terminated (stopped at its fence before a renewal came).
        ("worker", {"JOBPLANE_HEARTBEAT_S": "3", "JOBPLANE_LEASE_S": "5"}, "under half of"),
        ("worker", {"JOBPLANE_HEARTBEAT_S": "20", "JOBPLANE_LEASE_S": "5"}, "less than or equal"),
        # A worker silent for 30 s is taken for dead: evicted, restarted, in a loop.
        ("worker", {"JOBPLANE_HEARTBEAT_S": "31", "JOBPLANE_LEASE_S": "100"}, "less than or"),
        # OverflowError as the role sized its session limits.
        ("worker", {"JOBPLANE_LEASE_S": "inf"}, "finite number"),
        ("scheduler", {"JOBPLANE_DB_STATEMENT_TIMEOUT_S": "inf"}, "finite number"),
        ("scheduler", {"JOBPLANE_DB_LOCK_TIMEOUT_S": "1e300"}, "less than or equal"),
        # A stop would wait that long for the read.
        ("worker", {"JOBPLANE_POLL_MS": "600000"}, "less than or equal to 60000"),
        # Out of the database's int32 at registration, naming no setting.
        ("worker", {"JOBPLANE_CONCURRENCY": "2147483648"}, "less than or equal"),
        # A lease of a millisecond: never held, renewed in a flood of warnings.
        ("scheduler", {"JOBPLANE_LEASE_TTL_S": "0.001"}, "greater than or equal to 0.5"),
    ],
)
def test_timings_that_cannot_work_are_refused_in_one_line(
    role: str, env: dict[str, str], said: str
) -> None:
    args = ("worker", "--app", "tests.apps.basic:app") if role == "worker" else (role,)
    result = run_cli(*args, env={"JOBPLANE_DATABASE_URL": "sqlite:///unused.db", **env})
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert said in line and any(name in line for name in env), line


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        # Each of these was a traceback.
        (("worker", "--app", ""), {}, "'' is not module:attribute"),
        (("worker", "--app", ".foo"), {}, "'.foo' is not module:attribute"),
        (("scheduler",), {"JOBPLANE_REDIS_URL": "redis://127.0.0.1:6379/99"}, "DB index is out"),
        (("scheduler",), {"JOBPLANE_REDIS_URL": "redis://h:notaport/0"}, "port cannot be read"),
        (
            ("migrate",),
            {"JOBPLANE_DATABASE_URL": "postgresql://u:hunter2@h:notaport/db"},
            "port cannot be read",
        ),
        (("scheduler",), {"JOBPLANE_REDIS_URL": "http://u:hunter2@x/"}, "'http://u:***@x/'"),
        (
            ("jobs", "ls"),
            {"JOBPLANE_API_TOKEN": "jp_…", "JOBPLANE_API_URL": "http://127.0.0.1:1"},
            "the API token is not ASCII text",
        ),
    ],
    ids=["app-empty", "app-relative", "redis-db", "redis-port", "pg-port", "bus-url", "token"],
)
def test_settings_a_user_gets_wrong_are_one_line_and_keep_passwords_out(
    sqlite_database_url: str, args: tuple[str, ...], env: dict[str, str], said: str
) -> None:
    settings = {"JOBPLANE_DATABASE_URL": sqlite_database_url, "JOBPLANE_STARTUP_TIMEOUT_S": "0"}
    result = run_cli(*args, env={**settings, **env})
    assert result.returncode == (1 if args[0] == "jobs" else 2), result.stderr  # (a remote one: 1)
    line = one_error_line(result.stderr)
    assert said in line and "hunter2" not in result.stderr, line


def test_an_api_on_a_port_in_use_is_one_line(sqlite_database_url: str) -> None:
    """The single api process let uvicorn bind last, which exited 3 with its own log lines;
    its processes (``--workers 2``) said it in one line already."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for workers in ("1", "2"):
            result = run_cli(
                "api",
                "--host",
                "127.0.0.1",
                "--port",
                port,
                "--workers",
                workers,
                env={"JOBPLANE_DATABASE_URL": sqlite_database_url},
            )
            assert result.returncode == 2, result.stderr
            assert f"cannot listen on 127.0.0.1:{port}" in one_error_line(result.stderr)


def test_api_processes_that_cannot_start_exit_in_one_line() -> None:
    """``--workers 2`` against an unreachable database: each process printed a traceback (its
    exit, typer's, was not click's) and the supervisor exited 1."""
    result = run_cli(
        "api",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--workers",
        "2",
        env={
            "JOBPLANE_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/x",
            "JOBPLANE_STARTUP_TIMEOUT_S": "0",
        },
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr


def test_an_empty_queues_flag_and_an_api_port_out_of_range_are_refused(
    sqlite_database_url: str,
) -> None:
    """``--queues ""`` fell back to the default queue without a word; ``jobplane dev
    --api-port 70000`` failed only once its worker and scheduler had started, naming
    JOBPLANE_PORT."""
    env = {"JOBPLANE_DATABASE_URL": sqlite_database_url}
    empty = run_cli("worker", "--app", "tests.apps.basic:app", "--queues", "", env=env)
    assert empty.returncode == 2 and "name at least one queue" in one_error_line(empty.stderr)
    port = run_cli("dev", "--app", "tests.apps.basic:app", "--api-port", "70000", env=env)
    assert port.returncode == 2 and "Invalid value for '--api-port'" in port.stderr


def test_dev_says_which_jobs_it_does_not_consume_the_queue_of(sqlite_database_url: str) -> None:
    """Everything runs in the one dev worker: a job on a queue it does not consume waited
    for good, and ``--exit-when-done`` with it, without a word."""
    result = run_cli(
        "dev",
        "--app",
        "tests.apps.basic:app",
        "--exit-when-done",
        env={"JOBPLANE_DATABASE_URL": sqlite_database_url, "JOBPLANE_QUEUES": "other"},
    )
    assert result.returncode == 0, result.stderr
    assert "job echo is on queue 'default', which this dev worker does not consume" in (
        result.stderr
    )


@pytest.mark.parametrize("credentials", [":wrong@", ""], ids=["wrong-password", "no-password"])
def test_a_redis_password_refused_is_one_line_at_once(
    sqlite_database_url: str, credentials: str
) -> None:
    """A wrong or missing password was a connection error to redis-py: waited out as an
    outage until the start-up timeout (a minute by default), then said."""
    port = free_port()
    with private_redis(port, "--requirepass", "right"):
        result = run_cli(
            "scheduler",
            timeout=30,  # (well under the start-up timeout below: it is not waited out)
            env={
                "JOBPLANE_DATABASE_URL": sqlite_database_url,
                "JOBPLANE_REDIS_URL": f"redis://{credentials}127.0.0.1:{port}/0",
                "JOBPLANE_STARTUP_TIMEOUT_S": "300",
            },
        )
    assert result.returncode == 2, result.stderr
    line = one_error_line(result.stderr)
    assert line.startswith("error: Redis refuses this connection:"), line
    assert "wrong" not in line
