"""The web extension (web/*.js) in a real browser against a real ComfyUI server.

Headless Chromium from the system (Debian's `chromium`; no browser download) driven by Python
playwright, on a server started by tests/test_comfyui_server.py's fixture (the pack in custom_nodes,
the tiny checkpoint in models/). Needs COMFYUI_DIR (and COMFYUI_PYTHON, as there), `pip install
playwright` and `apt-get install chromium` (or CHROMIUM=/path/to/chromium); skips, saying which is
missing, otherwise. Screenshots are kept under artifacts/web/ (ignored by git); their paths are
printed (pytest -s).
"""

import json
import os
import shutil
import time
from pathlib import Path

import pytest

sync_api = pytest.importorskip(
    "playwright.sync_api",
    reason="the browser tests need playwright (pip install playwright); they use the system Chromium",
)

import test_comfyui_server as comfy_server  # noqa: E402
from qwen21_nodes.runner.cli import tiny_overrides  # noqa: E402
from qwen21_nodes.runner.graph import load_prompt  # noqa: E402

# The ComfyUI server (and the tiny checkpoint it serves) is the one the server tests start.
server = comfy_server.server
tiny_models = comfy_server.tiny_models
PACK_FOLDER = comfy_server.PACK_FOLDER
WORKFLOWS_DIR = comfy_server.WORKFLOWS_DIR
UI_WORKFLOWS = comfy_server.UI_WORKFLOWS
COMFYUI_DIR = comfy_server.COMFYUI_DIR

CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts" / "web"
MAX_IMAGES = 16
RUN_TIMEOUT_MS = 300_000
EXTENSION_FILES = ("condition_images.js", "run_status.js", "legacy_inputs.js")
EXTENSION_NAMES = ("qwen21.conditionImages", "qwen21.runStatus", "qwen21.legacyInputs")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.comfyui,
    pytest.mark.skipif(
        not COMFYUI_DIR or not (Path(COMFYUI_DIR) / "main.py").is_file(),
        reason="set COMFYUI_DIR to a ComfyUI checkout (with main.py) to run the browser tests",
    ),
    pytest.mark.skipif(
        CHROMIUM is None, reason="no Chromium found (apt-get install chromium, or set CHROMIUM=/path/to/it)"
    ),
]

# ---- page-side helpers (JavaScript run in the page) -----------------------------------------------

JS_SETUP = """() => {
    window.qwen21Errors = [];
    const api = window.comfyAPI.api.api;
    api.addEventListener("execution_error", (event) => window.qwen21Errors.push(event.detail));
}"""

# [[input name, type, origin node id or null, origin slot or null], ...] of the encoder's sockets.
JS_ENCODER_SOCKETS = """() => {
    const node = app.graph.nodes.find((n) => n.type === "Qwen21Encode");
    return node.inputs.map((input) => {
        const link = input.link == null ? null : app.graph.links[input.link] ?? app.graph._links.get(input.link);
        return [input.name, input.type, link ? link.origin_id : null, link ? link.origin_slot : null];
    });
}"""

# Every link's target slot must be the position of the input that holds it (what the canvas draws).
JS_BROKEN_LINKS = """() => {
    const broken = [];
    for (const node of app.graph.nodes) {
        (node.inputs ?? []).forEach((input, slot) => {
            if (input.link == null) return;
            const link = app.graph.links[input.link] ?? app.graph._links.get(input.link);
            if (!link || link.target_id !== node.id || link.target_slot !== slot) broken.push([node.id, input.name]);
        });
    }
    return broken;
}"""

# Connect node `from`'s output of the right type to the encoder input `name` (from = null: disconnect).
JS_CONNECT = """([from, name]) => {
    const encoder = app.graph.nodes.find((n) => n.type === "Qwen21Encode");
    const slot = encoder.findInputSlot(name);
    if (slot < 0) throw new Error(`the encoder has no input ${name}`);
    if (from == null) return encoder.disconnectInput(slot);
    const source = app.graph.getNodeById(from);
    const output = source.outputs.findIndex((o) => o.type === encoder.inputs[slot].type);
    if (!source.connect(output, encoder, slot)) throw new Error(`could not connect ${source.type} to ${name}`);
}"""

