"""The dashboard in a real browser (Debian chromium, headless, driven by Playwright) against a
real `jobplane api`, worker and scheduler on Postgres and Redis, with authentication on.

Every page is saved at desktop and phone width into the test's output directory."""

from __future__ import annotations

import re

import httpx
import pytest
from playwright.sync_api import Browser, Dialog, expect

from tests.fixtures.dashboard import DESKTOP, Cluster, screenshot, sign_in

# One worker runs the module: its cluster and browser (module fixtures) start once.
pytestmark = [pytest.mark.timeout(120), pytest.mark.xdist_group("dashboard")]


def test_login_overview_logout(browser: Browser, cluster: Cluster) -> None:
    context = browser.new_context(viewport=DESKTOP, base_url=cluster.url)
    page = context.new_page()
    page.goto("/")
    expect(page).to_have_url(re.compile(r"/login\?next=/$"))
    screenshot(page, cluster, "login")
    page.get_by_label("API token").fill("jp_not-a-token")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_have_text("Unknown or revoked token.")
    page.get_by_label("API token").fill(cluster.tokens["operator"])
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Overview")).to_be_visible()
    cookie = next(c for c in context.cookies() if c["name"] == "jp_session")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Lax"
    expect(page.locator(".role")).to_have_text("operator")
    # The scheduler leads and the worker is online (both started with the cluster).
    expect(page.get_by_text("Workers online")).to_be_visible()
    expect(page.locator(".facts code").first).not_to_be_empty()
    expect(page.locator(".facts")).to_contain_text(re.compile(r"Workers online\s*1"))
    page.get_by_role("button", name="Sign out").click()
    expect(page).to_have_url(re.compile(r"/login$"))
    page.goto("/")
    expect(page).to_have_url(re.compile(r"/login"))
    context.close()


def test_forged_posts_are_refused(cluster: Cluster) -> None:
    """Without the CSRF token, or with another session's, a POST is 403 and changes nothing."""
    with httpx.Client(base_url=cluster.url) as client:
        form = client.get("/login")
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', form.text)
        assert csrf is not None
        forged = client.post("/login", data={"token": cluster.tokens["admin"]})
        assert forged.status_code == 403
        assert "jp_session" not in forged.headers.get("set-cookie", "")
        with httpx.Client(base_url=cluster.url) as other:
            stolen = other.post("/login", data={"token": cluster.tokens["admin"], "csrf": csrf[1]})
            assert stolen.status_code == 403
        signed = client.post("/login", data={"token": cluster.tokens["admin"], "csrf": csrf[1]})
        assert signed.status_code == 303 and signed.headers["location"] == "/"
        assert client.post("/logout").status_code == 403
        assert client.get("/").status_code == 200  # still signed in


INJECTION = "<img src=x onerror=window.pwned=1><script>window.pwned=2</script>"


def _api(cluster: Cluster, role: str = "operator") -> httpx.Client:
    headers = {"Authorization": f"Bearer {cluster.tokens[role]}"}
    return httpx.Client(base_url=cluster.url, headers=headers)


def test_jobs_list_filters_and_job_page(browser: Browser, cluster: Cluster) -> None:
    page = sign_in(browser, cluster, "operator")
    page.get_by_role("link", name="Jobs", exact=True).click()
    rows = page.locator("table tbody tr")
    expect(rows).to_have_count(5)  # greet, crunch, explode, ship_order, monthly_report
    report = rows.filter(has_text="monthly_report")
    expect(report).to_contain_text("At 03:00, on day 1 of the month")
    expect(report).to_contain_text("Europe/Berlin")
    expect(rows.filter(has_text="greet")).to_contain_text("Manual trigger only")
    screenshot(page, cluster, "jobs")
    page.get_by_label("Kind").select_option("recurring")
    page.get_by_role("button", name="Filter").click()
    expect(rows).to_have_count(1)
    page.get_by_label("Search").fill("nothing-like-this")
    page.get_by_role("button", name="Filter").click()
    expect(page.get_by_text("No job matches these filters.")).to_be_visible()
    page.goto("/jobs?queue=reports")
    page.get_by_role("link", name="monthly_report").click()
    fires = page.locator("ol.fires li")
    expect(fires).to_have_count(10)
    # Monthly at 03:00 Berlin crosses the spring change once: that fire is marked.
    expect(page.locator("ol.fires .badge")).to_have_text(["DST +1 h"])
    screenshot(page, cluster, "job")
    page.once("dialog", lambda d: d.accept())
    page.get_by_role("button", name="Pause").click()
    expect(page.locator(".flash")).to_contain_text("Paused monthly_report")
    expect(page.locator(".page-head .badge-warn")).to_have_text("paused")
    expect(fires).to_have_count(0)
    page.get_by_role("button", name="Resume").click()
    expect(fires).to_have_count(10)
    page.context.close()


