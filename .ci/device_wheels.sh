#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has torch, numpy, scipy, transformers, ... but not hivemind and its
# needs), for its Python (3.12), into .whl/ (git-ignored through .git/info/exclude): the versions this
# checkout's .venv holds. Then `.ci/device_check.sh` runs there with `carry: [".whl"]`.
# Usage: .ci/device_wheels.sh   (here, once per session; about 30 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
PIP=.venv/bin/pip
names='hivemind|base58|configargparse|cryptography|cffi|pycparser|grpcio|grpcio-tools|protobuf|netaddr|py-cid|py-multihash|py-multibase|py-multicodec|morphys|blake3|mmh3|pydantic|pydantic_core|annotated-types|typing-inspection|typing_extensions'
platforms=()
for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
for pin in $($PIP list --format freeze 2>/dev/null | grep -iE "^($names)=="); do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$pin"
done
# sdist-only needs: built here (pure Python)
$PIP wheel -q --no-deps -w .whl $($PIP list --format freeze 2>/dev/null | grep -iE "^(prefetch.generator|varint|python-baseconv)==")
ls .whl | wc -l