# Page coordinates of a slot's connection dot: [node id, is input, slot name] -> [x, y].
JS_SLOT_POSITION = """([nodeId, isInput, name]) => {
    const node = app.graph.getNodeById(nodeId);
    const slot = isInput ? node.findInputSlot(name) : node.findOutputSlot(name);
    if (slot < 0) throw new Error(`node ${nodeId} has no ${isInput ? "input" : "output"} ${name}`);
    const [x, y] = app.canvas.ds.convertOffsetToCanvas(node.getConnectionPos(isInput, slot));
    const box = app.canvas.canvas.getBoundingClientRect();
    return [box.left + x, box.top + y];
}"""

JS_ADD_LOAD_IMAGE = """([image, x, y]) => {
    const node = LiteGraph.createNode("LoadImage");
    node.pos = [x, y];
    app.graph.add(node);
    node.widgets.find((w) => w.name === "image").value = image;
    return node.id;
}"""

JS_SET_WIDGETS = """(settings) => {
    for (const [nodeId, name, value] of settings) {
        const widget = app.graph.getNodeById(Number(nodeId)).widgets.find((w) => w.name === name);
        if (!widget) throw new Error(`node ${nodeId} has no widget ${name}`);
        widget.value = value;
    }
}"""

JS_WIDGET_VALUE = """([type, name]) => {
    const node = app.graph.nodes.find((n) => n.type === type);
    return node.widgets.find((w) => w.name === name).value;
}"""

JS_STATUS = """(type) => {
    const node = app.graph.nodes.find((n) => n.type === type);
    const widget = node.widgets?.find((w) => w.name === "qwen21_status");
    return widget ? widget.value : null;
}"""

JS_FIT_VIEW = """() => {
    const nodes = app.graph.nodes.filter((n) => n.type !== "MarkdownNote");
    const title = LiteGraph.NODE_TITLE_HEIGHT;
    const left = Math.min(...nodes.map((n) => n.pos[0]));
    const top = Math.min(...nodes.map((n) => n.pos[1] - title));
    const right = Math.max(...nodes.map((n) => n.pos[0] + n.size[0]));
    const bottom = Math.max(...nodes.map((n) => n.pos[1] + n.size[1]));
    app.canvas.ds.fitToBounds([left, top, right - left, bottom - top], { zoom: 0.97 });
    app.canvas.setDirty(true, true);
}"""


# ---- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking"],
        )
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def page(browser, server):
    # Skip the first-visit template gallery, which would cover the canvas in the screenshots.
    assert server.post("/settings/Comfy.TutorialCompleted", json=True).status_code == 200
    page = browser.new_page(viewport={"width": 1700, "height": 950})
    page.page_errors = []
    page.on("pageerror", lambda error: page.page_errors.append(str(error)))
    page.goto(server.url)
    page.wait_for_function("window.app && window.app.graph && window.app.extensions?.length", timeout=120_000)
    page.evaluate(JS_SETUP)
    yield page
    page.close()


def load_workflow(page, workflow: dict) -> None:
    page.evaluate("(workflow) => app.loadGraphData(workflow)", workflow)


def alerts(page, text: str) -> int:
    """How many toasts on the page contain `text` (the frontend reports workflow problems there)."""
    return page.locator(".p-toast-message", has_text=text).count()


def ui_workflow(name: str) -> dict:
    return json.loads((WORKFLOWS_DIR / f"{name}.json").read_text())


def pair_sockets(sockets: list) -> list[str]:
    return [name for name, *_ in sockets if name.split("_")[0] in ("image", "mask")]


def expected_pairs(connected: int) -> list[str]:
    """The sockets the encoder should show when pairs up to `connected` are in use: one more pair."""
    shown = min(MAX_IMAGES, connected + 1)
    return [f"{kind}_{i}" for i in range(1, shown + 1) for kind in ("image", "mask")]


def screenshot(page, name: str) -> Path:
    # Close the toasts (they would cover the right-hand nodes); DOM clicks, as some lie off-screen.
    page.evaluate("() => document.querySelectorAll('.p-toast-close-button').forEach((b) => b.click())")
    page.evaluate(JS_FIT_VIEW)
    page.wait_for_timeout(300)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path))
    print(f"screenshot: {path}")
    return path


def is_prompt_post(response) -> bool:
    return response.request.method == "POST" and response.url.split("?")[0].endswith("/prompt")