def test_trigger_from_the_form_runs_live_and_escapes_args(
    browser: Browser, cluster: Cluster
) -> None:
    page = sign_in(browser, cluster, "operator")
    page.goto("/jobs/crunch")  # no argument model: arguments as JSON
    page.get_by_label("Arguments (JSON)").fill('{"name": ')
    page.get_by_role("button", name="Trigger crunch").click()
    expect(page.locator("#args-error")).to_contain_text("not valid JSON")
    page.goto("/jobs/greet")  # generated from its JSON Schema: one input per argument
    name = page.get_by_label("Name")
    expect(name).to_have_value("")
    page.get_by_label("Priority").fill("high")
    page.get_by_role("button", name="Trigger greet").click()
    expect(page.locator(".field.invalid")).to_have_count(1)  # priority is checked first
    expect(page.locator(".field.invalid")).to_contain_text("valid integer")
    page.get_by_label("Priority").fill("")
    page.get_by_role("button", name="Trigger greet").click()
    expect(name).to_have_attribute("aria-invalid", "true")  # the schema's minLength
    expect(page.locator(".field.invalid")).to_contain_text("non-empty")
    screenshot(page, cluster, "job-trigger")
    name.fill(INJECTION)
    page.get_by_label("excited").check()
    page.get_by_label("Idempotency-Key").fill("dash-greet-1")
    page.get_by_role("button", name="Trigger greet").click()
    expect(page).to_have_url(re.compile(r"/instances/[0-9a-f-]{36}$"))
    # The instance page updates itself until the worker has finished.
    expect(page.locator(".page-head .badge").first).to_have_text("succeeded", timeout=15_000)
    expect(page.locator("#args")).to_contain_text(INJECTION)
    expect(page.locator("#result")).to_contain_text(f"Hello, {INJECTION}!")
    assert page.locator("main img, main script").count() == 0
    assert page.evaluate("window.pwned") is None
    expect(page.locator(".timeline li")).to_have_count(3)  # created, claimed, succeeded
    screenshot(page, cluster, "instance")
    page.context.close()


def test_trigger_with_nested_arguments_adds_and_removes_rows(
    browser: Browser, cluster: Cluster
) -> None:
    """An argument model with a nested object and lists: a fieldset for the address, rows
    added and removed for the order lines, a refusal shown at the row's input."""
    page = sign_in(browser, cluster, "operator")
    page.goto("/jobs/ship_order")
    page.get_by_label("Customer").fill("Ann <b>")
    address = page.locator("#arg-address")
    expect(address.locator("legend")).to_contain_text("Address")
    address.get_by_label("City").fill("Oslo")
    add_line = page.get_by_role("button", name="Add lines item")
    for _ in range(3):
        add_line.click()
    lines = page.locator("#arg-lines .array-row")
    expect(lines).to_have_count(3)
    expect(page.locator("#arg-lines-2-sku")).to_be_focused()  # the row just added
    page.locator("#arg-lines-0-sku").fill("A-1")
    page.locator("#arg-lines-0-quantity").fill("2")
    page.locator("#arg-lines-1-sku").fill("gone")
    page.get_by_role("button", name="Remove item 1 of lines").click()
    expect(lines).to_have_count(2)
    page.locator("#arg-lines-2-sku").fill("B-2")
    page.locator("#arg-lines-2-quantity").fill("0")
    # A list in a row: its own rows, numbered in the row's; text is shown as written.
    serials = page.locator("#arg-lines-2-serials")
    expect(serials).to_contain_text("As printed: SN-__1__-X")
    serials.get_by_role("button", name="Add serials item").click()
    page.locator("#arg-lines-2-serials-0").fill("S-9")
    page.get_by_role("button", name="Add tags item").click()
    page.locator("#arg-tags-0").fill("gift")
    page.get_by_role("button", name="Trigger ship_order").click()
    # Refused by the job's schema at lines[2].quantity: shown there, every row kept.
    quantity = page.locator("#arg-lines-2-quantity")
    expect(quantity).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#arg-lines-2-quantity-error")).to_contain_text("minimum of 1")
    expect(page.locator("#arg-lines-0-sku")).to_have_value("A-1")
    expect(page.locator("#arg-tags-0")).to_have_value("gift")
    screenshot(page, cluster, "job-trigger-nested")
    quantity.fill("3")
    page.get_by_role("button", name="Trigger ship_order").click()
    expect(page).to_have_url(re.compile(r"/instances/[0-9a-f-]{36}$"))
    expect(page.locator(".page-head .badge").first).to_have_text("succeeded", timeout=15_000)
    expect(page.locator("#result")).to_contain_text('"units": 5')
    expect(page.locator("#args")).to_contain_text('"serials": [')
    expect(page.locator("#args")).to_contain_text('"S-9"')
    expect(page.locator("#args")).to_contain_text("Ann <b>")
    page.context.close()


