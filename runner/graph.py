"""Validate and execute an API-format workflow in-process, the way ComfyUI's executor does.

An API-format workflow (what ComfyUI's POST /prompt takes) maps node ids to
`{"class_type": ..., "inputs": {name: value | [source_node_id, output_index]}}`. `validate` checks
the whole graph before anything runs and reports every problem at once (unknown node type, missing
input, wrong link type, bad value, cycle); `execute` then runs the nodes the output nodes need, in
dependency order, with the same V1 node classes ComfyUI loads. Given an `OutputCache`, it re-runs only the
nodes whose inputs changed since the previous prompt, as ComfyUI's executor does.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import time
from dataclasses import dataclass, field

from ..qwen21_core.errors import stable_name

log = logging.getLogger(__name__)

WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN")
HIDDEN_VALUES = ("UNIQUE_ID", "PROMPT", "EXTRA_PNGINFO", "DYNPROMPT")


@stable_name
class WorkflowError(ValueError):
    """The workflow cannot run; the message lists every problem found."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid workflow:\n  - " + "\n  - ".join(problems))


@stable_name
class NodeError(RuntimeError):
    """A node raised while running; the message names the node and keeps the cause."""


def is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def input_specs(node_class) -> dict[str, tuple[str, object, dict]]:
    """name -> (section, type, options) over the required and optional inputs, in declared order.

    type is a string (a link type or a widget type) or a list (a combo of allowed values).
    """
    declared = node_class.INPUT_TYPES()
    specs = {}
    for section in ("required", "optional"):
        for name, spec in declared.get(section, {}).items():
            options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            specs[name] = (section, spec[0], options)
    return specs


def hidden_specs(node_class) -> dict[str, str]:
    return dict(node_class.INPUT_TYPES().get("hidden", {}))


def types_match(output_type: str, input_type) -> bool:
    if isinstance(input_type, list):  # a combo fed by a link: the source must be a combo/string
        return output_type in ("*", "COMBO", "STRING")
    return "*" in (output_type, input_type) or output_type == input_type


# --------------------------------------------------------------------------------------------------
# Loading and overrides


def load_prompt(text_or_dict) -> dict:
    """Parse an API-format workflow and check its shape (not yet its node types)."""
    prompt = json.loads(text_or_dict) if isinstance(text_or_dict, str) else text_or_dict
    if not isinstance(prompt, dict) or not prompt:
        raise WorkflowError(["an API-format workflow is a non-empty JSON object {node_id: {class_type, inputs}}"])
    problems = []
    for node_id, node in prompt.items():
        if not isinstance(node, dict) or not isinstance(node.get("class_type"), str):
            problems.append(f"node {node_id!r}: expected an object with a string 'class_type'")
        elif not isinstance(node.get("inputs", {}), dict):
            problems.append(f"node {node_id!r}: 'inputs' must be an object")
    if problems:
        raise WorkflowError(problems)
    return prompt


def find_node(prompt: dict, key: str) -> str:
    """A node id from its id, its title (_meta.title) or its class_type (if only one node has it)."""
    if key in prompt:
        return key
    for field_name in ("title", "class_type"):
        matches = [
            node_id
            for node_id, node in prompt.items()
            if (node.get("_meta", {}).get("title") if field_name == "title" else node["class_type"]) == key
        ]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:
            raise WorkflowError([f"{key!r} names {len(matches)} nodes ({', '.join(matches)}); use a node id"])
    raise WorkflowError([f"no node with id, title or class_type {key!r}; node ids are {sorted(prompt)}"])


def apply_overrides(prompt: dict, assignments: list[str], node_classes: dict) -> dict:
    """Apply `NODE.INPUT=VALUE` assignments (VALUE parsed as JSON when it parses, else a string)."""
    for assignment in assignments:
        target, sep, raw = assignment.partition("=")
        node_key, dot, input_name = target.rpartition(".")
        if not sep or not dot or not node_key or not input_name:
            raise WorkflowError([f"--set {assignment!r}: expected NODE.INPUT=VALUE (NODE: id, title or class)"])
        node_id = find_node(prompt, node_key)
        node_class = node_classes.get(prompt[node_id]["class_type"])
        if node_class is not None and input_name not in input_specs(node_class):
            raise WorkflowError(
                [f"--set {assignment!r}: {prompt[node_id]['class_type']} has no input {input_name!r}; "
                 f"its inputs are {list(input_specs(node_class))}"]
            )  # fmt: skip
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        prompt[node_id].setdefault("inputs", {})[input_name] = value
    return prompt


