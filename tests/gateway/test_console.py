"""The web console (``/console``) in a real headless Chromium driven by Selenium, against one
live gateway: sign-in per role, the receipt check the browser does itself (and its failure on
a tampered proof, event or key), an app key confined to its own events by the server, CSRF
refusals, the CSP and no request leaving the gateway's origin, key creation and revocation.

With ``SPECGATE_CONSOLE_SCREENSHOTS=DIR`` the last test saves a PNG of every page there (the
ones in docs/console/ were made so)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait
from typer.testing import CliRunner

from gateway.audit.mac import EventMac
from gateway.audit.signing import load_or_create_private_key, public_key_pem
from gateway.console.session import SESSION_TTL_S, SessionKeys
from tests.api_harness import LiveGateway, fresh_database, gateway_settings, live_gateway
from tests.audit_helpers import admin_cli
from tests.tiny_models import build_pair

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CHAT = {"model": "target", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
WITNESS = "console-witness"
PAGES = {
    "auditor": ["/console/status", "/console/events", "/console/privacy", "/console/report"],
    "admin": ["/console/models", "/console/keys", "/console/usage"],
    "app": ["/console/events"],
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    root = tmp_path_factory.mktemp("console")
    witness = root / "witness"
    witness.mkdir()
    key = load_or_create_private_key(witness / "witness-key.pem")
    (witness / "witness-public-key.pem").write_bytes(public_key_pem(key.public_key()))
    with fresh_database() as (name, url):
        settings = gateway_settings(
            build_pair(root / "models"),
            root / "data",
            url,
            witness_public_key_path=witness / "witness-public-key.pem",
            witness_name=WITNESS,
        )
        with live_gateway(settings, name) as live:
            args = ["audit", "witness", "--url", live.base_url, "--key", live.keys["auditor"]]
            args += ["--state", str(witness), "--name", WITNESS]
            result = CliRunner().invoke(admin_cli(), args)
            assert result.exit_code == 0, result.output
            yield live


@pytest.fixture(scope="module")
def browser() -> Iterator[webdriver.Chrome]:
    assert Path(CHROMIUM).exists(), "chromium is missing: `apt-get install -y chromium`"
    options = Options()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1200,860"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def chat(gateway: LiveGateway, key: str) -> httpx.Response:
    response = httpx.post(
        gateway.base_url + "/v1/chat/completions",
        json=CHAT,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response


def sign_in(driver: WebDriver, gateway: LiveGateway, key: str) -> None:
    driver.get(gateway.base_url + "/console/login")
    driver.delete_all_cookies()
    driver.get(gateway.base_url + "/console/login")
    driver.find_element(By.ID, "key").send_keys(key)
    driver.find_element(By.ID, "sign-in").click()
    WebDriverWait(driver, 10).until(lambda d: "/console/login" not in d.current_url)


def verdict(driver: WebDriver) -> str:
    """The in-browser check's verdict, once it has one."""
    element = driver.find_element(By.ID, "browser-verdict")
    WebDriverWait(driver, 10).until(lambda _: element.get_attribute("data-verdict") != "running")
    return str(element.get_attribute("data-verdict"))


def console_client(gateway: LiveGateway, key: str) -> httpx.Client:
    """An HTTP client signed in through the form, as a browser would be."""
    client = httpx.Client(base_url=gateway.base_url, timeout=30)
    form = client.get("/console/login")
    csrf = re.search(r"name='csrf' value='([^']+)'", form.text)
    assert csrf is not None
    signed = client.post("/console/login", data={"key": key, "csrf": csrf.group(1)})
    assert signed.status_code == 303, signed.text
    return client


def csrf_of(page: str) -> str:
    found = re.search(r"name='csrf' value='([^']+)'", page)
    assert found is not None
    return found.group(1)