def test_cancel_running_instances_one_and_in_bulk(browser: Browser, cluster: Cluster) -> None:
    with _api(cluster) as api:
        made = [api.post("/api/v1/jobs/crunch/instances", json={}).json() for _ in range(3)]
    page = sign_in(browser, cluster, "operator")
    page.goto(f"/instances/{made[0]['id']}")
    expect(page.locator(".page-head .badge").first).to_have_text("processing", timeout=10_000)
    expect(page.get_by_role("heading", name="Progress")).to_be_visible()
    expect(page.locator("main")).to_contain_text(re.compile(r"step [1-9]\d* of 600"))
    screenshot(page, cluster, "instance-running")
    page.once("dialog", lambda d: d.accept())
    page.get_by_role("button", name="Cancel").click()
    expect(page.locator(".page-head .badge").first).to_have_text("cancelled", timeout=10_000)
    expect(page.get_by_role("button", name="Retry")).to_be_visible()
    # The other two from the list: select them all, and the confirmation counts them.
    page.goto("/instances?job=crunch&state=processing")
    rows = page.locator("#instances tbody tr")
    expect(rows).to_have_count(2, timeout=10_000)
    page.get_by_label("Select every instance shown").check()
    asked: list[str] = []

    def confirm(dialog: Dialog) -> None:
        asked.append(dialog.message)
        dialog.accept()

    page.once("dialog", confirm)
    page.locator("#bulk").get_by_role("button", name="Cancel").click()
    expect(page.locator(".flash-ok")).to_contain_text("told 2 running to stop")
    assert asked == ["Cancel 2 selected instance(s)?"]
    expect(page.locator(".empty")).to_be_visible(timeout=10_000)  # none processing any more
    page.goto("/instances?job=crunch&state=cancelled")
    expect(rows).to_have_count(3, timeout=10_000)
    page.context.close()


def test_instances_list_updates_live_and_pages(browser: Browser, cluster: Cluster) -> None:
    page = sign_in(browser, cluster, "viewer")
    page.goto("/instances?job=greet")
    rows = page.locator("#instances tbody tr")
    before = rows.count()
    with _api(cluster) as api:
        for n in range(3):
            made = api.post("/api/v1/jobs/greet/instances", json={"args": {"name": f"n{n}"}})
            assert made.status_code == 201
    expect(rows).to_have_count(before + 3, timeout=10_000)  # no reload
    expect(rows.first).to_contain_text("succeeded", timeout=10_000)
    screenshot(page, cluster, "instances")
    page.goto("/instances?job=greet&state=succeeded")
    expect(page.get_by_label("succeeded")).to_be_checked()
    expect(rows.filter(has_text="succeeded")).to_have_count(rows.count())
    # The job's duration chart has a bar for each of those runs, each linking to its instance.
    page.goto("/jobs/greet")
    # (drawn by uPlot; its legend names the hovered run's duration)
    plot = page.locator("#durations .u-over")
    expect(plot).to_be_visible()
    expect(page.locator("#durations .u-legend")).to_contain_text("Succeeded")
    box = plot.bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] - 3, box["y"] + box["height"] - 3)
    page.mouse.click(box["x"] + box["width"] - 3, box["y"] + box["height"] - 3)
    expect(page).to_have_url(re.compile(r"/instances/[0-9a-f-]{36}$"))
    page.goto("/jobs/greet")
    screenshot(page, cluster, "job-durations")
    page.context.close()


