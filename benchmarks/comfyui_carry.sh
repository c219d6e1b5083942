#!/usr/bin/env bash
# Prepares .carry/comfyui/ here, for `bash benchmarks/h200.sh server-gpu` on the GPU machine (no network there):
# the ComfyUI source as a tarball and the wheels of the requirements that machine lacks (Python 3.12, x86-64).
# PyAV, the frontend, the templates, SQLAlchemy/alembic, kornia and spandrel stay behind: ComfyUI starts without
# all but PyAV, which h200.sh replaces by a stand-in module (our tests never touch video), and the frontend, which
# `--front-end-root` replaces.
#   bash benchmarks/comfyui_carry.sh /path/to/ComfyUI   (a git checkout or a bare/mirror git directory)
set -euo pipefail
cd "$(dirname "$0")/.."
SOURCE=${1:?give a ComfyUI git checkout}
DEST=.carry/comfyui
rm -rf "$DEST" && mkdir -p "$DEST/wheels"
# the llama tokenizer's blob is absent from some mirrors; the tests never load it
git -C "$SOURCE" archive --format=tar.gz HEAD -- . ':!comfy/text_encoders/llama_tokenizer/tokenizer.json' \
  ':!tests' ':!tests-unit' > "$DEST/comfyui.tar.gz"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST/wheels" \
  pydantic==2.14.4 pydantic_core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 annotated-types==0.8.0 \
  typing-inspection==0.4.5 torchsde==0.2.6 trampoline==0.1.2 websocket-client==1.9.2
du -sh "$DEST"
