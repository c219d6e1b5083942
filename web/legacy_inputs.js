// Older saved workflows, opened on the canvas: the loaders' offload_text_encoder was an on/off switch and is now a
// choice (auto / always / never). A workflow saved with the switch holds true or false there; shown as is, the
// combo would display a value it does not offer. On load this maps it to the choice it meant (on = always,
// off = never), the same mapping the server applies to such a value (qwen21_core/memory/manager.py).

import { app } from "../../scripts/app.js";

const LOADERS = new Set(["Qwen21ModelLoader", "Qwen21DiffusersLoader"]);
const LEGACY = new Map([[true, "always"], [false, "never"]]);

app.registerExtension({
    name: "qwen21.legacyInputs",
    loadedGraphNode(node) {
        if (!LOADERS.has(node.comfyClass ?? node.type)) return;
        const widget = node.widgets?.find((w) => w.name === "offload_text_encoder");
        if (widget && LEGACY.has(widget.value)) widget.value = LEGACY.get(widget.value);
    },
});