def queue_and_wait_for_status(page, expected: dict[str, str]) -> dict[str, str]:
    """Queue the graph from the page; wait until each node type's status text contains its substring."""
    with page.expect_response(is_prompt_post) as queued:
        page.evaluate("() => { window.qwen21Errors.length = 0; return app.queuePrompt(0, 1); }")
    assert queued.value.status == 200, f"the server refused the prompt: {queued.value.text()}"
    deadline = time.monotonic() + RUN_TIMEOUT_MS / 1000
    while True:
        errors = page.evaluate("() => window.qwen21Errors")
        assert not errors, f"the run failed: {errors[0].get('exception_message')}"
        statuses = {node_type: page.evaluate(JS_STATUS, node_type) for node_type in expected}
        if all(text and expected[node_type] in text for node_type, text in statuses.items()):
            return statuses
        assert time.monotonic() < deadline, f"status lines {statuses} after the run, expected {expected}"
        page.wait_for_timeout(250)


def point_at_tiny_checkpoint(page, name: str, models: Path, *extra: str) -> None:
    """Set the loader/encoder/sampler widgets the way the runner's tiny_overrides does for the
    API twin of the workflow (same node ids), plus `extra` NODE_ID.INPUT=JSON settings."""
    prompt = load_prompt((WORKFLOWS_DIR / "api" / f"{name}.json").read_text())
    settings = []
    for assignment in tiny_overrides(prompt, models) + list(extra):
        target, value = assignment.split("=", 1)
        node_id, input_name = target.split(".", 1)
        settings.append([node_id, input_name, json.loads(value)])
    page.evaluate(JS_SET_WIDGETS, settings)


# ---- tests -----------------------------------------------------------------------------------------


def test_extension_scripts_are_served_and_registered_once(server, page):
    listed = server.get("/extensions").json()
    for file in EXTENSION_FILES:
        assert listed.count(f"/extensions/{PACK_FOLDER}/{file}") == 1, listed
    registered = page.evaluate("() => app.extensions.map((e) => e.name)")
    for name in EXTENSION_NAMES:
        assert registered.count(name) == 1, registered
    ours = [error for error in page.page_errors if PACK_FOLDER in error or "qwen21" in error]
    assert not ours, ours


def test_every_node_has_a_help_page(server):
    from qwen21_nodes.nodes import NODE_CLASS_MAPPINGS

    for name in NODE_CLASS_MAPPINGS:
        reply = server.get(f"/extensions/{PACK_FOLDER}/docs/{name}.md")
        assert reply.status_code == 200, f"no help page web/docs/{name}.md"
        assert reply.text.lstrip().startswith("# "), f"web/docs/{name}.md does not start with a heading"


@pytest.mark.parametrize("path", UI_WORKFLOWS, ids=[p.stem for p in UI_WORKFLOWS])
def test_ui_workflow_passes_the_frontends_schema_check(page, path):
    before = alerts(page, "Invalid workflow")
    load_workflow(page, json.loads(path.read_text()))
    page.wait_for_timeout(200)
    assert alerts(page, "Invalid workflow") == before, page.locator(".p-toast-message").last.inner_text()


@pytest.mark.parametrize("path", UI_WORKFLOWS, ids=[p.stem for p in UI_WORKFLOWS])
def test_ui_workflow_loads_with_only_the_image_sockets_in_use(server, page, path):
    workflow = json.loads(path.read_text())
    encoder = next(node for node in workflow["nodes"] if node["type"] == "Qwen21Encode")
    saved_links = {link[0]: link for link in workflow["links"]}
    saved = {i["name"]: saved_links[i["link"]][1:3] for i in encoder["inputs"] if i.get("link") is not None}
    last_used = max((int(name.split("_")[1]) for name in saved if name != "model"), default=0)

    load_workflow(page, workflow)

    sockets = page.evaluate(JS_ENCODER_SOCKETS)
    assert pair_sockets(sockets) == expected_pairs(last_used)
    loaded = {name: [origin, slot] for name, _type, origin, slot in sockets if origin is not None}
    assert loaded == saved, "the links into the encoder changed on load"
    assert page.evaluate(JS_BROKEN_LINKS) == []
    # What the page would queue is exactly the workflow's API twin: no socket change leaks into it.
    queued = page.evaluate("async () => (await app.graphToPrompt()).output")
    api = json.loads((WORKFLOWS_DIR / "api" / path.name).read_text())
    assert {k: (v["class_type"], v["inputs"]) for k, v in queued.items()} == {
        k: (v["class_type"], v["inputs"]) for k, v in api.items()
    }