def test_each_role_signs_in_to_its_pages_and_no_other(
    gateway: LiveGateway, browser: webdriver.Chrome
) -> None:
    landing = {"auditor": "Audit log status", "admin": "Models", "app": "My requests' events"}
    for role, title in landing.items():
        key = gateway.keys[role]
        sign_in(browser, gateway, key)
        assert browser.current_url == gateway.base_url + PAGES[role][0]
        assert browser.find_element(By.TAG_NAME, "h1").text == title
        cookie = browser.get_cookie("sg_console")
        assert cookie is not None and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert not cookie["secure"]  # plain http here; Secure whenever the scheme is https
        assert key not in cookie["value"] and key not in browser.current_url
        for other, paths in PAGES.items():
            if other == role:
                continue
            for path in set(paths) - set(PAGES[role]):
                browser.get(gateway.base_url + path)
                assert "Not for this key" in browser.title, (role, path)
    browser.delete_all_cookies()
    browser.get(gateway.base_url + "/console/status")
    assert browser.current_url.endswith("/console/login")
    browser.find_element(By.ID, "key").send_keys("sg-not-a-key")
    browser.find_element(By.ID, "sign-in").click()
    error = WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "login-error"))
    assert "Incorrect or revoked key" in error.text
    # A session ends with its key: revoked, the cookie no longer opens a page.
    fleeting = gateway.services.keys.create("auditor", "console-fleeting", "tests")[1]
    client = console_client(gateway, fleeting)
    assert client.get("/console/status").status_code == 200
    gateway.services.keys.revoke("console-fleeting", "tests")
    gone = client.get("/console/status")
    assert gone.status_code == 303 and gone.headers["location"] == "/console/login"


def test_the_browser_verifies_a_receipt_and_fails_a_tampered_one(
    gateway: LiveGateway, browser: webdriver.Chrome
) -> None:
    response = chat(gateway, gateway.keys["app"])
    audit_id = response.headers["x-specgate-audit-id"]
    sign_in(browser, gateway, gateway.keys["auditor"])
    browser.get(f"{gateway.base_url}/console/events/{audit_id}")
    assert verdict(browser) == "verified"
    steps = browser.find_element(By.ID, "browser-steps").text
    assert response.headers["x-specgate-audit-leaf-hash"] in steps
    assert "verified" in browser.find_element(By.ID, "server-verdict").text
    data = browser.find_element(By.ID, "receipt-data").get_attribute("textContent")
    original = json.loads(str(data))
    assert original["inclusion_proof"], "a proof of at least one hash"

    def check_with(receipt: dict[str, object], key: str | None = None) -> tuple[str, str]:
        browser.execute_script(
            "document.getElementById('receipt-data').textContent = arguments[0];"
            "if (arguments[1]) document.getElementById('public-key').value = arguments[1];",
            json.dumps(receipt),
            key,
        )
        browser.find_element(By.ID, "verify-button").click()
        return verdict(browser), browser.find_element(By.ID, "browser-steps").text

    flipped = bytearray(base64.b64decode(original["inclusion_proof"][0]))
    flipped[0] ^= 1
    proof = [base64.b64encode(bytes(flipped)).decode(), *original["inclusion_proof"][1:]]
    result, steps = check_with({**original, "inclusion_proof": proof})
    assert result == "failed" and "does not lead to the checkpoint's root" in steps
    event = base64.b64decode(original["canonical"]).replace(b'"kind":"request"', b'"kind":"x"')
    result, steps = check_with({**original, "canonical": base64.b64encode(event).decode()})
    assert result == "failed" and "do not hash to its event_hash" in steps
    result, steps = check_with({**original, "leaf_index": original["leaf_index"] - 1})
    assert result == "failed"
    other = public_key_pem(Ed25519PrivateKey.generate().public_key()).decode()
    result, steps = check_with(original, other)
    assert result == "failed" and "no signature by this public key" in steps
    served = gateway.services.signer.public_key_pem().decode()
    assert check_with(original, served)[0] == "verified"
    # The app that made the request checks its own receipt the same way.
    sign_in(browser, gateway, gateway.keys["app"])
    browser.get(f"{gateway.base_url}/console/events/{audit_id}")
    assert verdict(browser) == "verified"


