// Condition-image sockets of the Qwen21 encoder that grow as they are used.
//
// The node declares image_1..image_N and mask_1..mask_N as optional inputs. Showing all of them
// would bury the node, so the canvas keeps every pair up to the last connected one plus one empty
// pair to connect next; trailing empty pairs beyond that are removed. Only trailing sockets are ever
// added or removed, so the slots of connected sockets keep their positions and saved workflows
// reload with the same sockets and links.

import { app } from "../../scripts/app.js";

const ENCODER_NODES = new Set(["Qwen21Encode"]);
const IMAGE_INPUT = /^image_(\d+)$/;
const PAIR_INPUT = /^(?:image|mask)_(\d+)$/;
const PAIR_TYPES = [
    ["image", "IMAGE"],
    ["mask", "MASK"],
];

function declaredImageCount(nodeData) {
    const optional = Object.keys(nodeData.input?.optional ?? {});
    return optional.filter((name) => IMAGE_INPUT.test(name)).length;
}

function pairIndex(input) {
    const match = PAIR_INPUT.exec(input.name);
    return match ? Number(match[1]) : 0;
}

function lastConnectedPair(node) {
    let last = 0;
    for (const input of node.inputs ?? []) {
        if (input.link != null) last = Math.max(last, pairIndex(input));
    }
    return last;
}

function isDraggingLink() {
    return Boolean(app.canvas?.linkConnector?.isConnecting);
}

// Make the sockets match the connections: pairs 1..last connected + 1 (at most `maxPairs`).
function syncSockets(node, maxPairs) {
    if (node.qwen21Syncing || !node.inputs) return;
    const wanted = Math.min(maxPairs, lastConnectedPair(node) + 1);
    const surplus = node.inputs.some((input) => pairIndex(input) > wanted);
    if (surplus && isDraggingLink()) {
        // Removing a socket under a link being dragged would drop the link; retry once it lands.
        if (!node.qwen21SyncPending) {
            node.qwen21SyncPending = true;
            requestAnimationFrame(() => {
                node.qwen21SyncPending = false;
                syncSockets(node, maxPairs);
            });
        }
        return;
    }
    node.qwen21Syncing = true;
    try {
        let removed = 0;
        for (let slot = node.inputs.length - 1; slot >= 0; slot--) {
            if (pairIndex(node.inputs[slot]) > wanted) {
                node.removeInput(slot);
                removed++;
            }
        }
        for (let pair = 1; pair <= wanted; pair++) {
            for (const [kind, type] of PAIR_TYPES) {
                const name = `${kind}_${pair}`;
                if (node.findInputSlot(name) < 0) node.addInput(name, type);
            }
        }
        if (removed) shrinkBy(node, removed);
    } finally {
        node.qwen21Syncing = false;
    }
}

// Give back the height of removed socket rows, but never below what the node needs.
function shrinkBy(node, removedRows) {
    const minimum = node.computeSize();
    const height = Math.max(minimum[1], node.size[1] - removedRows * LiteGraph.NODE_SLOT_HEIGHT);
    node.setSize([Math.max(node.size[0], minimum[0]), height]);
    node.setDirtyCanvas(true, true);
}

app.registerExtension({
    name: "qwen21.conditionImages",

    async beforeRegisterNodeDef(nodeType, nodeData) {
        if (!ENCODER_NODES.has(nodeData.name)) return;
        const maxPairs = declaredImageCount(nodeData);
        if (maxPairs === 0) return;

        const onNodeCreated = nodeType.prototype.onNodeCreated;
        nodeType.prototype.onNodeCreated = function () {
            const result = onNodeCreated?.apply(this, arguments);
            syncSockets(this, maxPairs);
            return result;
        };

        // configure() replaces the sockets with the saved ones and reports each as a connection
        // change; sync once at the end instead of on every one of those reports.
        const configure = nodeType.prototype.configure;
        nodeType.prototype.configure = function () {
            this.qwen21Configuring = true;
            try {
                return configure.apply(this, arguments);
            } finally {
                this.qwen21Configuring = false;
                syncSockets(this, maxPairs);
            }
        };

        const onConnectionsChange = nodeType.prototype.onConnectionsChange;
        nodeType.prototype.onConnectionsChange = function (slotType) {
            const result = onConnectionsChange?.apply(this, arguments);
            if (slotType === LiteGraph.INPUT && !this.qwen21Configuring) syncSockets(this, maxPairs);
            return result;
        };
    },
});
