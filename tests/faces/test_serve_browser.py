"""The page of `ralph-mail serve` in a real browser: Debian's chromium, headless, driven
by selenium with the system chromedriver (nothing downloads a browser). Skipped, saying
why, where chromium or selenium is not installed."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="needs the serve extra: pip install 'ralph_mail[serve]'")
pytest.importorskip("selenium", reason="needs selenium: pip install 'ralph_mail[test]'")

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support import expected_conditions as seen
from selenium.webdriver.support.ui import WebDriverWait

from ralph_mail import MessageBus, Team, create_team
from ralph_mail.govern.policy import Rule
from ralph_mail.team import load_team, update_team
from tests.helpers.processes import BOUND_S, Processes, cli_env, wait_until
from tests.helpers.serving import serve

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs Debian's chromium and chromedriver: apt-get install chromium chromium-driver",
)


def chromium(tmp_path: Path) -> WebDriver:
    """Headless chromium, the system's own binary and driver."""
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--disable-gpu", "--window-size=1280,900",
                 f"--user-data-dir={tmp_path / 'chromium'}"):  # fmt: skip
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)


@pytest.fixture
def people(home: Path) -> Team:
    """Team 'demo': lead, alice (a person), writer; writer's contact with lead is held."""
    create_team("demo", ["lead", ("alice", "decides releases"), ("writer", "writes")], home=home)
    update_team("demo", home, member="alice", human=True)
    with MessageBus("demo", "lead", home) as lead:
        lead.change_policy(lambda p: p.with_rule(Rule("writer", "lead", "allow", approval=True)))
    return load_team("demo", home)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    driver = chromium(tmp_path)
    try:
        yield driver
    finally:
        driver.quit()


def until(driver: WebDriver, condition: object) -> object:
    return WebDriverWait(driver, BOUND_S).until(condition)  # type: ignore[arg-type]


def shows(driver: WebDriver, pane: str, text: str) -> None:
    """Wait until pane ``pane`` of the page shows ``text``."""
    until(driver, seen.text_to_be_present_in_element((By.ID, pane), text))


def open_page(procs: Processes, people: Team, driver: WebDriver, pane: str, text: str) -> None:
    """Serve team demo and open its page, once pane ``pane`` shows ``text``."""
    driver.get(serve(procs, people.home).url)
    shows(driver, pane, text)


def test_a_click_on_approve_delivers_the_held_message(
    procs: Processes, people: Team, browser: WebDriver
) -> None:
    open_page(procs, people, browser, "approvals", "nothing waits")
    with MessageBus("demo", "writer", people.home) as writer:
        held = writer.send("lead", "text", "may I publish the draft?")
    button = until(browser, seen.element_to_be_clickable(
        (By.CSS_SELECTOR, f'#approvals [data-id="{held.id}"] button.approve')))  # fmt: skip
    button.click()  # type: ignore[attr-defined]

    def delivered() -> bool:
        with MessageBus("demo", "lead", people.home) as lead:
            return any(m.id == held.id for m in lead.peek())

    wait_until(delivered, "the approved message in lead's inbox")
    shows(browser, "approvals", "nothing waits")
    # what was said shows in the conversation, the internal part folded
    fold = until(browser, seen.presence_of_element_located(
        (By.CSS_SELECTOR, "#conversation details.internal summary")))  # fmt: skip
    assert fold.text.startswith("Internal agent messages (")  # type: ignore[attr-defined]


def test_an_answer_typed_in_the_page_reaches_the_askers_ask(
    procs: Processes, people: Team, browser: WebDriver
) -> None:
    open_page(procs, people, browser, "questions", "no question")
    asking = subprocess.Popen(
        [sys.executable, "-m", "ralph_mail", "ask", "alice", "Ship on Friday?", "--team",
         "demo", "--agent", "writer", "--timeout", str(BOUND_S)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env(people.home),
    )  # fmt: skip
    procs.started.append(asking)
    box = until(browser, seen.element_to_be_clickable(
        (By.CSS_SELECTOR, "#questions .card textarea")))  # fmt: skip
    assert "Ship on Friday?" in browser.find_element(By.ID, "questions").text
    box.send_keys("Yes, ship it on Friday")  # type: ignore[attr-defined]
    browser.find_element(By.CSS_SELECTOR, "#questions .card button.answer").click()
    out, err = asking.communicate(timeout=BOUND_S)
    assert asking.returncode == 0, err
    assert out.decode().strip() == "Yes, ship it on Friday"
    shows(browser, "questions", "no question")
