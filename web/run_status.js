// A compact status line on Qwen21 nodes after each run: what the fast paths did.
//
// The sampler and VAE nodes return {"ui": {"qwen21_stats": [dict], "qwen21_status": [text]}}.
// ComfyUI hands that dict to the node's onExecuted on every run (cached runs included), so the line
// appears after the first run and is replaced on each later one. It lives in a read-only widget that
// is left out of the saved workflow and of the prompt sent to the server.

import { app } from "../../scripts/app.js";

const STATUS_WIDGET = "qwen21_status";
const LINE_HEIGHT = 15;
const FONT = "11px sans-serif";
const MARGIN = 15;

// ---- formatting ----------------------------------------------------------------------------------

function formatMiB(mib) {
    return mib >= 1024 ? `${(mib / 1024).toFixed(2)} GiB` : `${Number(mib).toFixed(1)} MiB`;
}

function formatSeconds(seconds) {
    return seconds < 10 ? `${seconds.toFixed(2)} s` : `${seconds.toFixed(1)} s`;
}

function prefixCachePart(stats) {
    const size = stats.prefix_cache_mib != null ? ` ${formatMiB(stats.prefix_cache_mib)}` : "";
    switch (stats.prefix_cache) {
        case "reused":
            return `prefix cache hit${size}`; // K/V kept from an earlier run with the same conditioning
        case "on":
            return `prefix cache built${size}`; // computed at step 1, reused by the later steps
        case "off":
            return "prefix cache off";
        default:
            return `prefix cache ${stats.prefix_cache}`;
    }
}

// "replay" | "off" | "off: reason; reason" | "replay, reason" (some shapes fell back to eager).
function decodeGraphPart(value) {
    const [, state, why] = /^(\w+)(?:[:,]\s*(.*))?$/s.exec(String(value)) ?? [null, String(value), ""];
    const mode = state === "replay" ? "graphs replayed" : `graphs ${state}`;
    return why ? `${mode} (${why})` : mode;
}

function vaePathPart(stats) {
    if (!stats.tiled) return "untiled";
    const size = stats.tile_size ? ` of ${stats.tile_size}px` : "";
    return `tiled (${stats.tiles} tiles${size})`;
}

/** The status parts for one node's stats dict, in reading order. */
export function statusParts(stats) {
    const parts = [];
    if (stats.steps_per_second != null) {
        parts.push(`${Number(stats.steps_per_second).toFixed(2)} steps/s`);
        if (stats.steps != null && stats.seconds != null) {
            parts.push(`${stats.steps} steps in ${formatSeconds(stats.seconds)}`);
        }
    } else if (stats.seconds != null) {
        parts.push(formatSeconds(stats.seconds));
    }
    if (stats.prefix_cache != null) parts.push(prefixCachePart(stats));
    if (stats.decode_graph != null) parts.push(decodeGraphPart(stats.decode_graph));
    if (stats.tiled != null) parts.push(vaePathPart(stats));
    if (stats.oom_retries) parts.push(`${stats.oom_retries} OOM retries`);
    if (stats.quality != null) parts.push(stats.quality);
    if (stats.precision != null) parts.push(stats.precision);
    if (stats.peak_vram_mib != null) parts.push(`peak VRAM ${formatMiB(stats.peak_vram_mib)}`);
    return parts;
}

function statusText(output) {
    const stats = output?.qwen21_stats?.at(-1);
    if (stats && typeof stats === "object") return statusParts(stats).join(" · ");
    const text = output?.qwen21_status?.at(-1);
    return typeof text === "string" ? text : null;
}

// ---- the widget ----------------------------------------------------------------------------------

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
        draw(ctx, drawnNode, width, y) {
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
