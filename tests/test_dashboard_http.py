"""The dashboard over HTTP, in process, on both stores (Postgres and SQLite) and both buses:
every page renders, the session and CSRF rules hold, and the filters the pages use."""

from __future__ import annotations

import asyncio
import html
import json
import re

import httpx

from jobplane.auth import Role
from jobplane.domain.models import InstanceFilter
from jobplane.store.sql import SqlStore
from jobplane_api.dashboard.access import safe_next
from jobplane_api.dashboard.render import cron_words
from jobplane_api.dashboard.shared import Shared
from tests.apps.dashboard import app as jobs_app
from tests.fixtures.dashboard_client import CSRF, csrf_of


async def test_every_page_renders_with_auth_off(open_dash: httpx.AsyncClient) -> None:
    """``jobplane dev``: no login, everyone is admin, but the CSRF check still applies."""
    csrf = await csrf_of(open_dash, "/jobs/greet")
    for headers in ({}, {b"X-CSRF-Token": ("é" * 64).encode()}, {"X-CSRF-Token": csrf[::-1]}):
        refused = await open_dash.post(
            "/jobs/greet/trigger", data={"args": '{"name": "x"}'}, headers=headers
        )
        assert refused.status_code == 403, headers
    made = await open_dash.post(
        "/jobs/greet/trigger", data={"arg.name": "<b>x</b>", "arg.excited": "on", "csrf": csrf}
    )
    assert made.status_code == 303, made.text
    instance = made.headers["location"]
    for path in (
        "/",
        "/?partial=1",
        "/jobs",
        "/jobs?kind=recurring&queue=reports&q=month",
        "/jobs/monthly_report",
        "/jobs/greet?partial=instances",
        "/instances",
        "/instances?state=enqueued&state=processing&job=greet&since=1h&partial=1",
        instance,
        f"{instance}?partial=1",
        "/workers",
    ):
        page = await open_dash.get(path)
        assert page.status_code == 200, (path, page.text[:500])
        assert "frame-ancestors 'none'" in page.headers["content-security-policy"]
        assert "<b>x</b>" not in page.text
    shown = (await open_dash.get(instance)).text
    assert "&#34;name&#34;: &#34;&lt;b&gt;x&lt;/b&gt;&#34;" in shown  # as text, quotes too
    assert "&#34;excited&#34;: true" in shown
    recurring = (await open_dash.get("/jobs?kind=recurring")).text
    assert "monthly_report" in recurring and "/jobs/greet" not in recurring
    missing = await open_dash.get("/jobs/nope")
    assert missing.status_code == 404 and "There is no job" in missing.text


async def test_session_cookie_roles_and_revocation(
    dash: httpx.AsyncClient, pg_store: SqlStore
) -> None:
    gate = await dash.get("/instances?state=failed", follow_redirects=False)
    assert gate.status_code == 303
    assert gate.headers["location"] == "/login?next=/instances%3Fstate%3Dfailed"
    live = await dash.get("/", headers={"X-Live": "1"})
    assert live.status_code == 401  # the polling script shows "signed out"
    info, secret = await pg_store.create_token("ann", Role.VIEWER, "test")
    csrf = await csrf_of(dash, "/login")
    signed = await dash.post(
        "/login", data={"token": secret, "csrf": csrf, "next": "/\t/evil.example"}
    )
    assert signed.status_code == 303 and signed.headers["location"] == "/"
    cookie = signed.headers["set-cookie"]
    assert "HttpOnly" in cookie and "SameSite=lax" in cookie and "Path=/" in cookie
    page = await dash.get("/jobs/greet")
    assert page.status_code == 200 and "Trigger greet" not in page.text
    found = CSRF.search(page.text)
    assert found, page.text
    csrf = found[1]
    refused = await dash.post("/jobs/greet/trigger", data={"args": "{}", "csrf": csrf})
    assert refused.status_code == 403 and "operator role" in refused.text
    data = {"version": "1", "retries": "3", "csrf": csrf}
    refused = await dash.post("/jobs/greet/edit", data=data)
    assert refused.status_code == 403 and "admin role" in refused.text
    assert (await pg_store.get_definition("greet")).options.retries == 0
    assert await pg_store.revoke_token(info.id, "test")
    after = await dash.get("/", follow_redirects=False)
    assert after.status_code == 303 and after.headers["location"].startswith("/login")