# --------------------------------------------------------------------------------------------------
# Validation


def _check_value(where: str, value, input_type, options: dict) -> str | None:
    if isinstance(input_type, list):
        if value not in input_type:
            shown = input_type if len(input_type) <= 12 else input_type[:12] + ["..."]
            return f"{where}: {value!r} is not one of the allowed values {shown}"
        return None
    if input_type == "INT" and not (isinstance(value, int) and not isinstance(value, bool)):
        return f"{where}: expected an integer, got {value!r}"
    if input_type == "FLOAT" and not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return f"{where}: expected a number, got {value!r}"
    if input_type == "STRING" and not isinstance(value, str):
        return f"{where}: expected a string, got {value!r}"
    if input_type == "BOOLEAN" and not isinstance(value, bool):
        return f"{where}: expected true or false, got {value!r}"
    if input_type in ("INT", "FLOAT"):
        if "min" in options and value < options["min"]:
            return f"{where}: {value} is below the minimum {options['min']}"
        if "max" in options and value > options["max"]:
            return f"{where}: {value} is above the maximum {options['max']}"
    if input_type not in WIDGET_TYPES:
        return f"{where}: a {input_type} input must be linked to another node's output, got the value {value!r}"
    return None


def _node_problems(node_id: str, node: dict, prompt: dict, node_classes: dict) -> list[str]:
    class_type = node["class_type"]
    node_class = node_classes[class_type]
    inputs = node.get("inputs", {})
    problems = []
    custom = _custom_validation(node_class)
    for name, (section, input_type, options) in input_specs(node_class).items():
        where = f"node {node_id} ({class_type}) input {name!r}"
        if name not in inputs:
            if section == "required":
                problems.append(f"{where}: required input is missing")
            continue
        value = inputs[name]
        if not is_link(value):
            # as ComfyUI: an input the node's VALIDATE_INPUTS takes is checked there, not against its widget
            problem = _check_value(where, value, input_type, options) if name not in custom else None
            if problem is not None:
                problems.append(problem)
            continue
        source_id, output_index = value
        if source_id not in prompt:
            problems.append(f"{where}: linked to node {source_id!r}, which is not in the workflow")
            continue
        source_class = node_classes.get(prompt[source_id]["class_type"])
        if source_class is None:
            continue  # reported for the source node itself
        outputs = source_class.RETURN_TYPES
        if not 0 <= output_index < len(outputs):
            problems.append(
                f"{where}: linked to output {output_index} of node {source_id}, which has {len(outputs)} outputs"
            )
        elif not types_match(outputs[output_index], input_type):
            expected = "a combo value" if isinstance(input_type, list) else input_type
            problems.append(
                f"{where}: expects {expected} but is linked to a {outputs[output_index]} output "
                f"(node {source_id}, {prompt[source_id]['class_type']})"
            )
    for name in inputs:
        if name not in input_specs(node_class):
            log.warning("node %s (%s): ignoring unknown input %r", node_id, class_type, name)
    values = {name: inputs[name] for name in custom if name in inputs and not is_link(inputs[name])}
    if values:
        verdict = node_class.VALIDATE_INPUTS(**values)
        if verdict is not True:
            problems.append(f"node {node_id} ({class_type}) inputs {sorted(values)}: {verdict}")
    return problems


def _custom_validation(node_class) -> set[str]:
    """The inputs a node's VALIDATE_INPUTS checks itself (ComfyUI then skips its own check of them)."""
    validate = getattr(node_class, "VALIDATE_INPUTS", None)
    return set(inspect.getfullargspec(validate).args) - {"cls", "self"} if validate is not None else set()