def test_viewer_sees_no_controls_and_is_refused(browser: Browser, cluster: Cluster) -> None:
    with _api(cluster) as api:
        failed = api.post("/api/v1/jobs/explode/instances", json={}).json()
    page = sign_in(browser, cluster, "viewer")
    expect(page.locator(".error-line").first).to_contain_text(
        "the <b>reactor</b> is not responding", timeout=10_000
    )
    page.goto("/jobs/greet")
    expect(page.get_by_role("heading", name="greet")).to_be_visible()
    for name in ("Trigger greet", "Pause", "Resume"):
        expect(page.get_by_role("button", name=name)).to_have_count(0)
    page.goto(f"/instances/{failed['id']}")
    expect(page.locator(".page-head .badge").first).to_have_text("terminated", timeout=10_000)
    for name in ("Cancel", "Retry", "Run now"):
        expect(page.get_by_role("button", name=name)).to_have_count(0)
    # A forged POST with the viewer's own session and a valid CSRF token: refused by role.
    csrf = page.locator("form[action='/logout'] input[name=csrf]").get_attribute("value")
    assert csrf
    for path, data in (
        ("/jobs/greet/trigger", {"args": '{"name": "x"}'}),
        ("/jobs/monthly_report/pause", {}),
        (f"/instances/{failed['id']}/retry", {}),
    ):
        answer = page.request.post(path, form={**data, "csrf": csrf})
        assert answer.status == 403, (path, answer.status)
    page.context.close()
    with _api(cluster) as api:
        listed = api.get("/api/v1/instances", params={"job": "greet", "limit": 500}).json()
        assert all(i["args"] != {"name": "x"} for i in listed["items"])
        assert api.get("/api/v1/jobs/monthly_report").json()["paused"] is False


def test_forged_post_without_csrf_with_operator_session(browser: Browser, cluster: Cluster) -> None:
    page = sign_in(browser, cluster, "operator")
    answer = page.request.post("/jobs/monthly_report/pause", form={})
    assert answer.status == 403
    answer = page.request.post("/jobs/monthly_report/pause", form={"csrf": "0" * 64})
    assert answer.status == 403
    with _api(cluster) as api:
        assert api.get("/api/v1/jobs/monthly_report").json()["paused"] is False
    page.context.close()


def test_workers_page_shows_busy_slots_live(browser: Browser, cluster: Cluster) -> None:
    page = sign_in(browser, cluster, "viewer")
    page.get_by_role("link", name="Workers", exact=True).click()
    expect(page.locator(".facts")).to_contain_text(re.compile(r"Term\s*1"))
    row = page.locator("#workers tbody tr").filter(has_text="dash-w1")
    expect(row).to_contain_text("online")
    # Two scheduler replicas: one leads, the other is listed as its standby.
    expect(page.locator("#standbys tbody tr")).to_have_count(1, timeout=10_000)
    expect(page.locator("#standbys")).to_contain_text("standing by")
    with _api(cluster) as api:
        made = api.post("/api/v1/jobs/crunch/instances", json={}).json()
        expect(row).to_contain_text(re.compile(r"\b1 / \d+"), timeout=10_000)
        screenshot(page, cluster, "workers")
        assert api.post(f"/api/v1/instances/{made['id']}/cancel").status_code == 200
    expect(row).to_contain_text(re.compile(r"\b0 / \d+"), timeout=10_000)
    page.context.close()


def test_instances_keyset_paging(browser: Browser, cluster: Cluster) -> None:
    with _api(cluster) as api:
        items = [{"job_key": "explode"} for _ in range(55)]
        assert api.post("/api/v1/instances/batch", json={"items": items}).status_code == 201
    page = sign_in(browser, cluster, "viewer")
    page.goto("/instances?job=explode")
    rows = page.locator("#instances tbody tr")
    expect(rows).to_have_count(50)
    first_page = set(rows.locator("td:first-child").all_inner_texts())
    page.get_by_role("link", name="Older →").click()
    expect(page.get_by_role("link", name="← Newest")).to_be_visible()
    older = set(rows.locator("td:first-child").all_inner_texts())
    assert len(older) >= 5 and not older & first_page
    page.context.close()


def test_admin_edits_a_cron_sees_fires_change_and_rolls_back(
    browser: Browser, cluster: Cluster
) -> None:
    page = sign_in(browser, cluster, "admin")
    page.goto("/jobs/monthly_report")
    fires = page.locator("ol.fires li")
    expect(fires.first).to_contain_text("03:00:00")
    cron = page.get_by_label("Cron", exact=True)
    cron.fill("0 0 30 2 *")
    page.get_by_role("button", name="Save options").click()
    expect(page.locator("#opt-cron-error")).to_contain_text("never fires")
    expect(cron).to_have_value("0 0 30 2 *")  # the input is kept
    page.get_by_label("Default priority").fill("12")
    cron.fill("30 6 * * 1-5")
    page.get_by_role("button", name="Save options").click()
    expect(page.locator("#opt-priority-error")).to_contain_text("less than or equal to 9")
    page.get_by_label("Default priority").fill("5")
    # Another admin saves meanwhile: this form's version is stale and the save is explained.
    with _api(cluster, "admin") as api:
        job = api.get("/api/v1/jobs/monthly_report").json()
        other = {"version": job["version"], "options": {"retries": 2}}
        assert api.patch("/api/v1/jobs/monthly_report", json=other).status_code == 200
    page.get_by_role("button", name="Save options").click()
    conflict = page.locator("#options .flash-error")
    expect(conflict).to_contain_text("while you edited it")
    expect(conflict).to_contain_text("(retries changed)")
    expect(cron).to_have_value("30 6 * * 1-5")  # mine, on top of the other edit
    expect(page.get_by_label("Retries")).to_have_value("2")
    page.get_by_role("button", name="Save options").click()
    expect(page.locator(".flash-ok")).to_contain_text("(cron)")  # the other edit is kept
    expect(page.locator(".facts").first).to_contain_text("At 06:30, Monday through Friday")
    expect(fires.first).to_contain_text("06:30:00")
    changes = page.locator("#versions tbody tr").first.locator(".changes")
    expect(changes).to_contain_text("cron 0 3 1 * * → 30 6 * * 1-5")
    screenshot(page, cluster, "job-admin")
    page.once("dialog", lambda d: d.accept())
    page.get_by_role("button", name="Roll back to version 1").click()
    expect(page.locator(".flash-ok")).to_contain_text("options of version 1")
    expect(fires.first).to_contain_text("03:00:00")
    expect(fires).to_have_count(10)
    page.context.close()