async def test_a_form_sent_after_the_session_ended_says_so(
    dash: httpx.AsyncClient, pg_store: SqlStore
) -> None:
    """A form sent after the session's token was revoked or expired was refused as a stale
    form token ("reload the page"), which led to the sign-in page without a word. It goes
    to the sign-in page now, which says the session ended and that nothing was done, and
    then back to the page the form was on."""
    info, secret = await pg_store.create_token("ann", Role.OPERATOR, "test")
    csrf = await csrf_of(dash, "/login")
    assert (await dash.post("/login", data={"token": secret, "csrf": csrf})).status_code == 303
    found = CSRF.search((await dash.get("/jobs/greet")).text)
    assert found
    assert await pg_store.revoke_token(info.id, "test")

    page = dash.base_url.join("/jobs/greet")
    sent = await dash.post(
        "/jobs/greet/trigger",
        data={"args": '{"name": "Ada"}', "csrf": found[1]},
        headers={"Referer": str(page)},
    )
    assert sent.status_code == 303
    assert sent.headers["location"] == "/login?next=/jobs/greet&ended=form"
    login = await dash.get(sent.headers["location"])
    assert "Your session ended" in login.text and "What you sent was not done." in login.text
    assert (await pg_store.list_instances(InstanceFilter(job_key="greet"))).items == []

    # A page opened instead says the session ended, without the form's part; a form sent
    # from another site's page comes back to the Overview.
    for opened in (False, True):
        info, secret = await pg_store.create_token("bob", Role.OPERATOR, "test")
        csrf = await csrf_of(dash, "/login")
        assert (await dash.post("/login", data={"token": secret, "csrf": csrf})).is_redirect
        found = CSRF.search((await dash.get("/jobs/greet")).text)
        assert found and await pg_store.revoke_token(info.id, "test")
        if opened:
            gate = await dash.get("/jobs/greet", follow_redirects=False)
            assert gate.headers["location"] == "/login?next=/jobs/greet&ended=page"
            login = await dash.get(gate.headers["location"])
            assert "Your session ended" in login.text and "not done" not in login.text
        else:
            foreign = {"Referer": "https://evil.example/jobs/greet"}
            other = await dash.post("/jobs/greet/pause", data={"csrf": found[1]}, headers=foreign)
            assert other.headers["location"] == "/login?next=/&ended=form"
    assert not (await pg_store.get_definition("greet")).paused


def test_safe_next_keeps_only_local_paths() -> None:
    assert safe_next("/instances?state=failed") == "/instances?state=failed"
    for bad in (
        None,
        "",
        "https://evil.example/",
        "//evil.example",
        "/\t/evil.example",
        "/\\evil.example",
        "jobs",
    ):
        assert safe_next(bad) == "/", bad


def test_cron_in_words() -> None:
    assert cron_words(None) == "Manual trigger only"
    assert cron_words("*/15 9-17 * * mon-fri") == (
        "Every 15 minutes, between 09:00 and 17:59, Monday through Friday"
    )
    assert cron_words("0 12 * * * 30") == "At 12:00:30"  # the 6th field is seconds


async def test_trigger_later_then_run_now(open_dash: httpx.AsyncClient) -> None:
    csrf = await csrf_of(open_dash, "/jobs/greet")
    form = {"arg.name": "Ada", "csrf": csrf}
    both = await open_dash.post(
        "/jobs/greet/trigger", data={**form, "delay_s": "5", "run_at": "2099-01-01T00:00:00Z"}
    )
    assert both.status_code == 422 and "give run_at or delay_s, not both" in both.text
    naive = await open_dash.post("/jobs/greet/trigger", data={**form, "run_at": "2099-01-01"})
    assert naive.status_code == 422 and "timezone" in naive.text
    later = await open_dash.post(
        "/jobs/greet/trigger", data={**form, "run_at": "2099-01-01T00:00:00+01:00"}
    )
    assert later.status_code == 303
    page = (await open_dash.get(later.headers["location"])).text
    assert "state-scheduled" in page and "Run now" in page
    ran = await open_dash.post(f"{later.headers['location']}/run", data={"csrf": csrf})
    assert ran.status_code == 303
    page = (await open_dash.get(later.headers["location"])).text
    assert "Enqueued: it runs now." in page and "Run now" not in page


async def test_shared_value_is_computed_once_per_ttl() -> None:
    now = [100.0]
    shared = Shared[int](2.0, clock=lambda: now[0])
    calls = []

    async def compute() -> int:
        calls.append(now[0])
        await asyncio.sleep(0.01)  # others arrive meanwhile and wait for this one
        return len(calls)

    assert await asyncio.gather(*(shared.get(compute) for _ in range(5))) == [1] * 5
    now[0] += 1.9
    assert await shared.get(compute) == 1
    now[0] += 0.1
    assert await shared.get(compute) == 2 and calls == [100.0, 102.0]