def _needed_nodes(prompt: dict, node_classes: dict) -> list[str]:
    """Ids of the output nodes and everything they depend on, in dependency order; raises on a cycle."""
    outputs = [i for i, n in prompt.items() if getattr(node_classes[n["class_type"]], "OUTPUT_NODE", False)]
    if not outputs:
        raise WorkflowError(["the workflow has no output node (SaveImage, PreviewImage, ...): nothing to run"])
    order, state = [], {}  # state: 1 = on the current path, 2 = done

    def visit(node_id: str, path: list[str]):
        if state.get(node_id) == 2:
            return
        if state.get(node_id) == 1:
            cycle = path[path.index(node_id) :] + [node_id]
            raise WorkflowError([f"the graph has a cycle: {' -> '.join(cycle)}"])
        state[node_id] = 1
        for value in prompt[node_id].get("inputs", {}).values():
            if is_link(value) and value[0] in prompt:
                visit(value[0], path + [node_id])
        state[node_id] = 2
        order.append(node_id)

    for node_id in sorted(outputs, key=_id_order):
        visit(node_id, [])
    return order


def _id_order(node_id: str):
    return (0, int(node_id), "") if node_id.isdigit() else (1, 0, node_id)


def unknown_node_type(class_type: str, node_classes: dict) -> str:
    """Why `class_type` cannot run: the import error of a pack node's module, or a near name."""
    from ..nodes import UNAVAILABLE

    if class_type in UNAVAILABLE:
        return f"node type {class_type!r} is unavailable: {UNAVAILABLE[class_type]}"
    close = [name for name in node_classes if name.lower() == class_type.lower()]
    return f"unknown node type {class_type!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def validate(prompt: dict, node_classes: dict) -> list[str]:
    """Check the whole graph; return the execution order or raise WorkflowError with every problem."""
    problems = []
    for node_id, node in sorted(prompt.items(), key=lambda item: _id_order(item[0])):
        if node["class_type"] not in node_classes:
            problems.append(f"node {node_id}: {unknown_node_type(node['class_type'], node_classes)}")
    if problems:
        raise WorkflowError(problems)
    for node_id, node in sorted(prompt.items(), key=lambda item: _id_order(item[0])):
        reason = getattr(node_classes[node["class_type"]], "COMFYUI_ONLY", None)  # declared, but ComfyUI's work
        if reason:
            problems.append(f"node {node_id}: {node['class_type']} {reason}")
    if problems:
        raise WorkflowError(problems)
    for node_id, node in sorted(prompt.items(), key=lambda item: _id_order(item[0])):
        problems += _node_problems(node_id, node, prompt, node_classes)
    if problems:
        raise WorkflowError(problems)
    return _needed_nodes(prompt, node_classes)


# --------------------------------------------------------------------------------------------------
# Execution


@dataclass
class RunResult:
    """What a run produced: each node's `ui` dict and outputs, the seconds each node took, and the nodes whose
    outputs came from an OutputCache instead (those have no entry in `seconds`: they took no time)."""

    ui: dict[str, dict] = field(default_factory=dict)
    outputs: dict[str, tuple] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    cached: set[str] = field(default_factory=set)


@dataclass
class _Entry:
    outputs: tuple
    ui: dict | None


class OutputCache:
    """Node outputs kept across prompts, as ComfyUI's default ("classic") cache keeps them.

    Entries are keyed by a node's signature: its class, its literal inputs, the signatures of the nodes it is linked
    to (so a change anywhere upstream changes it) and what its class's IS_CHANGED returns for those literal inputs.
    A node whose signature is found is not run again. Only the entries the latest prompt used are kept, so a long
    session holds one prompt's models and tensors, not every one it has seen. Give `execute` the same cache for
    every prompt of a session; one cache per set of node classes.
    """

    def __init__(self):
        self.entries: dict[tuple, _Entry] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()


ALWAYS_CHANGED = None  # the signature of a node that must run every time, and of everything downstream of it