def test_overview_after_activity(browser: Browser, cluster: Cluster) -> None:
    """Last in this module: the overview once the tests above have run jobs."""
    page = sign_in(browser, cluster, "viewer")
    page.reload()  # without the "signed in" message
    expect(page.locator("[data-state-count=succeeded]")).not_to_have_text("0")
    expect(page.locator("[data-state-count=terminated]")).not_to_have_text("0")
    # Both charts drawn (uPlot canvases), with the hour's counts in their legends and tables.
    expect(page.locator(".chart canvas")).to_have_count(2)
    expect(page.locator(".chart .u-legend").first).to_contain_text("Failed")
    page.get_by_text("Last hour as a table").click()
    expect(page.locator(".chart-data table").first).not_to_contain_text("Nothing ended")
    expect(page.locator(".error-line").first).to_contain_text("ValueError")
    screenshot(page, cluster, "overview")
    page.context.close()


def test_cancel_everything_a_filter_selects(browser: Browser, cluster: Cluster) -> None:
    with _api(cluster) as api:
        for n in range(3):
            later = {"args": {"name": f"later{n}"}, "delay_s": 3600}
            assert api.post("/api/v1/jobs/greet/instances", json=later).status_code == 201
    page = sign_in(browser, cluster, "operator")
    page.goto("/instances?job=greet&state=scheduled")
    expect(page.locator("#instances tbody tr")).to_have_count(3, timeout=10_000)
    page.get_by_role("button", name="Cancel all…").click()
    expect(page.get_by_role("heading", name="Cancel 3 instances?")).to_be_visible()
    screenshot(page, cluster, "bulk-confirm")
    page.get_by_role("button", name="Cancel 3").click()
    expect(page.locator(".flash-ok")).to_contain_text("Cancelled 3")
    expect(page.locator(".empty")).to_be_visible(timeout=10_000)  # none scheduled any more
    page.context.close()


def test_app_scope_has_a_stable_url(browser: Browser, cluster: Cluster) -> None:
    page = sign_in(browser, cluster, "viewer")
    page.goto("/jobs")
    page.get_by_label("App").select_option("dashboard-tests")
    page.get_by_role("button", name="Filter").click()
    expect(page).to_have_url(re.compile(r"/jobs\?.*app=dashboard-tests"))
    page.goto("/apps/dashboard-tests")
    expect(page).to_have_url(re.compile(r"/apps/dashboard-tests/$"))
    expect(page.locator(".scope")).to_contain_text("dashboard-tests")
    expect(page.locator(".chart canvas")).to_have_count(2)
    screenshot(page, cluster, "app-overview")
    page.get_by_role("link", name="Workers", exact=True).click()
    expect(page).to_have_url(re.compile(r"/apps/dashboard-tests/workers$"))
    expect(page.locator("#workers tbody tr").first).to_be_visible()  # the test cluster's
    page.get_by_role("link", name="Jobs", exact=True).click()
    expect(page).to_have_url(re.compile(r"/apps/dashboard-tests/jobs$"))
    expect(page.locator("table tbody tr").first).to_be_visible()
    screenshot(page, cluster, "app-jobs")
    page.get_by_role("link", name="Instances", exact=True).click()
    expect(page).to_have_url(re.compile(r"/apps/dashboard-tests/instances$"))
    page.goto("/apps/nobody/jobs")
    expect(page.locator(".empty")).to_contain_text("No job matches")
    page.context.close()