def test_a_new_encoder_node_shows_one_image_pair(server, page):
    inputs = page.evaluate(
        """() => {
            const node = LiteGraph.createNode("Qwen21Encode");
            app.graph.add(node);
            return node.inputs.map((input) => input.name);
        }"""
    )
    assert pair_sockets([[name] for name in inputs]) == expected_pairs(0)
    assert "model" in inputs


def test_connecting_the_last_image_adds_one_socket_and_trailing_empty_ones_go(server, page):
    load_workflow(page, ui_workflow("text_to_image"))
    assert pair_sockets(page.evaluate(JS_ENCODER_SOCKETS)) == expected_pairs(0)
    image = page.evaluate(JS_ADD_LOAD_IMAGE, ["reference_1.png", 40, 700])

    def connect(name, source=image):
        page.evaluate(JS_CONNECT, [source, name])
        return pair_sockets(page.evaluate(JS_ENCODER_SOCKETS))

    assert connect("image_1") == expected_pairs(1)
    assert connect("image_2") == expected_pairs(2)  # the third socket appears
    assert connect("mask_3") == expected_pairs(3), "a connected mask keeps its pair and adds the next"
    assert connect("mask_3", None) == expected_pairs(2)
    assert connect("image_1", None) == expected_pairs(2), "an empty socket before a used one stays"
    assert connect("image_2", None) == expected_pairs(0)
    for i in range(1, MAX_IMAGES + 1):
        sockets = connect(f"image_{i}")
    assert sockets == expected_pairs(MAX_IMAGES) and "image_17" not in sockets
    assert page.evaluate(JS_BROKEN_LINKS) == []
    queued = page.evaluate("async () => (await app.graphToPrompt()).output")
    encoder = next(node for node in queued.values() if node["class_type"] == "Qwen21Encode")
    assert [encoder["inputs"].get(f"image_{i}") for i in range(1, MAX_IMAGES + 1)] == [[str(image), 0]] * MAX_IMAGES
    assert not any(name.startswith("mask_") for name in encoder["inputs"])


def test_dragging_links_with_the_mouse_grows_and_moves_sockets(server, page):
    load_workflow(page, ui_workflow("edit_1_reference"))
    encoder = page.evaluate("() => app.graph.nodes.find((n) => n.type === 'Qwen21Encode').id")
    second = page.evaluate(JS_ADD_LOAD_IMAGE, ["reference_2.png", 40, 720])
    page.evaluate(JS_FIT_VIEW)
    page.wait_for_timeout(200)

    def drag(start, end):
        page.mouse.move(*page.evaluate(JS_SLOT_POSITION, start))
        page.mouse.down()
        page.mouse.move(*page.evaluate(JS_SLOT_POSITION, end), steps=12)
        page.mouse.up()
        page.wait_for_timeout(100)
        return page.evaluate(JS_ENCODER_SOCKETS)

    sockets = drag([second, False, "IMAGE"], [encoder, True, "image_2"])
    assert pair_sockets(sockets) == expected_pairs(2), "connecting image_2 should show image_3"
    assert [origin for name, _, origin, _ in sockets if name == "image_2"] == [second]
    # Move that link from image_2 onto the empty image_3: image_4 appears, image_2 stays as a gap.
    sockets = drag([encoder, True, "image_2"], [encoder, True, "image_3"])
    assert pair_sockets(sockets) == expected_pairs(3)
    assert {name: origin for name, _, origin, _ in sockets if origin is not None and name != "model"} == {
        "image_1": page.evaluate("() => app.graph.nodes.find((n) => n.type === 'LoadImage').id"),
        "image_3": second,
    }
    assert page.evaluate(JS_BROKEN_LINKS) == []


