"""A solution notebook in a real browser: JupyterLab, headless Chromium, widgets and figures.

nbval and nbclient run the notebooks' code, but not what a learner sees: the widget controls
are drawn by JavaScript in the browser (ipywidgets' front end, JupyterLab's renderers), and
an unmatched front end shows "Error displaying widget" over code that ran fine. This test does
what a learner does in ``make lab``: JupyterLab serves a copy of solutions/10 (a figure inside
an ``interact`` whose sliders drive it, and figures in plain cells), headless Chromium opens
it, Run > Run All Cells runs it, and then the page must show

* every code cell run, and no error output (a traceback) in any cell;
* the widget controls drawn (sliders, no "Error displaying widget", no "Loading widget..."
  left), and moving a slider with the keyboard re-runs the function in the kernel;
* figures: loaded images in the outputs, one of them inside the widget's output.

Chromium and its driver are Debian's (``apt-get install chromium chromium-driver``: .ci/run
installs them when it can), driven through Selenium (the test extras) with the driver's path
given, so nothing is downloaded; without them the test skips and says so. JupyterLab runs
on a free localhost port with a token and its own settings, runtime and workspace folders in
the test's tmp dir. Every wait has a timeout, JupyterLab, its kernel (and the kernel's
workers) and Chromium are ended in a ``finally``, and a failure saves a screenshot and the
page's text under the tmp dir and names them in its message.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "solutions" / "10_context_parallel.ipynb"   # light: one short 4-rank launch, an interact
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
CODE_CELLS = sum(c["cell_type"] == "code" for c in json.loads(NOTEBOOK.read_text(encoding="utf-8"))["cells"])
START_TIMEOUT, RUN_TIMEOUT, WIDGET_TIMEOUT = 60, 180, 60   # s, generous; summed, under pytest's 600 s timeout

pytestmark = [
    pytest.mark.multiprocess, pytest.mark.notebook,   # it starts JupyterLab, a kernel and Chromium
    pytest.mark.skipif(not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)),
                       reason=f"no Chromium ({CHROMIUM}) or chromedriver ({CHROMEDRIVER}): install Debian's "
                              "`chromium chromium-driver` (.ci/run does, as root) to run the browser test"),
]
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is missing: pip install -e '.[test]'")
pytest.importorskip("jupyterlab", reason="JupyterLab is missing: pip install -e '.[lab]'")
pytest.importorskip("ipywidgets", reason="ipywidgets is missing: pip install -e '.[lab]'")
import psutil  # noqa: E402  (test extras)
from selenium.common.exceptions import TimeoutException, WebDriverException  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.expected_conditions import element_to_be_clickable  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

# JupyterLab's user settings: every cell kept in the page (the default windowing leaves cells far
# from the viewport out of the DOM), the notebook's kernel started without asking, no autosave, no
# news or update check (no network here).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker": {"windowingMode": "none", "autoStartDefaultKernel": True},
    "@jupyterlab/docmanager-extension/plugin": {"autosave": False},
    "@jupyterlab/apputils-extension/notification": {"fetchNews": "false", "checkForUpdates": False},
}
# The flags this closed network needs (no background connections), a fresh profile, a tall window.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1400,2400"]

# What the page shows, read in one call: the code cells' prompts ("[3]:" ran, "[*]:" running or
# queued, "[ ]:" never ran), the kernel's status, error outputs (a traceback, or a SyntaxError's
# last line; a warning on stderr is no error), widgets and images.
PAGE_STATE_JS = """
const all = (sel, root = document) => [...root.querySelectorAll(sel)];
const shown = all('.jp-OutputArea-output').map(e => e.innerText).join('\\n');
const stderr = all('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stderr"]').map(e => e.innerText);
const loaded = img => img.complete && img.naturalWidth > 0;
return {
  dialog: (document.querySelector('.jp-Dialog') || {}).innerText || null,
  prompts: all('.jp-Notebook .jp-CodeCell .jp-InputArea-prompt').map(e => e.innerText.trim()),
  kernel: (document.querySelector('.jp-Notebook-ExecutionIndicator') || {dataset: {}}).dataset.status || null,
  errors: stderr.filter(t => /Traceback|^\\w+(Error|Exception)\\b/m.test(t)),
  widgets: all('.jp-OutputArea-output .jupyter-widgets').length,
  sliders: all('.jp-OutputArea-output .widget-slider').length,
  error_displaying: shown.includes('Error displaying widget'),
  loading_widget: shown.includes('Loading widget...'),
  images: all('.jp-OutputArea-output img').filter(loaded).length,
  widget_images: all('.widget-output img').filter(loaded).length,
  widget_text: all('.widget-output').map(e => e.innerText).join('\\n'),
};
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[psutil.Process]:
    """A process and every process below it (a kernel is its own session: a group kill would miss it)."""
    try:
        top = psutil.Process(pid)
        return [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _stop(procs: list[psutil.Process], timeout: float = 15.0) -> None:
    """SIGTERM, then SIGKILL what is left after ``timeout`` seconds."""
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=timeout)


