"""The in-process runner's graph handling: validation errors, execution order, overrides, UI format.

Uses small fake node classes defined here (never shipped), so it needs no model.
"""

import copy

import pytest
from qwen21_nodes.runner.graph import (
    NodeError,
    OutputCache,
    WorkflowError,
    apply_overrides,
    execute,
    load_prompt,
    validate,
)
from qwen21_nodes.runner.ui_format import check_ui_workflow, ui_to_api, widget_names

CALLS = []


class MakeNumber:
    RETURN_TYPES = ("NUMBER",)
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "value": ("INT", {"default": 1, "min": 0, "max": 10}),
                "seed": ("INT", {"default": 0, "control_after_generate": True}),
            },
            "hidden": {"node_id": "UNIQUE_ID"},
        }

    def run(self, value, seed, node_id=None):
        CALLS.append(("MakeNumber", node_id))
        return (value + seed,)


class AddNumbers:
    RETURN_TYPES = ("NUMBER", "STRING")
    FUNCTION = "run"

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"a": ("NUMBER",), "mode": (["add", "fail"],)},
            "optional": {"b": ("NUMBER",)},
        }

    def run(self, a, mode, b=0):
        CALLS.append(("AddNumbers", a, b))
        if mode == "fail":
            raise RuntimeError("asked to fail")
        return (a + b, f"{a}+{b}")


class ShowNumber:
    RETURN_TYPES = ()
    FUNCTION = "run"
    OUTPUT_NODE = True

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"number": ("NUMBER",)}}

    def run(self, number):
        CALLS.append(("ShowNumber", number))
        return {"ui": {"numbers": [number]}}


CLASSES = {"MakeNumber": MakeNumber, "AddNumbers": AddNumbers, "ShowNumber": ShowNumber}

GOOD = {
    "1": {"class_type": "MakeNumber", "inputs": {"value": 2, "seed": 3}, "_meta": {"title": "first"}},
    "2": {"class_type": "MakeNumber", "inputs": {"value": 4, "seed": 0}},
    "3": {"class_type": "AddNumbers", "inputs": {"a": ["1", 0], "b": ["2", 0], "mode": "add"}},
    "4": {"class_type": "ShowNumber", "inputs": {"number": ["3", 0]}},
    "9": {"class_type": "MakeNumber", "inputs": {"value": 1, "seed": 0}},  # feeds no output: never runs
}


def prompt(**changes):
    graph = copy.deepcopy(GOOD)
    for node_id, node in changes.items():
        graph[node_id] = node
    return graph


def problems_of(graph) -> str:
    with pytest.raises(WorkflowError) as caught:
        validate(graph, CLASSES)
    return str(caught.value)


def test_runs_needed_nodes_in_dependency_order():
    CALLS.clear()
    result = execute(prompt(), CLASSES)
    assert result.ui == {"4": {"numbers": [9]}}
    assert CALLS == [("MakeNumber", "1"), ("MakeNumber", "2"), ("AddNumbers", 5, 4), ("ShowNumber", 9)]
    assert set(result.seconds) == {"1", "2", "3", "4"} and result.cached == set()
    CALLS.clear()
    execute(prompt(), CLASSES)  # without a cache, every needed node runs every time
    assert len(CALLS) == 4


def test_optional_input_may_be_left_out():
    graph = prompt()
    del graph["3"]["inputs"]["b"]
    assert execute(graph, CLASSES).ui["4"] == {"numbers": [5]}


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"3": {"class_type": "AddNumbrs", "inputs": {}}}, "unknown node type 'AddNumbrs'"),
        ({"3": {"class_type": "AddNumbers", "inputs": {"mode": "add"}}}, "input 'a': required input is missing"),
        ({"3": {"class_type": "AddNumbers", "inputs": {"a": ["4", 0], "mode": "add"}}}, "output 0 of node 4"),
        (
            {"4": {"class_type": "ShowNumber", "inputs": {"number": ["3", 1]}}},
            "expects NUMBER but is linked to a STRING",
        ),
        ({"3": {"class_type": "AddNumbers", "inputs": {"a": ["7", 0], "mode": "add"}}}, "not in the workflow"),
        ({"1": {"class_type": "MakeNumber", "inputs": {"value": 11, "seed": 0}}}, "11 is above the maximum 10"),
        ({"1": {"class_type": "MakeNumber", "inputs": {"value": "2", "seed": 0}}}, "expected an integer"),
        ({"3": {"class_type": "AddNumbers", "inputs": {"a": ["1", 0], "mode": "sub"}}}, "'sub' is not one of"),
        ({"3": {"class_type": "AddNumbers", "inputs": {"a": 5, "mode": "add"}}}, "must be linked"),
    ],
)
def test_validation_names_node_input_and_problem(change, expected):
    assert expected in problems_of(prompt(**change))