def test_saved_workflow_reloads_with_the_same_sockets_and_links(server, page):
    load_workflow(page, ui_workflow("edit_1_reference"))
    second = page.evaluate(JS_ADD_LOAD_IMAGE, ["reference_2.png", 40, 720])
    page.evaluate(JS_CONNECT, [second, "image_2"])
    before = page.evaluate(JS_ENCODER_SOCKETS)
    queued_before = page.evaluate("async () => (await app.graphToPrompt()).output")
    saved = page.evaluate("() => JSON.parse(JSON.stringify(app.graph.serialize()))")
    saved_encoder = next(node for node in saved["nodes"] if node["type"] == "Qwen21Encode")
    assert pair_sockets([[i["name"]] for i in saved_encoder["inputs"]]) == expected_pairs(2)

    page.evaluate("() => app.graph.clear()")
    load_workflow(page, saved)

    assert page.evaluate(JS_ENCODER_SOCKETS) == before
    assert page.evaluate(JS_BROKEN_LINKS) == []
    assert page.evaluate("async () => (await app.graphToPrompt()).output") == queued_before


def test_run_from_the_page_shows_the_status_lines_and_updates_them(server, page):
    load_workflow(page, ui_workflow("edit_1_reference"))
    point_at_tiny_checkpoint(page, "edit_1_reference", server.models)
    second = page.evaluate(JS_ADD_LOAD_IMAGE, ["reference_2.png", 40, 720])
    page.evaluate(JS_CONNECT, [second, "image_2"])
    assert pair_sockets(page.evaluate(JS_ENCODER_SOCKETS)) == expected_pairs(2)
    assert [page.evaluate(JS_STATUS, t) for t in ("Qwen21Sampler", "Qwen21VAEDecode")] == [None, None], (
        "a status line before any run"
    )
    saved_before = page.evaluate("() => app.graph.serialize().nodes.map((n) => [n.id, n.widgets_values])")

    first = queue_and_wait_for_status(page, {"Qwen21Sampler": "steps/s", "Qwen21VAEDecode": "VAE"})
    sampler, vae = first["Qwen21Sampler"], first["Qwen21VAEDecode"]
    for expected in ("prefix cache", "graphs off", "peak"):
        assert expected in sampler, sampler
    assert "prefix cache off" not in sampler, sampler
    assert "untiled" in vae and "exact" in vae, vae
    widgets = page.evaluate("() => app.graph.nodes.find((n) => n.type === 'Qwen21Sampler').widgets.map((w) => w.name)")
    previews = [i for i, name in enumerate(widgets) if name.startswith("$$")]
    assert all(widgets.index("qwen21_status") < i for i in previews), f"status painted under a preview: {widgets}"
    shot = screenshot(page, "status_after_run")
    assert shot.stat().st_size > 10_000

    # The status widget is display only: not saved, not sent.
    saved_after = page.evaluate("() => app.graph.serialize().nodes.map((n) => [n.id, n.widgets_values])")
    assert saved_after == saved_before
    queued = page.evaluate("async () => (await app.graphToPrompt()).output")
    assert all("qwen21_status" not in node["inputs"] for node in queued.values())

    # A second run replaces the line.
    sampler_id = next(k for k, v in queued.items() if v["class_type"] == "Qwen21Sampler")
    page.evaluate(JS_SET_WIDGETS, [[sampler_id, "prefix_cache", False]])
    queue_and_wait_for_status(page, {"Qwen21Sampler": "prefix cache off"})
    screenshot(page, "status_after_second_run")


@pytest.mark.parametrize("name", ["ksampler_text_to_image", "ksampler_lora"])
def test_a_ksampler_workflow_runs_from_the_page_on_our_model(server, page, name):
    """Dragged in like a template and queued from the canvas: ComfyUI's KSampler (and LoRA loader, VAE Decode, Save
    Image) on the loader's MODEL and VAE; the run succeeds and saves an RGB image (VAE Decode gives RGB, as ComfyUI's
    image nodes expect; Qwen21 VAE Decode gives the alpha)."""
    load_workflow(page, ui_workflow(name))
    point_at_tiny_checkpoint(page, name, server.models)
    with page.expect_response(is_prompt_post) as queued:
        page.evaluate("() => { window.qwen21Errors.length = 0; return app.queuePrompt(0, 1); }")
    assert queued.value.status == 200, f"the server refused the prompt: {queued.value.text()}"
    entry = server.wait(queued.value.json()["prompt_id"])
    assert entry["status"]["status_str"] == "success", comfy_server.failure_report(entry, server)
    assert page.evaluate("() => window.qwen21Errors") == []
    (images,) = [output["images"] for output in entry["outputs"].values() if "images" in output]
    with comfy_server.fetch_png(server, images[0]) as picture:
        assert picture.mode == "RGB"
    screenshot(page, f"{name}_after_run")