async def test_app_scope_limits_jobs_and_instances_to_one_app(
    open_dash: httpx.AsyncClient, store: SqlStore
) -> None:
    """``/apps/{app}/…``: only the jobs the app registered and their instances; the REST
    list filters the same way and says each job's app."""
    from jobplane.domain.models import NewInstance
    from jobplane.domain.options import JobOptions

    other = JobOptions.parse(key="ledger_close", kind="triggered", name="Ledger <close>")
    await store.register_definition(other, None, "test", app="billing")
    for spec in jobs_app.jobs.values():
        await store.register_definition(spec.options, spec.args_schema(), "test", app="shop")
    [mine] = await store.create_instances([NewInstance(job_key="greet", args={"name": "a"})])
    [theirs] = await store.create_instances([NewInstance(job_key="ledger_close")])

    listed = (await open_dash.get("/api/v1/jobs", params={"app": "billing"})).json()
    assert [(j["key"], j["app"]) for j in listed] == [("ledger_close", "billing")]
    shop_keys = {j["key"] for j in (await open_dash.get("/api/v1/jobs?app=shop")).json()}
    assert shop_keys == set(jobs_app.jobs)

    home = await open_dash.get("/apps/billing")
    assert home.status_code == 303 and home.headers["location"] == "/apps/billing/"
    page = (await open_dash.get("/apps/billing/jobs")).text
    assert "ledger_close" in page and "/jobs/greet" not in page
    assert 'href="/apps/billing/instances"' in page  # the navigation stays in the app
    assert (await open_dash.get("/jobs?app=billing")).text.count('href="/jobs/') == 1
    every = (await open_dash.get("/jobs")).text
    assert '<option value="billing"' in every and '<option value="shop"' in every

    scoped = (await open_dash.get("/apps/billing/instances")).text
    assert str(theirs.id) in scoped and str(mine.id) not in scoped
    live = (await open_dash.get("/instances?app=shop&partial=1")).text
    assert str(mine.id) in live and str(theirs.id) not in live
    nothing = (await open_dash.get("/apps/nobody/instances")).text
    assert str(mine.id) not in nothing and str(theirs.id) not in nothing


async def test_app_overview_and_workers_show_that_apps_jobs_only(
    open_dash: httpx.AsyncClient, store: SqlStore
) -> None:
    """``/apps/{app}/``: the app's instances by state, failures and workers (those that
    registered one of its jobs); the lags and the scheduler are said to be every app's."""
    from jobplane.domain.models import NewInstance, WorkerInfo
    from jobplane.domain.options import JobOptions

    other = JobOptions.parse(key="ledger_close", kind="triggered")
    await store.register_definition(other, None, "test", app="billing")
    await store.create_instances([NewInstance(job_key="greet", args={"name": "a"}) for _ in "abc"])
    await store.create_instances([NewInstance(job_key="ledger_close")])
    for worker, jobs in (("w-shop", ("greet",)), ("w-billing", ("ledger_close",))):
        info = WorkerInfo(worker, "h", 1, ("default",), 4, "1", jobs=jobs)
        await store.register_worker(info)

    page = (await open_dash.get("/apps/billing/")).text
    assert 'data-state-count="enqueued">1<' in page
    assert 'data-live="/apps/billing/?partial=1"' in page
    assert 'href="/apps/billing/workers"' in page and "(all apps)" in page
    every = (await open_dash.get("/?partial=1")).text
    assert 'data-state-count="enqueued">4<' in every

    workers = (await open_dash.get("/apps/billing/workers")).text
    assert "w-billing" in workers and "w-shop" not in workers
    assert "serves every app" in workers
    assert "w-shop" in (await open_dash.get("/workers")).text


async def test_workers_page_shows_runaway_slots(
    open_dash: httpx.AsyncClient, store: SqlStore
) -> None:
    """A slot held by code still running after its attempt timed out is listed under its
    worker, linking to the instance."""
    from jobplane.domain.models import ErrorInfo, NewInstance, Outcome, WorkerInfo
    from jobplane.domain.states import InstanceState

    await store.register_worker(WorkerInfo("w-stuck", "h", 1, ("default",), 2, "1", ("greet",)))
    [made] = await store.create_instances([NewInstance(job_key="greet", args={"name": "a"})])
    [claim] = (await store.claim([made.id], "w-stuck", 30, ["greet"])).claimed
    timeout = ErrorInfo(type="TimeoutError", message="execution timeout")
    await store.complete(
        [Outcome(made.id, claim.token, InstanceState.FAILED, error=timeout, holds_slot=True)]
    )
    [held] = await store.runaway_slots()
    assert (held.instance_id, held.worker_id, held.job_key) == (made.id, "w-stuck", "greet")

    page = (await open_dash.get("/workers")).text
    assert "1 holding slot" in page
    runaways = page[page.index('id="runaways"') :]
    assert f'href="/instances/{made.id}"' in runaways and "<code>w-stuck</code>" in runaways
    assert "1 runaway" in (await open_dash.get("/")).text

    assert await store.release_runaway_slot(made.id, claim.token)
    assert "None: every timed-out" in (await open_dash.get("/workers")).text