def test_an_app_key_sees_only_its_own_events(
    gateway: LiveGateway, browser: webdriver.Chrome
) -> None:
    mine = chat(gateway, gateway.keys["app"]).headers["x-specgate-audit-id"]
    other_key = gateway.services.keys.create("app", "console-other-app", "tests")[1]
    theirs = chat(gateway, other_key).headers["x-specgate-audit-id"]
    record = gateway.services.audit.event(theirs)
    assert record is not None and record.actor is not None
    other_id = record.actor
    sign_in(browser, gateway, gateway.keys["app"])
    listed = browser.find_element(By.ID, "events").text
    assert mine in listed and theirs not in listed
    # Asking for the other key's events, or for its event, is refused by the server.
    client = console_client(gateway, gateway.keys["app"])
    search = client.get("/console/events", params={"key": other_id, "kind": "request"})
    assert search.status_code == 200 and theirs not in search.text and mine in search.text
    for path in (f"/console/events/{theirs}", f"/console/events/{theirs}/receipt.json"):
        refused = client.get(path)
        assert refused.status_code == 404 and other_id not in refused.text
    assert client.get(f"/console/events/{mine}/receipt.json").json()["event"]["event_id"] == mine
    # An auditor sees both, and can search by key name.
    auditor = console_client(gateway, gateway.keys["auditor"])
    both = auditor.get("/console/events", params={"key": "console-other-app"}).text
    assert theirs in both and mine not in both


def test_forms_without_the_csrf_token_are_refused(gateway: LiveGateway) -> None:
    client = console_client(gateway, gateway.keys["admin"])
    token = csrf_of(client.get("/console/keys").text)
    names = {key.name for key in gateway.services.keys.list()}
    for data, headers in (
        ({"name": "csrf-none", "role": "app"}, {}),
        ({"name": "csrf-wrong", "role": "app", "csrf": "0" * 32}, {}),
        ({"name": "csrf-cross", "role": "app", "csrf": token}, {"origin": "http://evil.test"}),
    ):
        refused = client.post("/console/keys", data=data, headers=headers)
        assert refused.status_code == 403 and "csrf-refused" in refused.text
    assert {key.name for key in gateway.services.keys.list()} == names
    victim = gateway.services.keys.list()[0]
    assert client.post(f"/console/keys/{victim.key_id}/revoke").status_code == 403
    assert client.post("/console/logout").status_code == 403
    assert client.get("/console/keys").status_code == 200  # still signed in
    created = client.post("/console/keys", data={"name": "csrf-ok", "role": "app", "csrf": token})
    assert created.status_code == 201
    assert "csrf-ok" in {key.name for key in gateway.services.keys.list()}
    # Signing in needs the form's own token too (no login CSRF).
    fresh = httpx.post(gateway.base_url + "/console/login", data={"key": gateway.keys["admin"]})
    assert fresh.status_code == 403 and "sg_console=" not in fresh.headers.get("set-cookie", "")


def test_every_page_has_a_strict_csp_and_loads_nothing_from_elsewhere(
    gateway: LiveGateway, browser: webdriver.Chrome
) -> None:
    def check(client: httpx.Client, path: str) -> None:
        response = client.get(path)
        assert response.status_code == 200, path
        csp = response.headers["content-security-policy"]
        for directive in ("default-src 'self'", "script-src 'self'", "frame-ancestors 'none'"):
            assert directive in csp, (path, directive)
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
        for tag in re.findall(r"<script[^>]*>", response.text):  # no inline script
            assert "src=" in tag or "application/json" in tag, (path, tag)
        assert not re.search(r"<[^>]*\son[a-z]+\s*=", response.text), path
        for url in re.findall(r"(?:src|href|action)=['\"]([^'\"]+)", response.text):
            assert url.startswith(("/", "#")), (path, url)
        browser.get_log("browser")  # what earlier pages logged
        browser.get(gateway.base_url + path)
        loaded = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
        )
        assert loaded and all(u.startswith(gateway.base_url) for u in loaded), (path, loaded)
        severe = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not severe, (path, severe)

    browser.get(gateway.base_url + "/console/login")
    browser.delete_all_cookies()
    check(httpx.Client(base_url=gateway.base_url), "/console/login")
    audit_id = chat(gateway, gateway.keys["app"]).headers["x-specgate-audit-id"]
    for role, paths in PAGES.items():
        client = console_client(gateway, gateway.keys[role])
        sign_in(browser, gateway, gateway.keys[role])
        for path in [*paths, *([f"/console/events/{audit_id}"] if role != "admin" else [])]:
            check(client, path)
    # The compliance report (matplotlib charts with inline styles) is sandboxed instead: an
    # opaque origin where no script runs and nothing is fetched.
    client = console_client(gateway, gateway.keys["auditor"])
    period = {"since": "2020-01-01", "until": "2100-01-01"}
    report = client.get("/console/report/view", params=period)
    assert report.status_code == 200 and "Record of processing activities" in report.text
    csp = report.headers["content-security-policy"]
    assert csp.startswith("sandbox;") and "default-src 'none'" in csp and "script" not in csp
    assert "frame-ancestors 'none'" in csp and "<script" not in report.text