@pytest.mark.parametrize(
    ("name", "loader", "saved", "shown"),
    [
        ("text_to_image", "Qwen21ModelLoader", True, "always"),
        ("turbo_schedule", "Qwen21DiffusersLoader", False, "never"),
    ],
)
def test_an_older_workflows_offload_switch_shows_as_its_choice_and_runs(server, page, name, loader, saved, shown):
    """offload_text_encoder was an on/off switch (saved as true / false) before it became a choice: such a
    workflow opens with the choice it meant selected, and what the page queues passes the server's checks."""
    from qwen21_nodes.nodes import NODE_CLASS_MAPPINGS

    declared = NODE_CLASS_MAPPINGS[loader].INPUT_TYPES()
    index = [*declared["required"], *declared.get("optional", {})].index("offload_text_encoder")
    workflow = ui_workflow(name)
    node = next(node for node in workflow["nodes"] if node["type"] == loader)
    assert node["widgets_values"][index] == "auto", "the widget values are not in the loader's input order"
    node["widgets_values"][index] = saved
    before = alerts(page, "Invalid workflow")

    load_workflow(page, workflow)

    assert page.evaluate(JS_WIDGET_VALUE, [loader, "offload_text_encoder"]) == shown
    assert alerts(page, "Invalid workflow") == before, page.locator(".p-toast-message").last.inner_text()
    ours = [error for error in page.page_errors if PACK_FOLDER in error or "qwen21" in error]
    assert not ours, ours
    saved_again = page.evaluate("() => app.graph.serialize()")
    (resaved,) = [n for n in saved_again["nodes"] if n["type"] == loader]
    assert resaved["widgets_values"][index] == shown, "saving the workflow again would keep the old value"
    queued = page.evaluate("async () => (await app.graphToPrompt()).output")
    (inputs,) = [node["inputs"] for node in queued.values() if node["class_type"] == loader]
    assert inputs["offload_text_encoder"] == shown

    point_at_tiny_checkpoint(page, name, server.models)
    queue_and_wait_for_status(page, {"Qwen21Sampler": "steps/s"})


def test_template_browser_shows_a_thumbnail_for_every_template(server, page):
    thumbnails = {}  # template name -> HTTP status of its thumbnail request
    prefix = f"/api/workflow_templates/{PACK_FOLDER}/"

    def record(response):
        path = response.url.split("?")[0].split(server.url, 1)[-1]
        if path.startswith(prefix) and path.endswith(".jpg"):
            thumbnails[path[len(prefix) : -len(".jpg")]] = response.status

    page.on("response", record)
    try:
        page.evaluate("() => app.extensionManager.command.execute('Comfy.BrowseTemplates')")
        page.get_by_text(PACK_FOLDER, exact=True).first.click()
        expected = {p.stem for p in UI_WORKFLOWS}
        shown_ids = """() => [...document.querySelectorAll('[data-testid^="template-workflow-"]')]
            .map((card) => card.dataset.testid)"""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the browser shows a page of cards and adds more as one scrolls down
            shown = {test_id.removeprefix("template-workflow-") for test_id in page.evaluate(shown_ids)}
            if expected <= shown:
                break
            page.evaluate("""() => document.querySelectorAll('.p-dataview-content')
                .forEach((box) => { box.scrollTop = box.scrollHeight; })""")  # the cards' scroller
            page.wait_for_timeout(300)
        for name in sorted(expected):  # cards load their image when scrolled into view
            page.get_by_test_id(f"template-workflow-{name}").scroll_into_view_if_needed()
        deadline = time.monotonic() + 30
        while set(thumbnails) != expected and time.monotonic() < deadline:
            page.wait_for_timeout(200)
        screenshot(page, "template_browser")
        assert thumbnails == dict.fromkeys(expected, 200)
        broken = page.evaluate(
            """(prefix) => [...document.querySelectorAll('img')]
                .filter((img) => img.src.includes(prefix) && !(img.complete && img.naturalWidth > 0))
                .map((img) => img.src)""",
            prefix,
        )
        assert broken == [], "thumbnails the page could not show"
    finally:
        page.remove_listener("response", record)
        page.keyboard.press("Escape")