class Lab(NamedTuple):
    """A running JupyterLab: where it serves, its token, its log."""
    url: str
    token: str
    log: Path

    def api(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.url}/api/{path}?token={self.token}", timeout=5) as reply:
            return json.load(reply)

    def kernel_connected(self) -> bool:
        """A kernel is up, idle, and the page holds a connection to it: a click on Run now runs."""
        try:
            return any(k["execution_state"] == "idle" and k["connections"] for k in self.api("kernels"))
        except OSError:   # a slow answer: ask again at the next poll
            return False


@pytest.fixture
def jupyterlab(tmp_path: Path) -> Iterator[Lab]:
    """JupyterLab serving a copy of the notebook (the run never writes into solutions/)."""
    root, home = tmp_path / "lab", tmp_path / "jupyter"
    root.mkdir()
    shutil.copy(NOTEBOOK, root / NOTEBOOK.name)
    for plugin, values in LAB_SETTINGS.items():
        path = home / "settings" / f"{plugin}.jupyterlab-settings"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values), encoding="utf-8")
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(home / "config"), "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
           "JUPYTERLAB_SETTINGS_DIR": str(home / "settings"), "JUPYTERLAB_WORKSPACES_DIR": str(home / "workspaces"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    port, token = _free_port(), secrets.token_hex(16)
    argv = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}", "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={root}", "--ServerApp.terminals_enabled=False"]
    argv += ["--allow-root"] if os.geteuid() == 0 else []
    log = tmp_path / "jupyterlab.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    try:
        lab = Lab(f"http://127.0.0.1:{port}", token, log)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if server.poll() is not None:
                pytest.fail(f"JupyterLab exited with {server.returncode} before serving; its log: {log}\n"
                            + log.read_text(errors="replace")[-3000:])
            try:
                lab.api("status")
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"JupyterLab did not answer within {START_TIMEOUT} s; its log: {log}")
                time.sleep(0.5)
        yield lab
    finally:
        _stop(_tree(server.pid))


@pytest.fixture
def chromium(tmp_path: Path) -> Iterator[Any]:
    """Headless Chromium under Selenium, on Debian's chromedriver (named: Selenium Manager never runs)."""
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium-profile'}"]:
        options.add_argument(flag)
    log = tmp_path / "chromedriver.log"
    service = webdriver.ChromeService(executable_path=CHROMEDRIVER, log_output=str(log))
    try:
        driver = webdriver.Chrome(service=service, options=options)
    except WebDriverException as exc:
        driver = None   # fail outside the handler: chromedriver's log says more than selenium's traceback
        problem = exc.msg
    if driver is None:
        pytest.fail(f"Chromium did not start under chromedriver: {problem}\nchromedriver's log: {log}")
    try:
        driver.set_page_load_timeout(START_TIMEOUT)
        driver.set_script_timeout(30)
        yield driver
    finally:
        left = _tree(service.process.pid) if service.process else []   # read before quit orphans them
        try:
            driver.quit()
        finally:
            _stop(left)


