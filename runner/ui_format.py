"""ComfyUI's UI-format workflow (what drag-and-drop and "Save" use): checking it and turning it into
the API format the runner and POST /prompt take.

A UI workflow lists nodes with positional `widgets_values` and links as
`[link_id, from_node, from_slot, to_node, to_slot, type]`. Widget order follows the node class's
INPUT_TYPES (required, then optional) over the inputs the frontend shows as widgets, with the
frontend's extra widgets: `control_after_generate` after a seed, `upload` after an image picker. A workflow
saved before a node gained an optional widget has fewer values; the missing trailing ones take their defaults.
"""

from __future__ import annotations

from .graph import WIDGET_TYPES, WorkflowError, input_specs, types_match, unknown_node_type

# Frontend-only nodes: they never reach the server.
VIRTUAL_NODES = ("MarkdownNote", "Note", "Reroute", "PrimitiveNode")
SEED_NAMES = ("seed", "noise_seed")


def is_ui_workflow(data) -> bool:
    return isinstance(data, dict) and isinstance(data.get("nodes"), list) and isinstance(data.get("links"), list)


def widget_names(node_class) -> list[str]:
    """Names of the values in a node's `widgets_values`, in order (frontend-only widgets included)."""
    return [name for name, _section in _widgets(node_class)]


def required_widget_count(node_class) -> int:
    """How many leading `widgets_values` a workflow must have: optional widgets come last, and a workflow saved
    before one was added lacks it (the frontend then shows its default)."""
    sections = [section for _name, section in _widgets(node_class)]
    return max((index + 1 for index, section in enumerate(sections) if section == "required"), default=0)


def _widgets(node_class) -> list[tuple[str, str]]:
    widgets = []
    for name, (section, input_type, options) in input_specs(node_class).items():
        if options.get("forceInput") or not (isinstance(input_type, list) or input_type in WIDGET_TYPES):
            continue
        widgets.append((name, section))
        if input_type == "INT" and options.get("control_after_generate", name in SEED_NAMES):
            widgets.append(("control_after_generate", section))
        if options.get("image_upload"):
            widgets.append(("upload", section))
    return widgets


def check_ui_workflow(ui: dict, node_classes: dict) -> list[str]:
    """Every problem with the node types, inputs, outputs, links and widget counts of a UI workflow."""
    problems = []
    nodes = {node["id"]: node for node in ui["nodes"]}
    for node in ui["nodes"]:
        where = f"node {node['id']} ({node['type']})"
        if node["type"] in VIRTUAL_NODES:
            continue
        node_class = node_classes.get(node["type"])
        if node_class is None:
            problems.append(f"{where}: {unknown_node_type(node['type'], node_classes)}")
            continue
        specs = input_specs(node_class)
        for socket in node.get("inputs", []):
            spec = specs.get(socket["name"])
            is_widget = spec is not None and (isinstance(spec[1], list) or spec[1] in WIDGET_TYPES)
            if spec is None:
                problems.append(f"{where}: no input named {socket['name']!r}")
            elif is_widget and socket.get("widget") is None:
                problems.append(f"{where}: {socket['name']!r} is a widget; as a socket it needs a 'widget' entry")
            elif not is_widget and socket["type"] != spec[1]:
                problems.append(
                    f"{where}: input {socket['name']!r} has type {socket['type']}, the node declares {spec[1]}"
                )
        for slot, output in enumerate(node.get("outputs", [])):
            if slot >= len(node_class.RETURN_TYPES) or output["type"] != node_class.RETURN_TYPES[slot]:
                problems.append(f"{where}: output {slot} ({output['type']}) does not match {node_class.RETURN_TYPES}")
        expected = widget_names(node_class)
        given, least = len(node.get("widgets_values", [])), required_widget_count(node_class)
        if not least <= given <= len(expected):
            count = "" if least == len(expected) else f"{least} to "
            problems.append(f"{where}: {given} widgets_values, expected {count}{len(expected)} {expected}")
    for link in ui["links"]:
        link_id, source, source_slot, target, target_slot, link_type = link
        if source not in nodes or target not in nodes:
            problems.append(f"link {link_id}: joins missing node(s) {source} -> {target}")
            continue
        outputs, inputs = nodes[source].get("outputs", []), nodes[target].get("inputs", [])
        if source_slot >= len(outputs) or link_id not in (outputs[source_slot].get("links") or []):
            problems.append(f"link {link_id}: node {source} output {source_slot} does not list it")
        elif outputs[source_slot]["type"] != link_type:
            problems.append(
                f"link {link_id}: type {link_type} but node {source} output is {outputs[source_slot]['type']}"
            )
        if target_slot >= len(inputs) or inputs[target_slot].get("link") != link_id:
            problems.append(f"link {link_id}: node {target} input {target_slot} does not reference it")
        elif not types_match(link_type, inputs[target_slot]["type"]):
            problems.append(f"link {link_id}: a {link_type} link into a {inputs[target_slot]['type']} input")
    return problems


def ui_to_api(ui: dict, node_classes: dict) -> dict:
    """The API-format prompt the frontend would queue for this UI workflow (muted nodes left out)."""
    problems = check_ui_workflow(ui, node_classes)
    if problems:
        raise WorkflowError(problems)
    links = {link[0]: link for link in ui["links"]}
    prompt = {}
    for node in ui["nodes"]:
        if node["type"] in VIRTUAL_NODES or node.get("mode", 0) in (2, 4):  # 2 = muted, 4 = bypassed
            continue
        node_class = node_classes[node["type"]]
        inputs = {}
        values = node.get("widgets_values", [])
        for name, value in zip(widget_names(node_class)[: len(values)], values, strict=True):  # missing: defaults
            if name not in ("control_after_generate", "upload"):
                inputs[name] = value
        for socket in node.get("inputs", []):
            if socket.get("link") is not None:
                link = links[socket["link"]]
                inputs[socket["name"]] = [str(link[1]), link[2]]
        entry = {"class_type": node["type"], "inputs": inputs}
        if node.get("title"):
            entry["_meta"] = {"title": node["title"]}
        prompt[str(node["id"])] = entry
    return prompt