async def test_workers_page_lists_the_scheduler_standbys(
    open_dash: httpx.AsyncClient, store: SqlStore
) -> None:
    for holder in ("sched-a", "sched-b", "sched-c"):
        await store.scheduler_seen(0, holder)
    assert await store.acquire_leadership(0, "sched-b", 30) is not None
    page = (await open_dash.get("/workers?partial=1")).text
    standbys = page[page.index('id="standbys"') :]
    assert "sched-a" in standbys and "sched-c" in standbys and "sched-b" not in standbys
    assert "<code>sched-b</code>" in page[: page.index('id="standbys"')]  # the leader


async def test_overview_shows_the_hours_fire_and_pickup_lag(
    open_dash: httpx.AsyncClient, store: SqlStore
) -> None:
    from jobplane.domain.models import NewInstance

    [made] = await store.create_instances([NewInstance(job_key="greet", args={"name": "a"})])
    claimed = await store.claim([made.id], "w1", 30, ["greet"])
    assert len(claimed.claimed) == 1
    page = (await open_dash.get("/?partial=1")).text
    pickup = re.search(
        r'data-lag="pickup"><strong>([^<]+)</strong> <span class="muted">(\d+)', page
    )
    assert pickup and pickup[2] == "1" and pickup[1] != "—"
    fire = re.search(r'data-lag="fire"><strong>([^<]+)</strong> <span class="muted">(\d+)', page)
    assert fire and (fire[1], fire[2]) == ("—", "0")  # no cron tick in the last hour


async def test_a_job_no_live_worker_can_run_is_flagged(
    open_dash: httpx.AsyncClient, store: SqlStore
) -> None:
    """A job whose queue no live worker that knows it consumes waits silently: the jobs list
    marks it "no worker" and its page says so; a worker of its queue clears both."""
    from jobplane.domain.models import WorkerInfo

    await store.register_worker(WorkerInfo("w-gpu", "h", 1, ("gpu",), 4, "1", ("greet",)))
    listed = (await open_dash.get("/jobs")).text
    row = listed[listed.index('href="/jobs/greet"') :].split("</tr>")[0]
    assert "data-no-runner" in row and "consumes queue default" in row
    page = (await open_dash.get("/jobs/greet")).text
    assert 'data-runners="0"' in page and "its instances wait" in page

    await store.register_worker(WorkerInfo("w-cpu", "h", 1, ("default",), 4, "1", ("greet",)))
    listed = (await open_dash.get("/jobs")).text
    row = listed[listed.index('href="/jobs/greet"') :].split("</tr>")[0]
    assert "data-no-runner" not in row
    page = (await open_dash.get("/jobs/greet")).text
    assert 'data-runners="1"' in page and "1 on queue default" in page


async def test_job_page_charts_the_duration_of_its_latest_runs(
    open_dash: httpx.AsyncClient, store: SqlStore
) -> None:
    from jobplane.domain.models import NewInstance, Outcome
    from jobplane.domain.states import InstanceState

    made = await store.create_instances(
        [NewInstance(job_key="greet", args={"name": str(n)}) for n in range(4)]
    )
    ran, waiting = made[:3], made[3]
    claims = (await store.claim([i.id for i in ran], "w1", 30, ["greet"])).claimed
    ends = [InstanceState.SUCCEEDED, InstanceState.SUCCEEDED, InstanceState.CANCELLED]
    await store.complete(
        [Outcome(c.instance.id, c.token, s) for c, s in zip(claims, ends, strict=True)]
    )
    await store.request_cancel(waiting.id, "test")  # ended without a run: no bar
    ended = await store.recent_ends("greet", 10)
    assert {i.id for i in ended} == {i.id for i in made}
    finished = [i.finished_at for i in ended if i.finished_at is not None]
    assert len(finished) == len(ended) and finished == sorted(finished, reverse=True)
    assert len(await store.recent_ends("greet", 2)) == 2

    page = (await open_dash.get("/jobs/greet")).text
    start = page.index('id="durations"')
    spec = json.loads(page[page.index("data-chart='", start) + 12 : page.index("'>", start)])
    ok, not_ok = (s["values"] for s in spec["series"])
    assert sum(v is not None for v in ok) == 2 and sum(v is not None for v in not_ok) == 1
    assert spec["links"] == [f"/instances/{c.instance.id}" for c in claims]  # oldest first
    assert "Duration of the last 3 runs" in page
    table = page[page.index("Runs as a table") : page.index("</details>", start)]
    for c in claims:
        assert f'href="/instances/{c.instance.id}"' in table