class Page:
    """The notebook page: its state in one read, waits with a timeout, and evidence on failure."""

    def __init__(self, driver: Any, evidence_dir: Path, server_log: Path) -> None:
        self.driver, self.evidence_dir, self.server_log = driver, evidence_dir, server_log

    def state(self) -> dict:
        return self.driver.execute_script(PAGE_STATE_JS)

    def wait(self, what: str, done: Callable[[dict], bool], timeout: float) -> dict:
        try:   # a dialog (a kernel to choose, an error to acknowledge) ends the wait: nobody will click it
            state = WebDriverWait(self.driver, timeout, poll_frequency=0.5).until(
                lambda _: (lambda s: (done(s) or s["dialog"]) and s)(self.state()))
        except TimeoutException:
            state = None   # fail outside the handler: the message is the evidence, not a chained selenium traceback
        if state is None or state["dialog"]:
            self.fail(f"waited {timeout} s for {what}" if state is None else
                      f"a dialog is in the way while waiting for {what}: {state['dialog']!r}")
        return state

    def click(self, what: str, by: str, selector: str, timeout: float = 30) -> None:
        try:
            WebDriverWait(self.driver, timeout).until(element_to_be_clickable((by, selector))).click()
            return
        except TimeoutException:
            pass
        self.fail(f"waited {timeout} s for {what} ({selector}) to be clickable")

    def check(self, condition: bool, problem: str) -> None:
        if not condition:
            self.fail(problem)

    def fail(self, problem: str) -> None:
        shot, text = self.evidence_dir / "page.png", self.evidence_dir / "page.txt"
        try:
            self.driver.save_screenshot(str(shot))
            text.write_text(self.driver.find_element(By.TAG_NAME, "body").text, encoding="utf-8")
            state = json.dumps(self.state(), indent=1)[:3000]
        except WebDriverException as exc:   # the browser itself is gone: say so instead
            state = f"(the browser did not answer: {exc.msg})"
        pytest.fail(f"{problem}\nscreenshot: {shot}\npage text: {text}\nJupyterLab log: {self.server_log}\n"
                    f"page state: {state}", pytrace=False)


def _ran(prompt: str) -> bool:
    return re.fullmatch(r"\[\d+\]:", prompt) is not None


def test_solution_notebook_in_chromium(jupyterlab: Lab, chromium: Any, tmp_path: Path) -> None:
    page = Page(chromium, tmp_path, jupyterlab.log)
    chromium.get(f"{jupyterlab.url}/lab/tree/{NOTEBOOK.name}?token={jupyterlab.token}")
    # Every cell drawn and the kernel connected: a Run All clicked sooner runs only the cells drawn so far
    page.wait("the notebook's cells and a connected kernel", lambda s: len(s["prompts"]) == CODE_CELLS
              and s["kernel"] == "idle" and jupyterlab.kernel_connected(), START_TIMEOUT)

    # Run > Run All Cells, as a learner would
    page.click("the Run menu", By.XPATH, "//div[contains(@class, 'lm-MenuBar-itemLabel') and text()='Run']")
    page.click("Run All Cells", By.XPATH, "//li[contains(@class, 'lm-Menu-item')]"
                                          "[.//div[contains(@class, 'lm-Menu-itemLabel') and text()='Run All Cells']]")
    # Done: nothing running or queued (a cell that raises clears the queue: the cells after it stay "[ ]:")
    state = page.wait("Run All Cells to finish", lambda s: s["kernel"] == "idle" and _ran(s["prompts"][0])
                      and "[*]:" not in s["prompts"], RUN_TIMEOUT)
    page.check(not state["errors"], "a cell shows an error:\n" + "\n---\n".join(state["errors"])[:4000])
    page.check(all(map(_ran, state["prompts"])), f"not every code cell ran: prompts {state['prompts']}")

    # ipywidgets' front end draws the controls once their models arrive from the kernel
    state = page.wait("the widget controls and the widget's figure", lambda s: s["error_displaying"] or (
        s["sliders"] >= 2 and not s["loading_widget"] and s["widget_images"] >= 1), WIDGET_TIMEOUT)
    page.check(not state["error_displaying"], "the page shows 'Error displaying widget'")
    page.check(state["images"] >= 3, f"{state['images']} figures drawn: expected the widget's and two FIGURE cells'")
    before = state["widget_text"]
    page.check("model states" in before, f"the widget's output lacks the function's return value: {before!r}")

    # One step left on the cp slider (8 -> 4): the browser tells the kernel, the function draws again and
    # returns other bytes (FSDP over cp ranks: twice the model states)
    chromium.find_elements(By.CSS_SELECTOR, ".widget-slider .noUi-handle")[-1].send_keys(Keys.ARROW_LEFT)
    state = page.wait("the kernel to redraw after moving the cp slider", lambda s: s["widget_text"] != before
                      and "model states" in s["widget_text"] and s["widget_images"] >= 1, WIDGET_TIMEOUT)
    page.check(not state["errors"], "moving the slider shows an error:\n" + "\n---\n".join(state["errors"]))