def test_validation_reports_every_problem_at_once():
    graph = prompt(
        **{
            "1": {"class_type": "MakeNumber", "inputs": {"value": 99, "seed": 0}},
            "2": {"class_type": "MakeNumber", "inputs": {"seed": 0}},
        }
    )
    with pytest.raises(WorkflowError) as caught:
        validate(graph, CLASSES)
    assert len(caught.value.problems) == 2


def test_cycle_is_reported_with_its_path():
    graph = prompt(**{"1": {"class_type": "AddNumbers", "inputs": {"a": ["3", 0], "mode": "add"}}})
    message = problems_of(graph)
    assert "cycle" in message
    assert "1 -> 3 -> 1" in message or "3 -> 1 -> 3" in message


def test_graph_without_output_node_is_rejected():
    graph = {k: v for k, v in prompt().items() if k != "4"}
    assert "no output node" in problems_of(graph)


def test_node_failure_names_the_node():
    graph = prompt(**{"3": {"class_type": "AddNumbers", "inputs": {"a": ["1", 0], "mode": "fail"}}})
    with pytest.raises(NodeError, match=r"node 3 \(AddNumbers\) failed: RuntimeError: asked to fail"):
        execute(graph, CLASSES)


def test_overrides_by_id_title_and_class():
    graph = apply_overrides(
        prompt(), ["1.value=7", "first.seed=1", 'ShowNumber.number=["2", 0]', "3.mode=fail"], CLASSES
    )
    assert graph["1"]["inputs"] == {"value": 7, "seed": 1}
    assert graph["4"]["inputs"]["number"] == ["2", 0]
    assert graph["3"]["inputs"]["mode"] == "fail"  # not JSON: kept as text


@pytest.mark.parametrize(
    "assignment, expected",
    [
        ("1.valu=3", "has no input 'valu'"),
        ("MakeNumber.value=3", "names 3 nodes"),
        ("nope.value=3", "no node with id, title or class_type 'nope'"),
        ("value=3", "expected NODE.INPUT=VALUE"),
    ],
)
def test_bad_overrides_are_explained(assignment, expected):
    with pytest.raises(WorkflowError, match=expected):
        apply_overrides(prompt(), [assignment], CLASSES)


def test_load_prompt_rejects_malformed_json_shapes():
    with pytest.raises(WorkflowError, match="class_type"):
        load_prompt('{"1": {"inputs": {}}}')
    with pytest.raises(WorkflowError, match="non-empty"):
        load_prompt("[]")


# -- UI format -------------------------------------------------------------------------------------


def ui_workflow():
    return {
        "last_node_id": 3,
        "last_link_id": 2,
        "nodes": [
            {"id": 1, "type": "MakeNumber", "inputs": [],
             "outputs": [{"name": "NUMBER", "type": "NUMBER", "links": [1]}],
             "widgets_values": [2, 3, "fixed"], "mode": 0},
            {"id": 2, "type": "AddNumbers", "outputs": [{"name": "NUMBER", "type": "NUMBER", "links": [2]},
                                                         {"name": "STRING", "type": "STRING", "links": []}],
             "inputs": [{"name": "a", "type": "NUMBER", "link": 1}, {"name": "b", "type": "NUMBER", "link": None}],
             "widgets_values": ["add"], "mode": 0, "title": "adder"},
            {"id": 3, "type": "ShowNumber", "inputs": [{"name": "number", "type": "NUMBER", "link": 2}],
             "outputs": [], "widgets_values": [], "mode": 0},
            {"id": 4, "type": "MarkdownNote", "inputs": [], "outputs": [], "widgets_values": ["# a note"]},
        ],
        "links": [[1, 1, 0, 2, 0, "NUMBER"], [2, 2, 0, 3, 0, "NUMBER"]],
        "version": 0.4,
    }  # fmt: skip


