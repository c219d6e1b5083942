// A compact status line on Qwen21 nodes after each run: what the fast paths did.
//
// The sampler and VAE nodes return {"ui": {"qwen21_stats": [dict], "qwen21_status": [text]}}; the
// text is formatted on the server (nodes/model.py), so API clients and the canvas read the same line.
// ComfyUI hands that dict to the node's onExecuted after every run, so the line appears after the
// first run and is replaced on each later one. It lives in a read-only widget that is left out of the
// saved workflow and of the prompt sent to the server.

import { app } from "../../scripts/app.js";

const STATUS_WIDGET = "qwen21_status";
const LINE_HEIGHT = 15;
const FONT = "11px sans-serif";
const MARGIN = 15;

function statusText(output) {
    const text = output?.qwen21_status?.at(-1);
    return typeof text === "string" && text ? text : null;
}

const measureContext = document.createElement("canvas").getContext("2d");

// Greedy wrap at the " · " separators so a part is never split across lines.
function wrapParts(text, width) {
    measureContext.font = FONT;
    const lines = [];
    for (const part of text.split(" · ")) {
        const candidate = lines.length ? `${lines.at(-1)} · ${part}` : part;
        if (lines.length && measureContext.measureText(candidate).width <= width) {
            lines[lines.length - 1] = candidate;
        } else {
            lines.push(part);
        }
    }
    return lines;
}

function statusWidget(node) {
    const existing = node.widgets?.find((widget) => widget.name === STATUS_WIDGET);
    if (existing) return existing;
    const widget = {
        name: STATUS_WIDGET,
        type: STATUS_WIDGET,
        value: "",
        serialize: false, // not in the saved workflow's widgets_values
        options: { serialize: false }, // not in the prompt sent to the server
        computeSize(width) {
            const lines = wrapParts(this.value, (width ?? node.size[0]) - 2 * MARGIN).length;
            return [width ?? node.size[0], lines * LINE_HEIGHT + 6];
        },
        draw(ctx, _node, width, y) {
            ctx.save();
            ctx.font = FONT;
            ctx.fillStyle = LiteGraph.WIDGET_SECONDARY_TEXT_COLOR ?? "#999";
            ctx.textAlign = "left";
            ctx.textBaseline = "top";
            wrapParts(this.value, width - 2 * MARGIN).forEach((line, i) => {
                ctx.fillText(line, MARGIN, y + 3 + i * LINE_HEIGHT);
            });
            ctx.restore();
        },
    };
    const added = node.addCustomWidget(widget);
    // Image previews ("$$canvas-image-preview") paint down to the node's bottom edge: stay above them.
    const preview = node.widgets.findIndex((w) => w.name?.startsWith("$$"));
    if (preview >= 0) {
        node.widgets.splice(node.widgets.indexOf(added), 1);
        node.widgets.splice(preview, 0, added);
    }
    return added;
}

function showStatus(node, text) {
    const widget = statusWidget(node);
    widget.value = text;
    const needed = node.computeSize();
    if (needed[1] > node.size[1]) node.setSize([node.size[0], needed[1]]);
    node.setDirtyCanvas(true, true);
}

app.registerExtension({
    name: "qwen21.runStatus",

    async beforeRegisterNodeDef(nodeType, nodeData) {
        if (!nodeData.category?.startsWith("Qwen21")) return;
        const onExecuted = nodeType.prototype.onExecuted;
        nodeType.prototype.onExecuted = function (output) {
            const result = onExecuted?.apply(this, arguments);
            const text = statusText(output);
            if (text) showStatus(this, text);
            return result;
        };
    },
});