async def test_cancel_then_retry_everything_a_filter_selects_after_a_count(
    open_dash: httpx.AsyncClient, store: SqlStore
) -> None:
    from jobplane.domain.models import InstanceFilter, NewInstance
    from jobplane.domain.states import InstanceState

    made = await store.create_instances(
        [NewInstance(job_key="greet", args={"name": str(n)}) for n in range(3)]
    )
    [other] = await store.create_instances([NewInstance(job_key="monthly_report")])
    csrf = await csrf_of(open_dash, "/instances")
    fields = {"job": "greet", "state": "enqueued", "csrf": csrf}

    refused = await open_dash.post("/instances/bulk-filter", data={**fields, "csrf": "x" * 64})
    assert refused.status_code == 403
    asked = await open_dash.post("/instances/bulk-filter", data={**fields, "action": "cancel"})
    assert asked.status_code == 200 and 'data-count="3"' in asked.text
    assert "Cancel 3 instances?" in asked.text
    still = await store.list_instances(InstanceFilter(states=(InstanceState.ENQUEUED,)))
    assert len(still.items) == 4  # asking changed nothing

    done = await open_dash.post(
        "/instances/bulk-filter", data={**fields, "action": "cancel", "confirmed": "1"}
    )
    assert done.status_code == 303
    assert done.headers["location"] == "/instances?state=enqueued&job=greet"
    for i in made:
        assert (await store.get_instance(i.id)).state is InstanceState.CANCELLED
    assert (await store.get_instance(other.id)).state is InstanceState.ENQUEUED
    assert "Cancelled 3" in (await open_dash.get(done.headers["location"])).text

    retry = {"job": "greet", "state": "cancelled", "csrf": csrf, "action": "retry"}
    asked = await open_dash.post("/instances/bulk-filter", data=retry)
    assert 'data-count="3"' in asked.text
    await open_dash.post("/instances/bulk-filter", data={**retry, "confirmed": "1"})
    retries = await store.list_instances(
        InstanceFilter(job_key="greet", states=(InstanceState.ENQUEUED,))
    )
    assert sorted(i.retry_of for i in retries.items if i.retry_of) == sorted(i.id for i in made)


async def test_a_filter_value_naming_no_state_is_said_and_acts_on_nothing(
    open_dash: httpx.AsyncClient, store: SqlStore
) -> None:
    """``?state=Failed`` (capitalised) or ``?state=bogus`` was dropped without a word: the
    list showed every instance, and "Cancel all…" from it took every cancellable one. A state
    is read whatever its case; anything else is said on the page, and an action on the
    filter refuses it, changing nothing."""
    from jobplane.domain.models import NewInstance
    from jobplane.domain.states import InstanceState

    await store.create_instances([NewInstance(job_key="greet", args={"name": "a"})])
    shown = (await open_dash.get("/instances", params={"state": "ENQUEUED"})).text
    assert "Left out of the filter" not in shown and 'value="enqueued" checked' in shown
    page = (await open_dash.get("/instances", params={"state": "bogus", "since": "2d"})).text
    assert "Left out of the filter" in page and "<code>bogus</code>" in page
    assert "<code>2d</code>" in page
    hidden = re.findall(r'<input type="hidden" name="(state|since)" value="([^"]*)">', page)
    assert ("state", "bogus") in hidden and ("since", "2d") in hidden  # (the bulk form's)

    csrf = await csrf_of(open_dash, "/instances")
    for filter_ in ({"state": "bogus"}, {"since": "2d"}):
        data = {**filter_, "csrf": csrf, "action": "cancel", "confirmed": "1"}
        refused = await open_dash.post("/instances/bulk-filter", data=data)
        assert refused.status_code == 303
        said = (await open_dash.get(refused.headers["location"])).text
        assert "Nothing done:" in html.unescape(said)
    [waiting] = (await store.list_instances(InstanceFilter())).items
    assert waiting.state is InstanceState.ENQUEUED