def test_widget_order_includes_frontend_only_widgets():
    assert widget_names(MakeNumber) == ["value", "seed", "control_after_generate"]
    assert widget_names(AddNumbers) == ["mode"]


def test_ui_to_api_matches_what_the_frontend_queues():
    api = ui_to_api(ui_workflow(), CLASSES)
    assert api == {
        "1": {"class_type": "MakeNumber", "inputs": {"value": 2, "seed": 3}},
        "2": {"class_type": "AddNumbers", "inputs": {"mode": "add", "a": ["1", 0]}, "_meta": {"title": "adder"}},
        "3": {"class_type": "ShowNumber", "inputs": {"number": ["2", 0]}},
    }
    assert execute(api, CLASSES).ui == {"3": {"numbers": [5]}}


def test_ui_check_finds_bad_types_links_and_widget_counts():
    ui = ui_workflow()
    ui["nodes"][0]["widgets_values"] = [2, 3]
    ui["links"][1][5] = "STRING"
    ui["nodes"][1]["inputs"][1]["type"] = "IMAGE"
    ui["nodes"].append({"id": 5, "type": "NoSuchNode", "inputs": [], "outputs": [], "widgets_values": []})
    problems = "\n".join(check_ui_workflow(ui, CLASSES))
    assert "node 1 (MakeNumber): 2 widgets_values, expected 3" in problems
    assert "link 2: type STRING but node 2 output is NUMBER" in problems
    assert "input 'b' has type IMAGE" in problems
    assert "node 5 (NoSuchNode): unknown node type" in problems


class AddScaled(AddNumbers):
    """AddNumbers with an optional widget added later (after the required ones, as ComfyUI packs add inputs)."""

    @classmethod
    def INPUT_TYPES(cls):
        types = super().INPUT_TYPES()
        types["optional"]["scale"] = ("INT", {"default": 1, "min": 1})
        return types


def test_a_workflow_saved_before_an_optional_widget_was_added_still_loads():
    classes = {**CLASSES, "AddNumbers": AddScaled}
    assert widget_names(AddScaled) == ["mode", "scale"]
    ui = ui_workflow()  # AddNumbers' widgets_values: ["add"], no "scale"
    assert check_ui_workflow(ui, classes) == []
    assert ui_to_api(ui, classes)["2"]["inputs"] == {"mode": "add", "a": ["1", 0]}  # the node's default applies
    ui["nodes"][1]["widgets_values"] = []
    assert "node 2 (AddNumbers): 0 widgets_values, expected 1 to 2" in "\n".join(check_ui_workflow(ui, classes))


# ---- the output cache ------------------------------------------------------------------------------------------

WATCHED = {"stamp": 1, "fail": False}


class WatchedNumber(MakeNumber):
    """MakeNumber with an IS_CHANGED that reads WATCHED (as a loader's reads its file), and a switch to fail."""

    @classmethod
    def IS_CHANGED(cls, value, seed):
        if WATCHED["stamp"] == "raise":
            raise OSError("cannot stat")
        return WATCHED["stamp"]

    def run(self, value, seed, node_id=None):
        if WATCHED["fail"]:
            raise RuntimeError("flaky")
        return super().run(value, seed, node_id)


WATCHING = {**CLASSES, "WatchedNumber": WatchedNumber}


def watched_prompt():
    return prompt(**{"2": {"class_type": "WatchedNumber", "inputs": {"value": 4, "seed": 0}}})


def test_a_node_whose_inputs_did_not_change_is_not_run_again():
    cache = OutputCache()
    first = execute(prompt(), CLASSES, cache)
    CALLS.clear()
    second = execute(prompt(), CLASSES, cache)
    assert CALLS == [("ShowNumber", 9)]  # the output node always runs
    assert second.cached == {"1", "2", "3"} and set(second.seconds) == {"4"}
    assert second.outputs == first.outputs and second.ui == first.ui == {"4": {"numbers": [9]}}