def _freeze(value):
    """A JSON-like value as nested tuples, so that it can be hashed; raises TypeError when it cannot be."""
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _freeze(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("list", tuple(_freeze(v) for v in value))
    hash(value)
    return value


def _is_changed(node_id: str, node_class, literals: dict):
    """The class's IS_CHANGED(**literal inputs), or ALWAYS_CHANGED where it returns NaN, raises or gives a value that
    cannot be hashed (ComfyUI's rule: such a node counts as changed on every prompt)."""
    is_changed = getattr(node_class, "IS_CHANGED", None)
    if is_changed is None:
        return ()
    try:
        value = _freeze(is_changed(**literals))
    except Exception as error:  # noqa: BLE001 - as ComfyUI: a failing IS_CHANGED means "run it"
        log.warning("node %s: IS_CHANGED raised %s: %s; running it", node_id, type(error).__name__, error)
        return ALWAYS_CHANGED
    if isinstance(value, float) and math.isnan(value):
        return ALWAYS_CHANGED
    return ("is_changed", value)


def _signatures(prompt: dict, order: list[str], node_classes: dict) -> dict[str, tuple | None]:
    """Each needed node's signature (ALWAYS_CHANGED where it has none), computed in dependency order."""
    signatures = {}
    for node_id in order:
        node = prompt[node_id]
        node_class = node_classes[node["class_type"]]
        specs = input_specs(node_class)
        inputs = {name: value for name, value in node.get("inputs", {}).items() if name in specs}
        literals = {name: value for name, value in inputs.items() if not is_link(value)}
        is_changed = _is_changed(node_id, node_class, literals)
        upstream = [signatures[value[0]] for value in inputs.values() if is_link(value)]
        if is_changed is ALWAYS_CHANGED or ALWAYS_CHANGED in upstream:
            signatures[node_id] = ALWAYS_CHANGED
            continue
        parts = [node["class_type"], is_changed]
        if "UNIQUE_ID" in hidden_specs(node_class).values():  # as ComfyUI: its outputs may depend on its id
            parts.append(("node_id", node_id))
        try:
            for name in sorted(inputs):
                value = inputs[name]
                # an upstream signature is frozen already: freezing it again would walk the whole graph above
                link = is_link(value)
                parts.append((name, ("link", signatures[value[0]], value[1]) if link else ("value", _freeze(value))))
        except TypeError:  # a literal value that cannot be hashed
            signatures[node_id] = ALWAYS_CHANGED
            continue
        signatures[node_id] = tuple(parts)
    return signatures


def execute(prompt: dict, node_classes: dict, cache: OutputCache | None = None) -> RunResult:
    """Validate the workflow, then run the nodes its output nodes need, in dependency order.

    With a `cache`, a node that is not an output node and whose signature (see OutputCache) is in the cache returns
    its cached outputs and `ui` without running (its id goes to RunResult.cached); the cache then keeps only this
    prompt's nodes. Output nodes always run (they write files). A node that raised is not cached.
    """
    order = validate(prompt, node_classes)
    signatures = {}
    if cache is not None:
        signatures = _signatures(prompt, order, node_classes)
        used = set(signatures.values())
        for stale in [key for key in cache.entries if key not in used]:  # before running: frees them for this prompt
            del cache.entries[stale]
    run = RunResult()
    results = run.outputs
    for step, node_id in enumerate(order, start=1):
        node = prompt[node_id]
        class_type = node["class_type"]
        node_class = node_classes[class_type]
        signature = signatures.get(node_id, ALWAYS_CHANGED)
        if getattr(node_class, "OUTPUT_NODE", False):
            signature = ALWAYS_CHANGED
        if signature is not ALWAYS_CHANGED and signature in cache.entries:
            entry = cache.entries[signature]
            log.info("[%d/%d] node %s: %s (cached)", step, len(order), node_id, class_type)
            results[node_id] = entry.outputs
            if entry.ui is not None:
                run.ui[node_id] = entry.ui
            run.cached.add(node_id)
            continue
        kwargs = {}
        for name, value in node.get("inputs", {}).items():
            if name in input_specs(node_class):
                kwargs[name] = results[value[0]][value[1]] if is_link(value) else value
        for name, kind in hidden_specs(node_class).items():
            kwargs[name] = {"UNIQUE_ID": node_id, "PROMPT": prompt}.get(kind)
        log.info("[%d/%d] node %s: %s", step, len(order), node_id, class_type)
        started = time.perf_counter()
        try:
            returned = getattr(node_class(), node_class.FUNCTION)(**kwargs)
        except Exception as error:
            raise NodeError(f"node {node_id} ({class_type}) failed: {type(error).__name__}: {error}") from error
        run.seconds[node_id] = time.perf_counter() - started
        if isinstance(returned, dict):
            if "ui" in returned:
                run.ui[node_id] = returned["ui"]
            returned = returned.get("result", ())
        results[node_id] = tuple(returned or ())
        if signature is not ALWAYS_CHANGED:
            cache.entries[signature] = _Entry(results[node_id], run.ui.get(node_id))
    return run