def test_an_admin_creates_and_revokes_a_key_in_the_browser(
    gateway: LiveGateway, browser: webdriver.Chrome
) -> None:
    sign_in(browser, gateway, gateway.keys["admin"])
    models = browser.find_element(By.CSS_SELECTOR, "[data-model='target']").text
    assert "ngram" in models and "draft" in models and ("on" in models or "OFF" in models)
    browser.get(gateway.base_url + "/console/keys")
    browser.find_element(By.CSS_SELECTOR, "#create-key input[name=name]").send_keys("from-console")
    browser.find_element(By.CSS_SELECTOR, "#create-key button").click()
    plaintext = WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "new-key")).text
    assert plaintext.startswith("sg-") and plaintext not in browser.current_url
    models_url = gateway.base_url + "/v1/models"
    auth = {"authorization": f"Bearer {plaintext}"}
    assert httpx.get(models_url, headers=auth).status_code == 200
    browser.find_element(By.CSS_SELECTOR, "button[data-revoke='from-console']").click()
    WebDriverWait(browser, 10).until(
        lambda d: not d.find_elements(By.CSS_SELECTOR, "button[data-revoke='from-console']")
    )
    assert httpx.get(models_url, headers=auth).status_code == 401


def test_screenshots_of_every_page(
    gateway: LiveGateway, browser: webdriver.Chrome, tmp_path: Path
) -> None:
    out = Path(os.environ.get("SPECGATE_CONSOLE_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    privacy = gateway.services.privacy
    privacy.place_hold(privacy.subject_ref("user:alice"), "tests")
    privacy.erase_subject(privacy.subject_ref("user:bob"), "tests")
    audit_id = chat(gateway, gateway.keys["app"]).headers["x-specgate-audit-id"]
    shots: list[tuple[str, str, str]] = [
        ("auditor", "/console/status", "status"),
        ("auditor", "/console/events", "events"),
        ("auditor", f"/console/events/{audit_id}", "event-receipt"),
        ("auditor", "/console/privacy", "privacy"),
        ("auditor", "/console/report", "report"),
        ("admin", "/console/models", "models"),
        ("admin", "/console/keys", "keys"),
        ("admin", "/console/usage", "usage"),
        ("app", "/console/events", "app-events"),
    ]
    browser.get(gateway.base_url + "/console/login")
    browser.delete_all_cookies()
    browser.get(gateway.base_url + "/console/login")
    browser.save_screenshot(str(out / "login.png"))
    role = None
    for who, path, name in shots:
        if who != role:
            sign_in(browser, gateway, gateway.keys[who])
            role = who
        browser.set_window_size(1200, 400)
        browser.get(gateway.base_url + path)
        if name == "event-receipt":
            assert verdict(browser) == "verified"
        height = browser.execute_script("return document.documentElement.scrollHeight")
        browser.set_window_size(1200, min(int(height) + 160, 1500))
        browser.save_screenshot(str(out / f"{name}.png"))
    assert len(list(out.glob("*.png"))) >= len(shots) + 1


def test_a_session_token_is_refused_once_forged_changed_or_expired() -> None:
    keys = SessionKeys(EventMac(b"k" * 32))
    session = keys.issue("key_1", "app", now=1000.0)
    assert keys.read(session.token, now=1001.0) == session
    assert keys.read(session.token, now=1000.0 + SESSION_TTL_S) is None  # expired
    body, mac = session.token.split(".")
    elevated = base64.urlsafe_b64encode(
        base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)).replace(b"|app|", b"|admin|")
    ).decode().rstrip("=")
    assert keys.read(f"{elevated}.{mac}", now=1001.0) is None  # another role, same MAC
    other = SessionKeys(EventMac(b"o" * 32))  # another gateway's MAC key
    assert other.read(session.token, now=1001.0) is None
    # A session MAC is not an event MAC under the same key, nor the reverse.
    assert not EventMac(b"k" * 32).valid(body.encode(), mac)
    assert keys.csrf_ok(session.token, keys.csrf(session.token))
    assert not keys.csrf_ok(session.token, other.csrf(session.token))