def test_a_changed_literal_input_reruns_the_node_and_everything_downstream():
    cache = OutputCache()
    execute(prompt(), CLASSES, cache)
    CALLS.clear()
    graph = prompt()
    graph["2"]["inputs"]["value"] = 5
    result = execute(graph, CLASSES, cache)
    assert CALLS == [("MakeNumber", "2"), ("AddNumbers", 5, 5), ("ShowNumber", 10)]
    assert result.cached == {"1"}


def test_is_changed_decides_whether_a_node_reruns():
    cache = OutputCache()
    WATCHED.update(stamp=1, fail=False)
    execute(watched_prompt(), WATCHING, cache)
    CALLS.clear()
    execute(watched_prompt(), WATCHING, cache)
    assert CALLS == [("ShowNumber", 9)]
    WATCHED["stamp"] = 2  # e.g. the file was replaced: it and what it feeds run again
    CALLS.clear()
    assert execute(watched_prompt(), WATCHING, cache).cached == {"1"}
    assert CALLS == [("MakeNumber", "2"), ("AddNumbers", 5, 4), ("ShowNumber", 9)]
    for always in (float("nan"), "raise"):  # as ComfyUI: NaN, or IS_CHANGED raising, means "changed every time"
        WATCHED["stamp"] = always
        for _ in range(2):
            CALLS.clear()
            assert execute(watched_prompt(), WATCHING, cache).cached == {"1"}
            assert [call[0] for call in CALLS] == ["MakeNumber", "AddNumbers", "ShowNumber"]
    WATCHED["stamp"] = 1


def test_a_node_that_raised_is_not_cached_and_the_next_run_works():
    cache = OutputCache()
    WATCHED.update(stamp=1, fail=True)
    with pytest.raises(NodeError, match="flaky"):
        execute(watched_prompt(), WATCHING, cache)
    WATCHED["fail"] = False
    CALLS.clear()
    result = execute(watched_prompt(), WATCHING, cache)
    assert result.ui == {"4": {"numbers": [9]}} and result.cached == {"1"}  # node 1 ran before the failure
    assert CALLS == [("MakeNumber", "2"), ("AddNumbers", 5, 4), ("ShowNumber", 9)]


def test_the_cache_keeps_only_the_latest_prompts_nodes():
    cache = OutputCache()
    execute(prompt(), CLASSES, cache)
    assert len(cache) == 3  # nodes 1, 2, 3: not the output node, not node 9 (which no output needs)
    changed = prompt()
    changed["2"]["inputs"]["value"] = 5
    execute(changed, CLASSES, cache)
    assert len(cache) == 3  # the first prompt's nodes 2 and 3 were dropped, not kept beside the new ones
    CALLS.clear()
    assert execute(prompt(), CLASSES, cache).cached == {"1"}
    assert [call[0] for call in CALLS] == ["MakeNumber", "AddNumbers", "ShowNumber"]


def test_a_node_given_its_id_is_cached_per_id_and_equal_nodes_share_outputs():
    """MakeNumber takes UNIQUE_ID, so (as ComfyUI) its id is part of its signature: two equal MakeNumbers under
    other ids run again; two equal AddNumbers (no id input) in one prompt run once."""
    cache = OutputCache()
    execute(prompt(), CLASSES, cache)
    graph = {("1" + k if k != "4" else k): v for k, v in prompt().items()}
    graph["13"]["inputs"] = {"a": ["11", 0], "b": ["12", 0], "mode": "add"}
    graph["4"]["inputs"]["number"] = ["13", 0]
    graph["5"] = {"class_type": "AddNumbers", "inputs": {"a": ["11", 0], "b": ["12", 0], "mode": "add"}}
    graph["6"] = {"class_type": "ShowNumber", "inputs": {"number": ["5", 0]}}
    CALLS.clear()
    result = execute(graph, CLASSES, cache)
    assert [call[0] for call in CALLS] == ["MakeNumber", "MakeNumber", "AddNumbers", "ShowNumber", "ShowNumber"]
    assert result.cached == {"5"} and result.ui == {"4": {"numbers": [9]}, "6": {"numbers": [9]}}
