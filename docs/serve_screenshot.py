"""Makes docs/serve.png, the screenshot of `ralph-mail serve`'s page: a small team
mid-work in a temporary home, shown in Debian's headless chromium (selenium with the
system chromedriver).

    python docs/serve_screenshot.py docs
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

os.environ["RALPH_HOME"] = tempfile.mkdtemp(prefix="ralph-shot-")  # never a real home

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as seen
from selenium.webdriver.support.ui import WebDriverWait

from ralph_mail import MessageBus, create_team
from ralph_mail.govern.policy import Rule
from ralph_mail.team import update_team

create_team("studio", ["lead", ("writer", "drafts posts"), ("analyst", "explains the numbers"),
                       ("maria", "signs off releases")])  # fmt: skip
update_team("studio", member="maria", human=True)
lead, writer, analyst = (MessageBus("studio", name) for name in ("lead", "writer", "analyst"))
lead.change_policy(lambda p: p.with_rule(Rule("writer", "*", "allow", approval=True)))
writer.set_presence("working")
analyst.set_presence("idle")
lead.send("writer", "text", "Draft the Q4 update for the board", visibility="user_visible")
lead.delegate("writer", "Write the Q4 update", id="T-1")
analyst.delegate("writer", "Chart the Q4 revenue", id="T-1.1", parent="T-1")
writer.send("analyst", "text", "which quarter's baseline do we use?")
analyst.send("lead", "status_update", "numbers checked", metadata={"state": "working"})
writer.send("lead", "text", "Draft ready: 'Q4: revenue up 12%'. Publish it to the blog?")

server = subprocess.Popen([sys.executable, "-m", "ralph_mail", "serve", "--team", "studio",
                           "--port", "0"], stdout=subprocess.PIPE)  # fmt: skip
asker = None
try:
    assert server.stdout is not None
    url = server.stdout.readline().decode().split(" at ", 1)[1].strip()
    asker = subprocess.Popen([sys.executable, "-m", "ralph_mail", "ask", "maria",
                              "Can we ship the Q4 post on Friday?", "--team", "studio",
                              "--agent", "analyst", "--timeout", "60"],
                             stdout=subprocess.DEVNULL)  # fmt: skip
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "chromium"
    for flag in ("--headless=new", "--no-sandbox", "--window-size=1200,860",
                 "--hide-scrollbars", "--force-device-scale-factor=1"):  # fmt: skip
        options.add_argument(flag)
    service = Service(executable_path=shutil.which("chromedriver") or "chromedriver")
    browser = webdriver.Chrome(service=service, options=options)
    try:
        browser.get(url)
        WebDriverWait(browser, 30).until(
            seen.presence_of_element_located((By.CSS_SELECTOR, "#questions .card"))
        )
        time.sleep(0.5)  # the fonts settle
        browser.save_screenshot(os.path.join(sys.argv[1] if len(sys.argv) > 1 else ".",
                                             "serve.png"))  # fmt: skip
    finally:
        browser.quit()
finally:
    for child in (asker, server):
        if child is not None:
            child.terminate()
            child.wait()
    shutil.rmtree(os.environ["RALPH_HOME"], ignore_errors=True)
